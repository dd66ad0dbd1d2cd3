"""Adaptive verification (EVICT): draft trees truncated before verification to the prefix whose
expected accepted tokens pay for its measured verification cost (cost.py: the offline profile and its
fit; evict.py: the per-step decision; experts.py: an MoE target's distinct experts). policy.py's
`EvictPolicy` is the one interface the rest of the plugin asks EVICT through. The profile is measured offline by `vllm-sparsever
profile-verify` (offline/profile_verify.py)."""
