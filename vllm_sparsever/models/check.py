"""Load a built folder in vLLM (fp32, eager; bf16 for quantized folders) and generate greedily:
the acceptance check of a build.

    python -m vllm_sparsever.models.check PATH [--base] [--max-tokens 48]

Runs the stock engine (other vLLM plugins disabled unless `--with-plugins`), because the point is
that the folder itself is a model vLLM serves. Exit code 0 when the first prompt's answer names
Paris (base models get a one-shot completion prompt), i.e. the model is coherent enough for the
lead's experiments; read the other outputs too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Give three tips for staying healthy.",
]
BASE_PROMPTS = [
    "The capital of Italy is Rome. The capital of France is",
    "def sum_list(numbers):\n    \"\"\"Return the sum of a list of numbers.\"\"\"\n",
    "Three tips for staying healthy are",
]


def _is_chat_model(path: Path) -> bool:
    from vllm_sparsever.store.manifest import read_manifest

    manifest = read_manifest(path) or {}
    return bool(manifest.get("chat", True))


def _is_quantized(path: Path) -> bool:
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    return "quantization_config" in config


def run_check(path: Path, max_tokens: int = 48, chat: bool | None = None) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    chat = _is_chat_model(path) if chat is None else chat
    start = time.perf_counter()
    # Stock vLLM-CPU runs int8 (W8A8) linears on AMX CPUs with 16-bit activations only, int4 ones fast in bf16 only.
    dtype = "bfloat16" if _is_quantized(path) else "float32"
    llm = LLM(model=str(path), enforce_eager=True, dtype=dtype, max_model_len=1024, seed=0)
    load_seconds = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    try:
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], params)
            prompts = CHAT_PROMPTS
        else:
            outputs = llm.generate(BASE_PROMPTS, params)
            prompts = BASE_PROMPTS
    finally:
        from vllm_sparsever.compat.engine import shutdown_llm

        shutdown_llm(llm)
    gen_seconds = time.perf_counter() - start
    texts = [o.outputs[0].text for o in outputs]
    return {
        "path": str(path),
        "chat": chat,
        "dtype": dtype,
        "load_seconds": round(load_seconds, 1),
        "generate_seconds": round(gen_seconds, 1),
        "outputs": [{"prompt": p, "text": t} for p, t in zip(prompts, texts)],
        "ok": "paris" in texts[0].lower(),
    }


def check_in_subprocess(path: Path, with_plugins: bool = False) -> int:
    """Run the check in a fresh interpreter (vLLM spawns workers; callers need no __main__ guard)."""
    cmd = [sys.executable, "-m", "vllm_sparsever.models.check", str(path)]
    if with_plugins:
        cmd.append("--with-plugins")
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--base", action="store_true", help="plain completion prompts even for a chat model")
    parser.add_argument("--with-plugins", action="store_true", help="keep vllm.general_plugins enabled")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if not args.with_plugins:
        os.environ["VLLM_PLUGINS"] = ""  # a list matching no plugin name: stock vLLM
    result = run_check(args.path, args.max_tokens, chat=False if args.base else None)
    for item in result["outputs"]:
        print(f"PROMPT: {item['prompt']!r}\nOUTPUT: {item['text']!r}\n")
    print(f"load {result['load_seconds']} s, generate {result['generate_seconds']} s, ok={result['ok']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
