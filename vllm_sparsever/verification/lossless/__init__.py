"""Lossless target-side verification: tree acceptance, logits params, the dense-linear kernel choice,
the paged K/V layout and the MoE expert counter. Imports nothing from `verification.sparse`."""
