import pytest
import torch

from moezero.ops import _loader


@pytest.fixture(scope="session")
def cpu_ext():
    """The compiled CPU kernels; tests that need them skip when the extension is not built."""
    ext = _loader.load("cpu")
    if ext is None:
        pytest.skip("moezero._C is not built (or MOEZERO_DISABLE_EXT=1)")
    return ext


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request):
    """Runs a test serially and with two OpenMP threads (the chunked parallel paths)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
