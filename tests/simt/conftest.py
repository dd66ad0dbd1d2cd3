import sys
from pathlib import Path

# tests/simt/simt_build.py is imported as `simt_build` by the tests of this directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "simt: runs CUDA kernel bodies on the SIMT executor (first run compiles the test extensions)"
    )


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if "tests/simt/" in str(item.fspath):
            item.add_marker(pytest.mark.simt)
