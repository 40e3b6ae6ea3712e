import pytest

from tests.areas import AREAS, areas_of


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "world_size(n): spawns n gloo ranks")
    for area, (covers, _) in AREAS.items():
        config.addinivalue_line("markers", f"{area}: {covers}")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        for area in areas_of(str(item.path)):
            item.add_marker(getattr(pytest.mark, area))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from tests.dist_utils import close_all_pools

    close_all_pools()
