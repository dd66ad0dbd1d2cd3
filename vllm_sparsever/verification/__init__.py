"""Sparse verification inside the worker: attention, FFN and MoE sparsity on verify steps.

Kept empty on purpose: the worker imports only the submodules the engine's config enables.
"""
