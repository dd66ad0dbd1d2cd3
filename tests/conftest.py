import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Small KV cache for engine tests unless the caller chose one.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture(scope="session")
def plain_greedy(tiny_target):
    """Non-speculative greedy fp32 output of the tiny target: the reference for lossless modes."""
    import gc

    from vllm import LLM, SamplingParams

    from tiny_models import prompts

    llm = LLM(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=8, seed=0)
    try:
        outs = llm.generate(prompts(GREEDY_PROMPTS),
                            SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS))
        result = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    finally:
        del llm
        gc.collect()
    return result
