"""Drafting from the target itself: early-exit heads (training and loading) and the self-draft
proposer that runs the target's first layers plus a head inside the target worker."""
