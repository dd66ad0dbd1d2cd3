"""Adaptive verification (EVICT): draft trees truncated before verification to the prefix whose
expected accepted tokens pay for its measured verification cost (cost.py: the offline profile and its
fit; evict.py: the per-step decision). The profile is measured offline by `vllm-sparsever
profile-verify` (offline/profile_verify.py)."""
