"""Drafting: one proposer class per draft source, behind the protocol in proposer.py (built by factory.py).

- proposers: the draft model (draft_model.py, its K/V bookkeeping draft_kv.py, VocabTrim draft_vocab.py),
  n-gram prompt lookup (prompt_lookup.py), the target's own early exit (self_draft.py over
  early_exit_model.py and exit_head.py), an EAGLE head sparsever runs (eagle_head.py), EVICT's cut of vLLM's
  own drafters (vllm_drafter.py), drafting off (no_draft.py);
- hierarchical verification over one of them (hierarchical.py, its intermediate level intermediate.py);
- EVICT over a tree drafter (evict_proposer.py: asks adaptive/ only through adaptive.policy.EvictPolicy);
- what drafters share: requests and rounds (drafter.py), draft trees (tree.py, tree_drafter.py), query
  batches for sparsever's own passes on the target's KV cache (queries.py).

Proposers are written against the plugin's step API on the base floor: each step's input
(`step.DraftStep`), the read-only target they hold (`step.TargetView`) and the tree types
(`trees.DraftTree`, `trees.DraftTopology`); integration/ builds the first two over vLLM's runner.
"""
