"""The runner path without an engine: `SparseverRunnerMixin` (made by `make_runner_class`) in front of
a fake vLLM V1 runner, driving a fake proposer, with the real `StepRecorder` and `TreeAcceptance`.

The fake runner calls its hooks as vLLM's does (`execute_model`: state update, `_prepare_inputs`,
`_model_forward`; `sample_tokens`: `_sample`, bookkeeping, `propose_draft_token_ids`), with a target
whose greedy next token after t is `target_next(t)`. Every hook of the fake and every call the
mixin makes on the proposer goes into one log, and the tests compare it, in order, with the call
order the runner promises per step; a hook skipped or moved fails them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.drafting.proposer import ProposesAfterBookkeeping, Proposer
from vllm_sparsever.integration import model_runner
from vllm_sparsever.metrics import METRICS_DIR_ENV
from vllm_sparsever.step import DraftPlan
from vllm_sparsever.trees import DraftTopology
from vllm_sparsever.verification.lossless.tree_acceptance import TreeAcceptance

VOCAB = 64
K = 3  # num_speculative_tokens


def target_next(token: int) -> int:
    """The fake target's greedy next token."""
    return (token * 5 + 3) % VOCAB


# ---- the fake vLLM runner --------------------------------------------------------------------


@dataclasses.dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_new_reqs: list[Any]
    finished_req_ids: set[str]
    num_spec_tokens_to_schedule: int = K


class BlockTable:
    def __init__(self, max_reqs: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.table = torch.arange(max_reqs * max_blocks, dtype=torch.int32).view(max_reqs, max_blocks)
        self.num_blocks_per_row = np.full(max_reqs, max_blocks, dtype=np.int32)  # every slot allocated

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.table


class MultiGroupBlockTable:
    def __init__(self, block_tables: list[BlockTable]) -> None:
        self.block_tables = block_tables

    def __getitem__(self, group: int) -> BlockTable:
        return self.block_tables[group]


class InputBatch:
    """vLLM's persistent batch, as far as sparsever reads it (compat/runner.py)."""

    def __init__(self, max_reqs: int = 4, max_len: int = 64, block_size: int = 16) -> None:
        self.req_ids: list[str] = []
        self.token_ids_cpu = np.zeros((max_reqs, max_len), dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(max_reqs, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(max_reqs, dtype=np.int64)
        self.block_table = MultiGroupBlockTable([BlockTable(max_reqs, max_len // block_size, block_size)])
        self.sampling_metadata = SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None,
                                                 generators={})

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class FakeVllmRunner:
    """The hooks of vLLM's V1 model runner that the mixin overrides, called in vLLM's order."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.vllm_config = SimpleNamespace()
        self.model_config = SimpleNamespace(max_model_len=64, architectures=["FakeForCausalLM"])
        self.device = torch.device("cpu")
        self.use_async_scheduling = False
        self.input_batch = InputBatch()
        self.requests: dict[str, Any] = {}
        self._draft_token_ids: Any = None
        self._draft_token_req_ids: list[str] | None = None
        self._state: Any = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        self.log.append("vllm.load_model")
        self.model = torch.nn.Module()  # no attention layers

    def execute_model(self, scheduler_output: SchedulerOutput, intermediate_tensors: Any = None) -> Any:
        self.log.append("vllm.execute_model")
        self._update_states(scheduler_output)
        batch = self.input_batch
        if not batch.num_reqs:
            return SimpleNamespace(req_ids=[], req_id_to_index={}, sampled_token_ids=[])  # no work: no forward
        num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids])
        self._prepare_inputs(scheduler_output, num_scheduled)
        ids, positions = [], []
        for row in range(batch.num_reqs):
            start = int(batch.num_computed_tokens_cpu[row])
            ids += batch.token_ids_cpu[row, start: start + num_scheduled[row]].tolist()
            positions += range(start, start + int(num_scheduled[row]))
        self._model_forward(input_ids=torch.tensor(ids), positions=torch.tensor(positions))
        self._state = (scheduler_output, num_scheduled, torch.tensor(ids))
        return None

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            row = batch.req_ids.index(req_id)
            for array in (batch.token_ids_cpu, batch.num_tokens_no_spec, batch.num_computed_tokens_cpu):
                array[row:-1] = array[row + 1:].copy()
            del batch.req_ids[row], self.requests[req_id]
        for row, req_id in enumerate(batch.req_ids):  # running: the last sampled token is not computed yet
            n = int(batch.num_tokens_no_spec[row])
            batch.num_computed_tokens_cpu[row] = n - 1
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            batch.token_ids_cpu[row, n: n + len(drafts)] = drafts
        for new in scheduler_output.scheduled_new_reqs:
            row = batch.num_reqs
            batch.req_ids.append(new.req_id)
            batch.token_ids_cpu[row, : len(new.prompt_token_ids)] = new.prompt_token_ids
            batch.num_tokens_no_spec[row] = len(new.prompt_token_ids)
            batch.num_computed_tokens_cpu[row] = 0
            params = SimpleNamespace(all_stop_token_ids={0}, stop_token_ids=[], ignore_eos=False, max_tokens=20)
            self.requests[new.req_id] = SimpleNamespace(sampling_params=params,
                                                        num_prompt_tokens=len(new.prompt_token_ids))

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        self.log.append("vllm._prepare_inputs")
        return "prepared"

    def _model_forward(self, input_ids: torch.Tensor = None, positions: torch.Tensor = None, **kwargs: Any) -> Any:
        self.log.append(("vllm._model_forward", positions.tolist()))
        return input_ids.float()[:, None]  # the target's states: the tokens themselves

    def _sample(self, logits: torch.Tensor, spec_decode_metadata: Any) -> Any:
        """vLLM's greedy rejection sampler: each row's drafts accepted while they are the target's
        tokens, then the target's own token."""
        self.log.append("vllm._sample")
        target = logits.argmax(dim=-1).tolist()
        spec = self._state[0].scheduled_spec_decode_tokens
        out = torch.full((self.input_batch.num_reqs, K + 1), -1, dtype=torch.int64)
        start = 0
        for row, req_id in enumerate(self.input_batch.req_ids):
            drafts = spec.get(req_id, [])
            emitted = []
            for j, token in enumerate(target[start: start + len(drafts) + 1]):
                emitted.append(token)
                if j == len(drafts) or drafts[j] != token:
                    break
            out[row, : len(emitted)] = torch.tensor(emitted)
            start += len(drafts) + 1
        return SimpleNamespace(sampled_token_ids=out)

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, *args: Any) -> Any:
        self.log.append(("vllm.propose_draft_token_ids", scheduler_output.num_spec_tokens_to_schedule))
        return [[target_next(s[-1])] * scheduler_output.num_spec_tokens_to_schedule if s else []
                for s in sampled_token_ids]

    def sample_tokens(self, grammar_output: Any) -> Any:
        self.log.append("vllm.sample_tokens")
        scheduler_output, num_scheduled, ids = self._state
        self._state = (scheduler_output,)
        batch = self.input_batch
        spec = scheduler_output.scheduled_spec_decode_tokens
        ends = np.cumsum(num_scheduled)
        rows, cu = [], []  # logits rows: a row's drafts' and its last token's
        for row, req_id in enumerate(batch.req_ids):
            rows += range(int(ends[row]) - len(spec.get(req_id, [])) - 1, int(ends[row]))
            cu.append(len(rows))
        logits = torch.nn.functional.one_hot(torch.tensor([target_next(int(ids[r])) for r in rows]), VOCAB).float()
        metadata = SimpleNamespace(cu_num_sampled_tokens=torch.tensor(cu)) if spec else None
        sampler_output = self._sample(logits, metadata)
        valid = []
        for row in range(batch.num_reqs):  # bookkeeping: the emitted tokens are committed
            emitted = [t for t in sampler_output.sampled_token_ids[row].tolist() if t != -1]
            n = int(batch.num_tokens_no_spec[row])
            batch.token_ids_cpu[row, n: n + len(emitted)] = emitted
            batch.num_tokens_no_spec[row] = n + len(emitted)
            valid.append(emitted)
        self._draft_token_ids = self.propose_draft_token_ids(scheduler_output, valid, batch.sampling_metadata,
                                                             ids.float()[:, None], None, None, metadata)
        self._draft_token_req_ids = list(batch.req_ids)
        self.log.append("vllm.sample_tokens.done")
        return SimpleNamespace(req_ids=list(batch.req_ids), req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
                               sampled_token_ids=valid)


def schedule(runner: FakeVllmRunner, new: dict[str, list[int]] | None = None, finished: tuple = ()) -> SchedulerOutput:
    """The scheduler's next step: each running request's last token and the drafts it was given."""
    new = new or {}
    drafts = dict(zip(runner._draft_token_req_ids or [], runner._draft_token_ids or []))
    running = [r for r in runner.input_batch.req_ids if r not in finished]
    spec = {r: list(drafts[r]) for r in running if drafts.get(r)}
    scheduled = {r: 1 + len(spec.get(r, [])) for r in running} | {r: len(p) for r, p in new.items()}
    return SchedulerOutput(scheduled, spec, [SimpleNamespace(req_id=r, prompt_token_ids=p, num_computed_tokens=0)
                                             for r, p in new.items()], set(finished))


def run_step(runner: Any, scheduler_output: SchedulerOutput) -> Any:
    """One engine step: execute_model, then sample_tokens unless the step ran no forward."""
    output = runner.execute_model(scheduler_output)
    return output if output is not None else runner.sample_tokens(None)


# ---- the fake proposer -----------------------------------------------------------------------


def chain_after(token: int, n: int) -> list[int]:
    """The `n` tokens the fake target emits after `token` (drafts it accepts in full)."""
    out = []
    for _ in range(n):
        token = target_next(token)
        out.append(token)
    return out


class FakeProposer(Proposer):
    """Logs every call the runner makes; plans every step as `plan` says; drafts
    `drafts_after(last token)` for each row with a budget, `plan_depth` levels deep."""

    lookahead = 4

    def __init__(self, log: list, *, drafts_after=None, trees: dict[str, DraftTopology] | None = None,
                 plan: DraftPlan = DraftPlan()) -> None:
        self.log = log
        self.drafts_after = drafts_after or chain_after
        self.trees = trees or {}
        self.draft_plan = plan
        self.steps: list[Any] = []

    def check_scheduling(self, async_scheduling: bool) -> None:
        self.log.append(("check_scheduling", async_scheduling))

    def load(self, target: Any) -> None:
        self.log.append(("load", type(target).__name__))
        self.target = target

    def experts_observer(self):
        self.log.append("experts_observer")
        return None

    def note_prompts(self, to_compute: dict[str, int]) -> None:
        self.log.append(("note_prompts", to_compute))

    def forget(self, req_ids: set[str]) -> None:
        self.log.append(("forget", req_ids))

    def topologies(self, scheduled: dict[str, list[int]]) -> dict[str, DraftTopology]:
        self.log.append(("topologies", scheduled))
        return {r: t for r, t in self.trees.items() if r in scheduled}

    def streams_for_step(self, num_scheduled_tokens: Any) -> None:
        self.log.append(("streams_for_step", list(num_scheduled_tokens)))
        return None

    def forward_from_streams(self, streams: Any, positions: Any) -> Any:
        self.log.append(("forward_from_streams", positions.tolist()))
        return streams

    def observe_acceptance(self, req_id: str, verified: int, accepted_nodes: list[int]) -> None:
        self.log.append(("observe_acceptance", req_id, verified, accepted_nodes))

    def observe_target_states(self, req_id: str, first_position: int, token_ids: list[int], states: Any) -> None:
        self.log.append(("observe_target_states", req_id, first_position, token_ids, states[:, 0].long().tolist()))

    def observe_step_time(self, query_tokens, contexts, seconds, mask, gap_s) -> None:
        assert seconds > 0
        self.log.append(("observe_step_time", query_tokens, contexts, mask))

    def plan(self) -> DraftPlan:
        self.log.append("plan")
        return self.draft_plan

    def plan_depth(self, step) -> int:
        self.log.append(("plan_depth", step.depth))
        return 2

    def propose(self, step) -> list[list[int]]:
        self.steps.append(step)
        self.log.append(("propose", step.depth, [step.history(r).tolist() for r in range(len(step.req_ids))]))
        return [self.drafts_after(int(step.history(r)[-1]), step.depth) if step.budgets[r] else []
                for r in range(len(step.req_ids))]

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        self.log.append("stats_by_level")
        return {"fake": {"fake_steps": len(self.steps)}}


class FakeRuntime:
    moe_routing = None
    linear_kernel = "vllm"
    experts_observer = None

    def step_planners(self) -> dict[str, Any]:
        return {}

    def stats_summary(self) -> dict[str, Any]:
        return {"attention_fallbacks": 0}


@pytest.fixture
def make_runner(monkeypatch):
    """A sparsever runner over `FakeVllmRunner`, loaded, with `proposer` for its proposer; sparse
    verification's start-up and load hooks are stubbed (the runner only sequences them)."""
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)  # no snapshot files

    def make(proposer: FakeProposer, async_scheduling: bool = False, **config: Any):
        log = proposer.log
        monkeypatch.setattr(model_runner, "start_sparse_verification", lambda cfg, vllm_config: FakeRuntime())
        monkeypatch.setattr(model_runner, "make_proposer", lambda cfg, max_model_len: proposer)
        monkeypatch.setattr(model_runner, "honour_logits_params", lambda runner: log.append("honour_logits_params"))
        monkeypatch.setattr(model_runner, "target_load_hooks",
                            lambda runtime, runner: contextlib.nullcontext(log.append("target_load_hooks")))
        monkeypatch.setattr(model_runner, "install_modules",
                            lambda model, runtime, arch: log.append(("install_modules", arch)))
        cls = model_runner.make_runner_class(FakeVllmRunner)
        runner = cls(log)
        runner.use_async_scheduling = async_scheduling
        raw = {"method": "sparsever", "draft_source": "ngram", "num_speculative_tokens": K, **config}
        runner.init_sparsever(SparseverConfig.from_dict(raw), rank=0)
        runner.load_model()
        return runner

    return make


def names(log: list) -> list[str]:
    return [e[0] if isinstance(e, tuple) else e for e in log]


PROMPT = [5, 6, 7, 8]
# What a first step (the prompt) and a verify step each call, in order, with a proposer that
# proposes inside sample_tokens after vLLM's bookkeeping (prompt lookup, the self-drafter).
PREFILL_STEP = ["note_prompts", "vllm.execute_model", "vllm._prepare_inputs", "topologies", "streams_for_step",
                "vllm._model_forward", "vllm.sample_tokens", "vllm._sample", "plan", "plan_depth", "propose",
                "vllm.sample_tokens.done", "stats_by_level"]
VERIFY_STEP = ["vllm.execute_model", "vllm._prepare_inputs", "topologies", "streams_for_step", "vllm._model_forward",
               "vllm.sample_tokens", "vllm._sample", "observe_acceptance", "plan", "plan_depth", "propose",
               "vllm.sample_tokens.done", "observe_step_time", "stats_by_level"]


# ---- tests -------------------------------------------------------------------------------------


def test_the_fake_runner_has_vllms_hook_signatures():
    from vllm_sparsever.compat.runner import check_runner_hooks

    check_runner_hooks(FakeVllmRunner)  # the fake stands in for the hooks the mixin relies on


def test_load_wires_the_proposer_after_the_target(make_runner):
    log: list = []
    runner = make_runner(FakeProposer(log))
    assert log == [("check_scheduling", False), "honour_logits_params", "target_load_hooks", "vllm.load_model",
                   ("install_modules", "FakeForCausalLM"), ("load", "RunnerTargetView"), "experts_observer"]
    assert runner.sparsever_proposer.target.model is runner.model


def test_a_proposer_sees_each_step_in_order_and_the_recorder_records_it(make_runner):
    log: list = []
    proposer = FakeProposer(log)
    runner = make_runner(proposer)
    del log[:]
    # Step 1: the prompt. The proposer drafts 2 levels (its plan) after the sampled token.
    out = run_step(runner, schedule(runner, new={"r0": PROMPT}))
    first = target_next(PROMPT[-1])
    assert out.sampled_token_ids == [[first]]
    assert names(log) == PREFILL_STEP
    assert log[0] == ("note_prompts", {"r0": 4})
    assert log[9] == ("plan_depth", K) and log[10] == ("propose", 2, [PROMPT + [first]])
    assert runner._draft_token_ids == [[target_next(first), target_next(target_next(first))]]
    steps = runner.sparsever_steps.metrics
    assert (steps.num_steps, steps.num_verify_steps, steps.num_draft_tokens) == (1, 0, 0)
    assert steps.step_time_s > 0 and steps.drafting == {"fake_steps": 1}

    # Step 2: both drafts verified and accepted (the fake drafts what the target would emit).
    del log[:]
    drafts = runner._draft_token_ids[0]
    out = run_step(runner, schedule(runner))
    assert names(log) == VERIFY_STEP
    assert log[2] == ("topologies", {"r0": drafts})
    assert log[3] == ("streams_for_step", [3])
    assert log[4] == ("vllm._model_forward", [4, 5, 6])  # the last token and its drafts, as a chain
    assert log[7] == ("observe_acceptance", "r0", 2, [0, 1])
    assert out.sampled_token_ids == [[*drafts, target_next(drafts[-1])]]
    assert (steps.num_steps, steps.num_verify_steps, steps.num_draft_tokens, steps.num_accepted_tokens) == (2, 1, 2, 2)
    assert steps.sparsity == {"attention_fallbacks": 0} and steps.drafting == {"fake_steps": 2}
    # The step's input: the committed tokens, a budget within the lookahead, the request's limits.
    step = proposer.steps[-1]
    assert step.history(0).tolist() == PROMPT + [first, *drafts, target_next(drafts[-1])]
    assert step.budgets.tolist() == [4] and step.limits_of([0])[0].stop_token_ids == {0}
    assert step.limits_of([0])[0].remaining_tokens == 20 - 4

    # Step 3: the request finished: the proposer forgets it first; no forward, nothing recorded.
    del log[:]
    run_step(runner, schedule(runner, finished=("r0",)))
    assert log == [("forget", {"r0"}), "vllm.execute_model"]
    assert steps.num_steps == 2


def test_a_rejected_draft_is_reported_and_counted(make_runner):
    log: list = []
    runner = make_runner(FakeProposer(log, drafts_after=lambda t, n: [target_next(t), VOCAB - 1][:n]))
    run_step(runner, schedule(runner, new={"r0": PROMPT}))
    del log[:]
    out = run_step(runner, schedule(runner))
    assert names(log) == VERIFY_STEP
    assert log[7] == ("observe_acceptance", "r0", 2, [0])  # the second draft rejected
    assert len(out.sampled_token_ids[0]) == 2
    metrics = runner.sparsever_steps.metrics
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens) == (2, 1)


def test_a_late_proposer_proposes_after_sample_tokens_with_the_target_states(make_runner):
    """A proposer that needs the committed tokens (the draft model's drafter) proposes after vLLM's
    sample_tokens, its drafts set as the step's; one that drafts from the target's states (an EAGLE
    head) is handed each request's states of the step first."""
    log: list = []
    runner = make_runner(FakeProposer(log, plan=DraftPlan(after_bookkeeping=True, target_states=True)))
    del log[:]
    run_step(runner, schedule(runner, new={"r0": PROMPT}))
    assert names(log) == ["note_prompts", "vllm.execute_model", "vllm._prepare_inputs", "topologies",
                          "streams_for_step", "vllm._model_forward", "vllm.sample_tokens", "vllm._sample", "plan",
                          "observe_target_states", "vllm.sample_tokens.done", "plan_depth", "propose", "stats_by_level"]
    assert ("observe_target_states", "r0", 0, PROMPT, PROMPT) in log
    first = target_next(PROMPT[-1])
    drafts = [target_next(first), target_next(target_next(first))]
    assert runner._draft_token_ids == [drafts] and runner._draft_token_req_ids == ["r0"]
    del log[:]
    run_step(runner, schedule(runner))
    assert names(log) == ["vllm.execute_model", "vllm._prepare_inputs", "topologies", "streams_for_step",
                          "vllm._model_forward", "vllm.sample_tokens", "vllm._sample", "observe_acceptance", "plan",
                          "observe_target_states", "vllm.sample_tokens.done", "plan_depth", "propose",
                          "observe_step_time", "stats_by_level"]
    assert log[9] == ("observe_target_states", "r0", 4, [first, *drafts], [first, *drafts])


def test_a_proposer_that_cuts_vllms_drafts_plans_their_depth_first(make_runner):
    """EVICT over vLLM's EAGLE drafter: vLLM's drafter runs as deep as the proposer plans, and the
    proposer cuts its drafts after sample_tokens."""
    log: list = []
    runner = make_runner(FakeProposer(log, plan=DraftPlan(after_bookkeeping=True, vllm_depth=2)))
    del log[:]
    run_step(runner, schedule(runner, new={"r0": PROMPT}))
    assert names(log)[6:] == ["vllm.sample_tokens", "vllm._sample", "plan",
                               "vllm.propose_draft_token_ids", "vllm.sample_tokens.done", "plan_depth", "propose",
                               "stats_by_level"]
    assert ("vllm.propose_draft_token_ids", 2) in log  # vLLM's drafter ran the planned depth


def test_a_proposer_that_prices_steps_gets_each_decode_steps_time(make_runner):
    log: list = []
    runner = make_runner(FakeProposer(log))
    run_step(runner, schedule(runner, new={"r0": PROMPT}))
    assert "observe_step_time" not in names(log)  # a prompt step is no decode step
    del log[:]
    run_step(runner, schedule(runner))
    assert names(log) == VERIFY_STEP
    assert log[-2] == ("observe_step_time", [3], [4], "chain")


def test_a_full_pass_from_saved_streams_replaces_the_targets_forward(make_runner):
    """Hierarchical verification with reuse: where the proposer has the step's streams saved, the
    runner's forward is its `forward_from_streams`, with the step's plan active."""
    log: list = []

    class SavesStreams(FakeProposer):
        def streams_for_step(self, num_scheduled_tokens: Any) -> Any:
            super().streams_for_step(num_scheduled_tokens)
            return torch.arange(int(sum(num_scheduled_tokens)), dtype=torch.float32)[:, None] + 5

    runner = make_runner(SavesStreams(log))
    run_step(runner, schedule(runner, new={"r0": PROMPT}))
    del log[:]
    run_step(runner, schedule(runner))
    assert names(log) == [n if n != "vllm._model_forward" else "forward_from_streams" for n in VERIFY_STEP]
    assert log[4] == ("forward_from_streams", [4, 5, 6])


def test_a_proposer_that_needs_synchronous_scheduling_stops_the_start(make_runner):
    class AfterBookkeeping(ProposesAfterBookkeeping, FakeProposer):
        pass

    with pytest.raises(ValueError, match="needs synchronous scheduling"):
        make_runner(AfterBookkeeping([]), async_scheduling=True)
    make_runner(AfterBookkeeping([]))
    make_runner(FakeProposer([]), async_scheduling=True)


def test_tree_acceptance_walks_the_tree_and_the_proposer_hears_the_path(make_runner):
    """A draft tree (root; a, b under it; c under a): the target runs it with tree positions, vLLM's
    sampler reads it as a chain, tree acceptance takes the path through b, the proposer and the
    metrics see that path."""
    log: list = []
    first = target_next(PROMPT[-1])
    good = target_next(first)
    tree = [VOCAB - 1, good, VOCAB - 2]  # a (wrong), b (the target's token), c under a
    proposer = FakeProposer(log, drafts_after=lambda t, n: tree, trees={"r0": DraftTopology((-1, 0, 0, 1))})
    runner = make_runner(proposer, draft_source="draft_model", model="/m/draft", tree={"enabled": True})
    runner.sparsever_trees = TreeAcceptance(layer_kvs=[])  # the fake target has no attention layers
    run_step(runner, schedule(runner, new={"r0": PROMPT}))
    del log[:]
    out = run_step(runner, schedule(runner))
    assert names(log) == VERIFY_STEP
    assert log[4] == ("vllm._model_forward", [4, 5, 5, 6])  # context + depth
    assert log[7] == ("observe_acceptance", "r0", 3, [1])  # node b
    assert out.sampled_token_ids == [[good, target_next(good)]]
    stats = runner.sparsever_trees.stats
    assert (stats.steps, stats.trees, stats.nodes_verified, stats.accepted_tokens, stats.kv_moved_tokens) == (1, 1, 3, 1, 1)
    assert runner.sparsever_drafting_stats(split=True)["tree_verify"]["tree_verify_trees"] == 1
    metrics = runner.sparsever_steps.metrics
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens) == (3, 1)


def test_tree_acceptance_rewrites_the_tree_rows_of_the_samplers_output():
    """TreeAcceptance alone, on a plan with a tree request and a chain request: the tree row is
    rewritten with the accepted path and the target's token, the chain row is left as vLLM's sampler
    made it."""
    from vllm_sparsever.plan import build_verification_plan

    runner = FakeVllmRunner([])
    runner.input_batch.req_ids = ["t", "c"]
    topology = DraftTopology((-1, 0, 0, 2))  # root; a, b under it; c under b
    plan = build_verification_plan(step=1, req_ids=["t", "c"], num_scheduled_tokens=np.array([4, 2]),
                                   num_computed_tokens=np.array([10, 20]),
                                   scheduled_spec_decode_tokens={"t": [7, 8, 9], "c": [4]},
                                   block_table=torch.zeros(2, 4, dtype=torch.int32), block_size=16,
                                   topologies={"t": topology})
    assert plan.tree is not None and plan.tree.tree_requests == (0,)
    # The target's tokens after root, a, b, c (tree rows) and after the chain's two tokens.
    targets = [8, 1, 9, 2, 4, 6]
    logits = torch.nn.functional.one_hot(torch.tensor(targets), VOCAB).float()
    output = SimpleNamespace(sampled_token_ids=torch.tensor([[3, -1, -1, -1], [4, 6, -1, -1]]))
    trees = TreeAcceptance(layer_kvs=[])
    paths = trees.accept(runner, plan, logits, SimpleNamespace(cu_num_sampled_tokens=torch.tensor([4, 6])), output)
    assert paths == {"t": [2, 3]}  # b (8), then c (9) under it, then the target's 2
    assert output.sampled_token_ids.tolist() == [[8, 9, 2, -1], [4, 6, -1, -1]]
    assert (trees.stats.trees, trees.stats.accepted_tokens, trees.stats.kv_moved_tokens) == (1, 2, 2)
