import sys
from pathlib import Path

# tests/simt/simt_build.py is imported as `simt_build` by the tests of this directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# The `simt` marker is registered in pyproject.toml; every test of this directory carries it.
def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if "tests/simt/" in str(item.fspath):
            item.add_marker(pytest.mark.simt)
