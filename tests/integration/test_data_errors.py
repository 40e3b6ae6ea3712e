"""Damaged training data found as it is read: one line naming the file and the document, never an IndexError."""

import re
import sys

import pytest

from tests.integration.pretrain_utils import CORPUS, TINY
from tests.integration.scripts import PRETRAIN, run, script_in_process


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_token_id_outside_the_vocabulary_is_one_line_naming_the_file_and_document(tmp_path, workers, capsys):
    """A .bin of the right length whose ids are damaged (here: every document's first token 60000): one line
    naming the file and the document, from the main process or from a data worker; not an IndexError."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    import numpy as np
    import shutil

    prefix = str(tmp_path / "corpus_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(CORPUS + suffix, prefix + suffix)
    index = IndexedDataset(prefix).index
    data = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r+")
    data[np.asarray(index.sequence_pointers) // np.dtype(index.dtype).itemsize] = 60000
    data.flush()
    args = list(TINY)
    args[args.index("--data-path") + 1] = prefix
    args[args.index("--num-workers") + 1] = workers
    args += ["--train-iters", "2", "--data-cache-path", str(tmp_path)]
    # the real script where a data worker reports it; the main process's through the script's entry point
    proc = run([sys.executable, PRETRAIN] + args) if workers != "0" else script_in_process(args, capsys)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert re.search(
        r"corpus_text_document\.bin: token id 60000 in document \d+(, \d+)* \(train sample \d+\) is "
        r"outside the model's vocabulary \(0\.\.383\)",
        lines[0],
    ), lines[0]
