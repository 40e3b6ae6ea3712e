"""Extension loading: one warning on fallback, the env overrides, and no silent fallback in CI."""

import logging
import os
import shutil
import subprocess
import sys

import pytest

from moezero.ops import _library, _loader, reference

MISSING = "moezero._C_missing_for_test"


@pytest.fixture
def missing_cpu_module(monkeypatch):
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    monkeypatch.delenv(_loader.REQUIRE_ENV, raising=False)
    monkeypatch.setitem(_loader.MODULES, "cpu", MISSING)
    _loader._import.cache_clear()
    yield
    _loader._import.cache_clear()


def test_fallback_logs_one_warning(missing_cpu_module, caplog):
    with caplog.at_level(logging.WARNING, logger=_loader.__name__):
        assert _loader.load("cpu") is None
        assert _loader.load("cpu") is None
    assert len(caplog.records) == 1 and MISSING in caplog.records[0].getMessage()
    assert _library.kernel("permute", _device("cpu")) is reference.permute


def test_require_turns_fallback_into_error(missing_cpu_module, monkeypatch):
    monkeypatch.setenv(_loader.REQUIRE_ENV, "1")
    with pytest.raises(RuntimeError, match=MISSING):
        _loader.load("cpu")


def test_disable_forces_reference(monkeypatch):
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")
    assert _loader.load("cpu") is None
    for name in ("permute", "unpermute_combine", "flatten_into", "sum_of_squares"):
        assert _library.kernel(name, _device("cpu")) is getattr(reference, name)


def test_unknown_device_uses_reference():
    assert _loader.load("mps") is None
    assert _library.kernel("permute", _device("meta")) is reference.permute


def test_extension_is_built_where_a_compiler_is(monkeypatch):
    """CI must not pass on a silent fallback: with a C++ compiler present, moezero._C loads."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on PATH")
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    assert _loader.load("cpu") is not None, "moezero._C did not build/load; run `pip install --no-build-isolation -e .`"


def test_wired_ops_exist_in_the_extension(cpu_ext):
    for device_type, names in _library.WIRED.items():
        for name in names:
            assert hasattr(cpu_ext, name) and hasattr(reference, name), (device_type, name)


def _device(kind):
    import torch

    return torch.device(kind)


def test_the_extension_shares_the_process_libstdcxx(cpu_ext):
    """A libstdc++ linked into the extension statically can turn every TORCH_CHECK in it into a segfault (its
    own copy of ostream formats the message against the process's locale). Seen on a GPU image whose CXX, a
    /opt/gcc/bin/g++ wrapper script, built a _C without libstdc++ in ldd (GCC 13's, in a process holding a newer
    one); CXX=/usr/bin/g++ fixed it. The same static link with GCC 12 and torch 2.13 happened to work here: only
    the dynamic link is safe everywhere, and setup.py names libstdc++ on the link line to get it."""
    if shutil.which("ldd") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs ldd (Linux)")
    linked = subprocess.run(["ldd", cpu_ext.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++" in linked, f"{cpu_ext.__file__} has libstdc++ linked in statically; rebuild with another CXX"
