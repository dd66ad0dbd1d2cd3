import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _two_threads():
    # CI and the shared dev machine have 2 cores.
    torch.set_num_threads(2)


@pytest.fixture(params=["hardware", "emulated"])
def amx_tiles(request, monkeypatch):
    """The AMX tiles an op's AMX path runs on: the instructions (CPUs with AMX) or their software model
    (SPARSEVER_CPU_AMX_EMULATE=1: the AVX-512 build on a CPU with AVX512-BF16, csrc/cpu/amx_tiles.h).
    Returns a check that the op's tile products ran on that backend (none emulated on "hardware")."""
    import vllm_sparsever._custom_ops as ops

    if request.param == "hardware":
        if not ops.amx_available():
            pytest.skip("needs a CPU with AMX-BF16")
        monkeypatch.delenv("SPARSEVER_CPU_AMX_EMULATE", raising=False)
    else:
        if not ops.amx_emulation_available():
            pytest.skip("the AMX emulation needs the AVX-512 build on a CPU with AVX512-BF16")
        monkeypatch.setenv("SPARSEVER_CPU_AMX_EMULATE", "1")
    before = ops.amx_emulated_products()

    def ran(expected: bool = True) -> None:
        emulated = ops.amx_emulated_products() - before
        if request.param == "emulated":
            assert (emulated > 0) == expected, f"{emulated} emulated tile products; expected some: {expected}"
        else:
            assert emulated == 0

    return ran
