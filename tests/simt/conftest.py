import sys
from pathlib import Path

# tests/simt/simt_build.py is imported as `simt_build` by the tests of this directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))
