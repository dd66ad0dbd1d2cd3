"""Sparse (approximate, opt-in) verification inside the worker: attention, FFN and MoE sparsity on
verify steps, their per-worker runtime (`runtime.py`), start-up (`setup.py`) and calibration profile
(`profile.py`). Kept import-free on purpose: the worker imports only the submodules it needs."""
