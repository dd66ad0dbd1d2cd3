"""Every CUDA source compiles with nvcc (object-only; no GPU here) for sm_80 and sm_90a.

The kernels' bodies are executed on the CPU by the SIMT tests (tests/simt); this test proves the
same sources are valid CUDA for the architectures users run.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_every_cu_file_compiles_for_sm80_and_sm90a():
    sources = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    assert sources, "no CUDA sources found"
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "check_cuda_compile.sh")],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    for src in sources:
        assert src.name in output, f"{src.name} not reported by the compile check:\n{output[-3000:]}"
