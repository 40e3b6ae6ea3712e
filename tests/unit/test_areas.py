"""Every test file belongs to at least one area marker (tests/areas.py), so `pytest -m <area>` misses none."""

from pathlib import Path

from tests.areas import AREAS, areas_of

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_an_area():
    files = sorted(f for f in TESTS.glob("*/test_*.py") if f != Path(__file__).resolve())
    assert len(files) > 50
    homeless = [str(f.relative_to(TESTS)) for f in files if not areas_of(str(f))]
    assert not homeless, f"add these to tests/areas.py: {homeless}"


def test_areas_from_file_names():
    assert areas_of("tests/distributed/test_zero_stage3.py") == ["zero"]
    assert areas_of("tests/ops/test_library.py") == ["ops"]
    assert set(areas_of("/x/tests/integration/test_hf_checkpoint.py")) == {"hf", "checkpoint"}
    assert all(words for _, words in AREAS.values())
