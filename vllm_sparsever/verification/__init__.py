"""The target's side of a verify step, in two rooms.

- `lossless/`: what never changes the output: tree acceptance (`tree_acceptance.py`), min_p and
  logit_bias on the verification logits (`logits_params.py`), the dense-linear kernel choice the
  target and the draft load with (`linear_kernel.py`), the paged K/V layout (`kv_layout.py`), and
  the expert counter of MoE targets (`expert_counter.py`, a metric and EVICT's cost input).
- `sparse/`: approximate (opt-in) verification: attention, FFN and MoE sparsity, their per-worker
  runtime and start-up, and the calibration profile. Sparse builds on lossless, never the reverse.
- `support.py`: which targets and platforms each path supports, checked in the front end.

Kept import-free on purpose: the worker imports only the submodules the engine's config enables.
"""
