"""`LLM()` with tensor parallelism over a Ray cluster (run by tests/e2e/test_ray_cpu.py in its own
process: the platform is chosen per process, from VLLM_SPARSEVER_RAY_CPU).

    python ray_llm_job.py TARGET DRAFT OUT.json

Writes greedy tokens, worker info and metrics, then kills one worker and records what the next
request raised and how long it took.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from vllm import LLM, SamplingParams

    from conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPTS
    from tiny_models import prompts
    from vllm_sparsever.metrics import get_metrics

    target, draft, out = sys.argv[1:4]
    from vllm.platforms import current_platform

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
              seed=0, tensor_parallel_size=2, distributed_executor_backend="ray",
              speculative_config={"method": "sparsever", "model": draft, "num_speculative_tokens": 3})
    outs = llm.generate(prompts(GREEDY_PROMPTS),
                        SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS))
    result = {
        "platform": type(current_platform).__name__,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "workers": llm.collective_rpc("sparsever_worker_info"),
        "metrics": get_metrics(llm),
    }
    victim = result["workers"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    try:
        llm.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=8))
        result["after_kill"] = {"error": None}
    except Exception as e:  # noqa: BLE001 - what the user sees is the point
        result["after_kill"] = {"error": type(e).__name__, "message": str(e),
                                "seconds": time.monotonic() - start}
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
