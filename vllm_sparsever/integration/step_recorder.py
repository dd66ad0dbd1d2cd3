"""What the runner records per step: times (the engine's gap before the step, the target forward,
sampling, drafting), accepted tokens per request, and where they go: sparsever's metrics (and their
snapshots for the Prometheus collector) and the proposer (EVICT prices steps by their times).

Step time = execute_model + sample_tokens. Verification time (on verify steps) = the target forward
with its logits (execute_model) + rejection sampling (_sample); drafting is timed separately and is
not part of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from vllm_sparsever.compat.runner import emitted_count, input_batch_view, sampled_tokens, scheduled_drafts
from vllm_sparsever.metrics import SnapshotWriter, SparseverMetrics
from vllm_sparsever.plan import VerificationPlan


class StepRecorder:
    def __init__(self, num_spec_tokens: int, rank: int) -> None:
        self.metrics = SparseverMetrics(num_spec_tokens=num_spec_tokens)
        self._snapshots = SnapshotWriter(rank)
        self._snapshots.write(self.metrics, force=True)
        self._timing: dict[str, float] = {}
        self._last_end: float | None = None  # when the runner's last step (with drafting) ended
        self._gap_s: float | None = None
        self._decode_shape: tuple[list[int], list[int]] | None = None  # see decode_shape

    def reset_metrics(self) -> None:
        self.metrics = SparseverMetrics(num_spec_tokens=self.metrics.num_spec_tokens)

    @contextlib.contextmanager
    def executing(self) -> Iterator[None]:
        """Around the runner's execute_model: starts the step's clock (and the engine's gap before it)."""
        start = time.perf_counter()
        last, self._last_end = self._last_end, None
        self._gap_s = start - last if last is not None else None
        yield
        self._timing = {"execute": time.perf_counter() - start, "sample": 0.0, "draft": 0.0}

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Adds the time inside to this step's `part` ("sample", "draft")."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timing[part] = self._timing.get(part, 0.0) + time.perf_counter() - start

    def note_decode_shape(self, runner: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> None:
        """(query tokens, context) per row when every row of the step decodes (1 + its drafts; no
        prefill chunk), kept for the proposer's `observe_step_time` (EVICT prices steps by it); else
        None."""
        self._decode_shape = None
        batch = input_batch_view(runner)
        drafts = scheduled_drafts(scheduler_output)
        queries, contexts = [], []
        for row, req_id in enumerate(batch.req_ids):
            q = int(num_scheduled_tokens[row])
            if q != 1 + len(drafts.get(req_id, ())):
                return
            queries.append(q)
            contexts.append(int(batch.num_computed_tokens[row]))
        self._decode_shape = (queries, contexts) if queries else None

    def observe_acceptance(self, proposer: Any, plan: VerificationPlan, sampler_output: Any,
                           tree_paths: dict[str, list[int]]) -> None:
        """Tell the proposer which of its drafts were accepted: a tree's accepted path (tree
        acceptance), a chain's accepted prefix (vLLM's rejection sampler)."""
        if proposer is None:
            return
        for req in plan.requests:
            path = tree_paths.get(req.req_id)
            if path is not None:
                accepted = [q - 1 for q in path]
            else:
                accepted = list(range(max(emitted_count(sampler_output, req.batch_index) - 1, 0)))
            proposer.observe_acceptance(req.req_id, req.num_draft_tokens, accepted)

    def drafting_so_far(self) -> float:
        return self._timing.get("draft", 0.0)

    def finish_step(self, plan: VerificationPlan | None, sample_tokens_s: float, drafted_inside: float, output: Any,
                    proposer: Any, runtime: Any, drafting_stats: Any) -> None:
        """After sample_tokens (and late drafting): the step's times and acceptance into the metrics,
        the decode step's time (without `drafted_inside`, the drafting that ran inside sample_tokens)
        to the proposer."""
        timing, self._timing = self._timing, {}
        if plan is None or "execute" not in timing:
            return  # no forward ran this step (empty batch, pipeline pass-through)
        shape, self._decode_shape = self._decode_shape, None
        if shape is not None:
            mask = "tree" if plan.tree is not None else "chain"
            proposer.observe_step_time(*shape, timing["execute"] + sample_tokens_s - drafted_inside, mask, self._gap_s)
        self._last_end = time.perf_counter()
        # With async scheduling (GPU) the output is an AsyncModelRunnerOutput whose tokens are not
        # ready here; acceptance is then not counted (timing still is).
        sampled = sampled_tokens(output)
        if sampled is not None and plan.is_verify_step:
            self._count_acceptance(plan, *sampled)
        self.metrics.observe_step(
            step_time_s=timing["execute"] + sample_tokens_s,
            verify_time_s=(timing["execute"] + timing["sample"]) if plan.is_verify_step else 0.0,
            draft_time_s=timing["draft"],
            is_verify=plan.is_verify_step,
        )
        if plan.is_verify_step:
            stats = runtime.stats_summary()
            self.metrics.sparsity = stats
            self.metrics.num_dense_fallbacks = int(sum(v for k, v in stats.items() if k.endswith("_fallbacks")))
        if proposer is not None:
            self.metrics.drafting = drafting_stats()
        self._snapshots.write(self.metrics)

    def _count_acceptance(self, plan: VerificationPlan, req_id_to_index: dict[str, int],
                          sampled: list[list[int]]) -> None:
        for req in plan.requests:
            index = req_id_to_index.get(req.req_id)
            if index is None or index >= len(sampled):
                continue
            tokens = sampled[index]
            if not tokens:  # request finished or discarded this step
                continue
            # Emitted tokens = accepted drafts + one target token (correction or bonus).
            self.metrics.observe_request(req.num_draft_tokens, len(tokens) - 1)
