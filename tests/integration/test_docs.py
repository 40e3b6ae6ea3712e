"""The README and the docs site are checked, so they cannot drift from the code:

- the site builds with MkDocs in strict mode (a broken link, a missing anchor or a page outside the navigation
  fails), and the README's links reach existing pages;
- the README's Python example runs as it is;
- every shell command shown in a ```bash block runs here: the tools that work on small inputs run for real on a
  tiny Hub folder, corpus and checkpoint named as the docs name them; a launch line of the pretraining script has
  its flags parsed by the script's parser and its configs resolved (from the Hub folder or checkpoint it names) and
  checked for the process count it gives, as the script does at start; a benchmark (hours) and a tool that needs a
  trained quantized model have their flags parsed by their own parser; a make target is dry-run.
A command no rule covers fails the test, so a new command gets a rule when it is written.
"""

import argparse
import contextlib
import glob
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Iterator, List, Tuple
from unittest import mock

import pytest

from tests.areas import areas_of
from tests.integration.pretrain_utils import CORPUS, TINY, configs, train
from tests.integration.scripts import ENV, REPO, run

PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
PRETRAIN = "examples_moe/pretrain_gpt_moe.py"
RUN_FOR_REAL = {
    "tools/preprocess_data.py",
    "tools/hf_checkpoint.py",
    "tools/generate.py",
    "tools/export_quantized.py",
    "tools/consolidate_checkpoint.py",
}


def _blocks(path: str, language: str) -> Iterator[str]:
    with open(path) as f:
        text = f.read()
    yield from re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def doc_commands() -> List[Tuple[str, List[str]]]:
    """(page, words) of every command in the pages' bash blocks, continuation lines joined, comments dropped;
    a command shown on several pages once."""
    found = {}
    for page in PAGES:
        for block in _blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    found.setdefault(tuple(words), os.path.relpath(page, REPO))
    return [(page, list(words)) for words, page in found.items()]


# ---- the site and the README ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as `mkdocs build --strict` writes it (built once for the tests that read it)."""
    path = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(ENV, NO_MKDOCS_2_WARNING="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return path


def test_the_site_builds_in_strict_mode(site):
    assert os.path.exists(site / "stage3" / "index.html")


def test_the_site_search_finds_a_tool_by_a_word_of_its_name(site):
    """Every section that names tools/preprocess_data.py is found by "preprocess", split as the site's search
    splits words (its separator, from the built index: MkDocs' default splits only at spaces and hyphens)."""
    with open(site / "search" / "search_index.json") as f:
        index = json.load(f)
    separator = re.compile(index["config"]["separator"])

    def words(doc) -> set:
        return set(separator.split(re.sub(r"<[^>]+>", " ", doc["title"] + " " + doc["text"]).lower()))

    naming = [doc for doc in index["docs"] if "preprocess_data" in doc["title"] + doc["text"]]
    assert {"getting-started/#your-own-corpus", "megatron/#data"} <= {doc["location"] for doc in naming}
    assert not [doc["location"] for doc in naming if "preprocess" not in words(doc)]


def test_flag_names_in_tables_do_not_wrap(site):
    """The site's stylesheet keeps a table cell's code on one line (a flag never breaks at its hyphens), and
    every page links it."""
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        sheets = re.findall(r"^extra_css:\n((?:  - .*\n)+)", f.read(), re.M)
    sheets = [line.strip()[2:] for line in sheets[0].splitlines()] if sheets else []
    rules = "".join(open(site / sheet).read() for sheet in sheets if os.path.exists(site / sheet))
    assert re.search(r"td code[^{]*\{[^}]*white-space:\s*nowrap", rules), f"no nowrap rule for td code in {sheets}"
    for page in ("index.html", "megatron/index.html", "troubleshooting/index.html"):
        html = (site / page).read_text()
        assert all(re.search(rf'href="[./]*{re.escape(sheet)}', html) for sheet in sheets), page


def test_every_zero_module_has_its_design_note_on_the_site():
    with open(os.path.join(REPO, "docs", "zero-internals.md")) as f:
        shown = set(re.findall(r"^::: moezero\.zero\.(\w+)$", f.read(), re.M))
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "moezero", "zero", "*.py"))}
    assert modules - {"__init__"} <= shown, f"add to docs/zero-internals.md: {sorted(modules - shown - {'__init__'})}"


LIFE_ROW = re.compile(r"^\| (\d+) \| \[`([\w.]+)`\]\(#(moezero[\w.]+)\): `(\w+)` \|", re.M)


def test_the_life_of_a_gradient_names_classes_of_the_files_it_links():
    """Each row of the internals page's "life of" tables links a module shown on that page and names a class
    defined at the top of that module's file; the rows of each table are numbered in order."""
    import ast

    with open(os.path.join(REPO, "docs", "zero-internals.md")) as f:
        page = f.read()
    shown = set(re.findall(r"^::: (moezero[\w.]+)$", page, re.M))
    rows = LIFE_ROW.findall(page)
    assert len(rows) >= 20, "the two tables, a row each per step"
    numbers = [int(number) for number, *_ in rows]
    assert all(b in (a + 1, 1) for a, b in zip(numbers, numbers[1:])), numbers
    for number, file_name, module, cls in rows:
        path = os.path.join(REPO, *module.split(".")) + ".py"
        assert module in shown and os.path.basename(path) == file_name, f"row {number}: {file_name} -> #{module}"
        with open(path) as source:
            classes = {node.name for node in ast.parse(source.read()).body if isinstance(node, ast.ClassDef)}
        assert cls in classes, f"row {number}: {file_name} defines no class {cls}"
    gradient = LIFE_ROW.findall(page.split("## The life of a stage-3 unit")[0])
    files, classes = {row[2] for row in gradient}, {row[3] for row in gradient}
    assert len(files) <= 8 and len(classes) <= 10, (
        f"a stage-2 gradient crosses {len(classes)} classes in {len(files)} files (issue 74 asks <= 10 in <= 8)"
    )


def _moezero_exception_classes() -> List[type]:
    """Every exception class defined in moezero's Python modules (imported, so inherited ones count)."""
    import importlib
    import inspect

    found = {}
    for path in glob.glob(os.path.join(REPO, "moezero", "**", "*.py"), recursive=True):
        module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        for _, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("moezero"):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


def test_the_troubleshooting_page_names_every_error_class():
    """A class of error moezero raises is on docs/troubleshooting.md, with what it means and the fix."""
    with open(os.path.join(REPO, "docs", "troubleshooting.md")) as f:
        page = f.read()
    classes = _moezero_exception_classes()
    assert len(classes) >= 15, [cls.__name__ for cls in classes]
    missing = sorted(cls.__name__ for cls in classes if not re.search(rf"\b{cls.__name__}\b", page))
    assert not missing, f"say in docs/troubleshooting.md what these mean and how to fix them: {missing}"


def test_the_hugging_face_page_lists_every_family():
    """The families table of docs/huggingface.md names every model_type moezero reads (aliases included)."""
    from moezero.hf.families import ALIASES, FAMILIES

    with open(os.path.join(REPO, "docs", "huggingface.md")) as f:
        table = f.read().split("## Families", 1)[1].split("\n\n")[1]
    listed = set(re.findall(r"`(\w+)`", " ".join(row.split("|")[2] for row in table.splitlines()[2:])))
    assert listed == set(FAMILIES) | set(ALIASES), sorted(listed ^ (set(FAMILIES) | set(ALIASES)))


def _layout_entries() -> Iterator[Tuple[str, str]]:
    """(path, description) of each entry of docs/layout.md's tree."""
    block = next(_blocks(os.path.join(REPO, "docs", "layout.md"), "text"))
    entry = None
    for line in block.splitlines():
        if line[:1].strip():
            if entry:
                yield entry
            path, _, description = line.partition(" ")
            entry = (path, description)
        elif entry:
            entry = (entry[0], entry[1] + " " + line.strip())
    if entry:
        yield entry


def test_the_layout_page_names_every_module_and_only_existing_ones():
    named = set()
    for path, description in _layout_entries():
        folder = path if path.endswith("/") else ""
        for name in [path] if not folder else re.findall(r"[\w*/]+\.(?:py|json)\b", description):
            found = glob.glob(os.path.join(REPO, folder, name))
            assert found, f"docs/layout.md names {folder}{name}, which does not exist"
            named.update(os.path.relpath(f, REPO) for f in found)
    modules = {
        os.path.relpath(p, REPO)
        for p in glob.glob(os.path.join(REPO, "moezero", "**", "*.py"), recursive=True)
        if not os.path.basename(p).startswith("_")
    }
    assert not sorted(modules - named), f"say in docs/layout.md what these hold: {sorted(modules - named)}"


def test_the_readme_links_reach_pages():
    with open(PAGES[0]) as f:
        targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", f.read())
    local = [t for t in targets if not re.match(r"https?://", t)]
    assert local, "the README links to the docs"
    assert not [t for t in local if not os.path.exists(os.path.join(REPO, t))]


def test_the_readme_python_example_runs(tmp_path):
    blocks = list(_blocks(PAGES[0], "python"))
    assert blocks
    for block in blocks:
        (tmp_path / "example.py").write_text(block)
        result = subprocess.run(
            [sys.executable, "example.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr


# ---- the commands -----------------------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised where a script's own parser finished: its flags were accepted; nothing else ran."""


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_args_then_stop(self, args=None, namespace=None):
        depth[0] += 1
        try:
            namespace = parse_args(self, args, namespace)
        finally:
            depth[0] -= 1
        raise _Parsed(namespace)

    def parse_known_args_then_stop(self, args=None, namespace=None):  # a tool calling it directly
        depth[0] += 1
        try:
            result = parse_known_args(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise _Parsed(result[0])
        return result

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args_then_stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args_then_stop),
    ):
        yield


def _parse_only(script: str, argv: List[str], timeout: float = 60) -> None:
    """Run `script` until its parser finished; a script that gets past it without one fails, not runs for hours."""

    def too_long(*_):
        raise TimeoutError(f"{script} ran {timeout} s without reaching an argparse parser")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with _stop_after_parsing(), mock.patch.object(sys, "argv", [script, *argv]), pytest.raises(_Parsed):
            runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _launch(words: List[str]) -> Tuple[int, str, List[str]]:
    """(process count, script, its arguments) of `python S ...` or `torchrun [--opts] S ...`."""
    if words[0] == "python":
        return 1, words[1], words[2:]
    if words[0] != "torchrun":
        pytest.fail(f"no rule checks this command: {shlex.join(words)} (add one to tests/integration/test_docs.py)")
    nproc, i = 1, 1
    while words[i].startswith("--"):
        flag, _, value = words[i].partition("=")
        if not value and flag == "--nproc_per_node":
            value, i = words[i + 1], i + 1
        if flag == "--nproc_per_node":
            nproc = int(value)
        i += 1
    return nproc, words[i], words[i + 1 :]


def _check_launch_line(argv: List[str], world: int) -> None:
    """The configs the script would run with (the Hub folder's or checkpoint's model where the line takes it
    from there, resolved as the script resolves them), passing the checks the script makes at start for `world`
    processes. A line that would resume its own run (--load without --use-checkpoint-args) is checked as that
    run's first launch: the workdir's `ckpt` holds another command's tiny model, and its --save folders other
    commands' checkpoints (a first launch saves into a new folder)."""
    import dataclasses

    from moezero.training.configs import validate
    from moezero.training.run_start import resolve_start

    cfg = configs(argv)
    load = cfg.checkpoint.load if cfg.checkpoint.use_checkpoint_args else None
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=load, save=None))
    start = resolve_start(cfg)
    assert start.point is not None or not cfg.checkpoint.use_checkpoint_args, (
        f"--load {cfg.checkpoint.load}: the docs' earlier command should have made it"
    )
    validate(start.cfg, world)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding what the docs' commands name: the Hub folders, a corpus, a trained checkpoint."""
    hf_oracle = pytest.importorskip("tests.hf_oracle")
    path = tmp_path_factory.mktemp("docs_commands")
    long = dict(max_position_embeddings=4096)  # the launch lines keep the script's sequence length
    hf_oracle.tiny_model("qwen3_moe", num_experts=8, **long).save_pretrained(path / "Qwen3-30B-A3B")
    hf_oracle.tiny_model("deepseek_v3", **long).save_pretrained(path / "DeepSeek-V3")
    with open(path / "docs.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n")
    (path / "ckpt").mkdir()
    os.symlink(path / "ckpt" / "qwen3", path / "ckpt" / "tuned")  # the fine-tuned run's checkpoint, as exported
    train(TINY + ["--train-iters", "2", "--save", str(path / "ckpt"), "--qat-weight-bits", "8"], str(path / "cache"))
    for suffix in (".bin", ".idx"):  # my_corpus_text_document until the docs' preprocess_data writes it
        shutil.copy(CORPUS + suffix, path / f"my_corpus_text_document{suffix}")
    return path


def _area_run(argv: List[str]) -> List[str]:
    """`pytest -m AREA` over the area's test files and one file outside it rather than the whole suite: the
    marker must still select the area's tests and deselect the other file's, while the suite's own collection
    is what catches a file that fails to import. Any other pytest line runs as written."""
    if argv[:1] != ["-m"] or len(argv) != 2:
        return argv
    files = sorted(glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True))
    inside = [path for path in files if argv[1] in areas_of(path)]
    outside = next(path for path in files if argv[1] not in areas_of(path))
    assert inside, f"-m {argv[1]}: no test file of that area"
    return [*argv, *inside, outside]


def _check(words: List[str], cwd) -> None:
    if words[0] == "make":
        result = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    elif words[0] == "tensorboard":
        result = run([sys.executable, "-m", "tensorboard.main", *words[1:], "--inspect"], timeout=120)
        assert result.returncode == 0, result.stderr
    elif words[0].endswith("python") and words[1:3] == ["-m", "pytest"]:
        result = run([sys.executable, "-m", "pytest", *_area_run(words[3:]), "--collect-only", "-q"], timeout=300)
        assert result.returncode == 0 and re.search(r"[1-9]\d*(/\d+)? tests collected", result.stdout), result.stdout[
            -2000:
        ]
    else:
        world, script, argv = _launch(words)
        if script == PRETRAIN:
            _check_launch_line(argv, world)
        elif script in RUN_FOR_REAL and world == 1:
            result = subprocess.run(
                [sys.executable, os.path.join(REPO, script), *argv],
                cwd=cwd,
                env=ENV,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        else:
            _parse_only(script, argv)


def test_every_command_in_the_docs_runs(workdir, monkeypatch):
    monkeypatch.chdir(workdir)  # relative paths in the commands are the workdir's
    commands = doc_commands()
    assert len(commands) > 20
    failures = []
    for page, words in commands:
        try:
            _check(words, workdir)
        except BaseException as exc:  # SystemExit from a parser's error included
            failures.append(f"{page}: {shlex.join(words)}\n    {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
