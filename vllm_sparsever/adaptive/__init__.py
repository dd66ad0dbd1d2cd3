"""Adaptive verification (EVICT): draft trees truncated before verification to the prefix whose
expected accepted tokens pay for its measured verification cost (cost.py: the offline profile;
evict.py: the per-step decision; measure.py + cli.py: `vllm-sparsever profile-verify`)."""
