"""Speculative-decoding metrics of the sparsever worker, offline and on the server's /metrics.

The worker counts, per step: drafts verified, draft tokens, accepted tokens (per position), and
wall time of the step, of verification (on steps that verify: the target forward with its logits
and the rejection sampler) and of drafting. Two ways out:
- offline: `get_metrics(llm)` asks the workers over `collective_rpc` (works with mp, Ray, TP);
- server: each worker writes a JSON snapshot (atomic rename, at most a few times a second) to
  `$VLLM_SPARSEVER_METRICS_DIR`, and a Prometheus collector in the API server process reads them
  when /metrics is scraped. The directory is created by the front end and inherited by engine and
  worker processes (the VLLM_ prefix makes Ray copy it to its workers); snapshots are node-local.
"""

from __future__ import annotations

import dataclasses

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

def counters_summary(stats: Any, prefix: str, keys: dict[str, str] | None = None,
                     skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stats dataclass's fields as metrics: `prefix + field`, or `keys[field]` (a full name), except
    the fields in `skip` (inputs of derived values the caller adds)."""
    keys = keys or {}
    return {keys.get(f.name, prefix + f.name): getattr(stats, f.name)
            for f in dataclasses.fields(stats) if f.name not in skip}


METRICS_DIR_ENV = "VLLM_SPARSEVER_METRICS_DIR"
_SNAPSHOT_INTERVAL_S = 0.25


@dataclass
class SparseverMetrics:
    """Counters of one worker since start (or the last reset)."""

    num_spec_tokens: int
    num_steps: int = 0
    num_verify_steps: int = 0
    num_drafts: int = 0  # request-steps that verified >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    step_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forward + logits + rejection sampling, verify steps
    draft_time_s: float = 0.0
    num_dense_fallbacks: int = 0  # sparse layer calls that verified densely instead (all reasons)
    # Sparse verification counters (what was read vs dense), copied from the worker's runtime.
    sparsity: dict[str, float] = field(default_factory=dict)
    # Self-drafting / hierarchical verification counters (self_draft_*, hier_*), copied from the
    # worker's proposer (empty for draft-model and n-gram drafting).
    drafting: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_spec_tokens
            self.drafted_per_position = [0] * self.num_spec_tokens

    def observe_request(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_draft_tokens` drafts accepted."""
        if num_draft_tokens <= 0:
            return
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} draft tokens")
        self._grow(num_draft_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_draft_tokens):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def observe_step(
        self, *, step_time_s: float, verify_time_s: float, draft_time_s: float, is_verify: bool
    ) -> None:
        self.num_steps += 1
        self.num_verify_steps += int(is_verify)
        self.step_time_s += step_time_s
        self.verify_time_s += verify_time_s
        self.draft_time_s += draft_time_s

    def _grow(self, n: int) -> None:
        # Drafts can be longer than the configured k only if a drafter changes k at run time.
        missing = n - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position += [0] * missing
            self.accepted_per_position += [0] * missing

    def summary(self) -> dict[str, Any]:
        """Counters plus the derived rates users read."""
        out = asdict(self)
        out["acceptance_rate"] = (
            self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
        )
        # Tokens emitted per verification: accepted drafts + the bonus/corrected token.
        out["mean_acceptance_length"] = (
            1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
        )
        out["per_position_acceptance"] = [
            (a / d if d else None)
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]
        out["verification_time_share"] = (
            self.verify_time_s / self.step_time_s if self.step_time_s > 0 else None
        )
        return out


class SnapshotWriter:
    """Writes a worker's summary to `<dir>/rank<r>.json`, throttled, atomically.

    A write skipped by the throttle is not lost: a one-shot timer writes the latest state when the
    interval has passed, so the counters of a burst that ends (the engine goes idle) still arrive.
    """

    def __init__(self, rank: int, directory: str | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 timer_factory: Callable[[float, Callable[[], None]], Any] = threading.Timer) -> None:
        # clock / timer_factory: injectable so tests drive the throttle without sleeping.
        directory = directory or os.environ.get(METRICS_DIR_ENV)
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self._clock = clock
        self._timer_factory = timer_factory
        self._last = 0.0
        self._lock = threading.Lock()
        self._pending: SparseverMetrics | None = None
        self._timer: threading.Timer | None = None

    def write(self, metrics: SparseverMetrics, force: bool = False) -> None:
        if self.path is None:
            return
        with self._lock:
            wait = _SNAPSHOT_INTERVAL_S - (self._clock() - self._last)
            if not force and wait > 0:
                self._pending = metrics
                if self._timer is None:
                    self._timer = self._timer_factory(wait, self._flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._write_now(metrics)

    def _flush(self) -> None:
        with self._lock:
            self._timer = None
            pending, self._pending = self._pending, None
            if pending is not None:
                self._write_now(pending)

    def _write_now(self, metrics: SparseverMetrics) -> None:
        self._last = self._clock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(metrics.summary()))
            os.replace(tmp, self.path)
        except (OSError, RuntimeError, ValueError):  # metrics must never break serving
            pass


def read_snapshots(directory: str | None = None) -> dict[int, dict[str, Any]]:
    directory = directory or os.environ.get(METRICS_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return {}
    out: dict[int, dict[str, Any]] = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            out[int(path.stem[4:])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


# ---- offline API ----------------------------------------------------------------------------


def get_metrics(llm: Any) -> dict[str, Any]:
    """Sparsever metrics of an `LLM` since start (or the last `reset_metrics`).

    Returns the driver worker's summary: `acceptance_rate`, `mean_acceptance_length`,
    `per_position_acceptance`, `verification_time_share`, the raw counters, and `sparsity`: what
    sparse verification read versus dense (`attn_kv_blocks_read`/`_dense`, `ffn_neurons_read`/
    `_dense`, with `ffn.gate: "input_sparse"` `ffn_gate_channels_read`/`_dense`, `moe_experts_read`/
    `_dense`, per layer and step, summed) and `*_fallbacks`; with tensor
    parallelism `ranks` holds every rank's summary.
    """
    summaries = llm.collective_rpc("sparsever_metrics")
    result = dict(summaries[0])
    if len(summaries) > 1:
        result["ranks"] = summaries
    return result


def reset_metrics(llm: Any) -> None:
    llm.collective_rpc("reset_sparsever_metrics")


def set_sparsity(llm: Any, **sections: Any) -> dict[str, Any]:
    """Switch sparse verification sections of a running `LLM`, e.g. `set_sparsity(llm, ffn={...})`.

    Only sections enabled at start can be switched on (their start-up work is done then); the
    values are validated like the start-up config. Returns the sections now in force.
    """
    return llm.collective_rpc("sparsever_set_sparsity", args=(sections,))[0]


def set_hierarchy(llm: Any, enabled: bool) -> bool:
    """Switch hierarchical verification of a running `LLM` off (the drafter alone proposes; sparse
    sections verify at the full level) or back on. Only a hierarchy set up at start can be switched."""
    return llm.collective_rpc("sparsever_set_hierarchy", args=(enabled,))[0]


# ---- Prometheus (API server process) --------------------------------------------------------

_collector_lock = threading.Lock()
_collector_registered = False


def is_drafting_level(name: str) -> bool:
    """Whether a drafting value (the `drafting` summary) is a level (a rate, a size, a measured
    time now, a price), exported as a gauge, rather than a count since start."""
    return name.startswith(("evict_clock_", "evict_price_")) or name.endswith(("_rate", "_vocab_tokens"))


class SparseverCollector:
    """Prometheus collector over the workers' snapshots (read at scrape time)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self):  # noqa: D401 - prometheus_client protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = read_snapshots(self.directory)
        if not snapshots:
            return
        s = snapshots[min(snapshots)]  # the driver rank sees every request's acceptance
        for name, doc in (
            ("num_drafts", "Requests-steps that verified draft tokens"),
            ("num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "Draft tokens accepted"),
            ("num_verify_steps", "Engine steps with verification"),
            ("num_dense_fallbacks", "Verify steps that fell back to dense verification"),
        ):
            c = CounterMetricFamily(f"sparsever:{name}", doc)
            c.add_metric([], float(s.get(name, 0)))
            yield c
        for name, doc in (
            ("acceptance_rate", "Accepted / drafted tokens"),
            ("mean_acceptance_length", "Tokens emitted per verification (accepted + 1)"),
            ("verification_time_share", "Share of step time spent verifying (target forward, logits, rejection sampling)"),
        ):
            value = s.get(name)
            g = GaugeMetricFamily(f"sparsever:{name}", doc)
            g.add_metric([], float("nan") if value is None else float(value))
            yield g
        c = CounterMetricFamily(
            "sparsever:sparsity",
            "Sparse verification: units read vs dense (attn_kv_blocks_*, ffn_neurons_*, "
            "ffn_gate_channels_*, moe_experts_*, summed over layers and verify steps) and sparse layer calls",
            labels=["counter"],
        )
        for name, value in sorted((s.get("sparsity") or {}).items()):
            c.add_metric([name], float(value))
        yield c
        c = CounterMetricFamily(
            "sparsever:dense_fallbacks",
            "Sparse layer calls that verified densely, per component and reason",
            labels=["component", "reason"],
        )
        for name, value in sorted((s.get("sparsity") or {}).items()):
            component, sep, reason = name.partition("_fallback_")
            if sep:
                c.add_metric([component, reason], float(value))
        yield c
        drafting = s.get("drafting") or {}
        c = CounterMetricFamily(
            "sparsever:drafting",
            "Drafting counters per drafter and policy (self_draft_*, hier_*, prompt_lookup_*, draft_model_*, "
            "tree_*, evict_*)",
            labels=["counter"],
        )
        g = GaugeMetricFamily(
            "sparsever:drafting_level",
            "Drafting values that are levels, not counts: rates, the drafted vocabulary's size, EVICT's "
            "step-time measurements (evict_clock_*)",
            labels=["name"],
        )
        for name, value in sorted(drafting.items()):
            (g if is_drafting_level(name) else c).add_metric([name], float(value))
        yield c
        yield g
        if "tree_verify_trees" in drafting or "evict_steps" in drafting:
            c = CounterMetricFamily(
                "sparsever:tree_nodes",
                "Draft trees: nodes grown by the drafter, proposed (after EVICT), verified, accepted",
                labels=["stage"],
            )
            for stage, key in (("grown", "tree_draft_nodes_grown"), ("proposed", "tree_draft_nodes"),
                               ("verified", "tree_nodes_verified"), ("accepted", "tree_accepted_tokens")):
                c.add_metric([stage], float(drafting.get(key, 0)))
            yield c
            c = CounterMetricFamily(
                "sparsever:evict_steps",
                "EVICT truncation decisions: steps seen, steps that cut nodes, steps verified with no "
                "drafts (speculation did not pay), steps the guard skipped drafting in",
                labels=["decision"],
            )
            for decision, key in (("seen", "evict_steps"), ("truncated", "evict_truncated_steps"),
                                  ("empty", "evict_empty_steps"), ("skipped_drafting", "evict_skipped_drafting_steps")):
                c.add_metric([decision], float(drafting.get(key, 0)))
            yield c
        if "hier_pending_tokens" in drafting:
            g = GaugeMetricFamily(
                "sparsever:level_acceptance_rate",
                "Hierarchical verification: accepted / checked tokens per level "
                "(intermediate: drafts the intermediate verifier kept; full: pending tokens the target kept)",
                labels=["level"],
            )
            g.add_metric(["intermediate"], float(drafting.get("hier_intermediate_acceptance_rate", float("nan"))))
            full = s.get("acceptance_rate")
            g.add_metric(["full"], float("nan") if full is None else float(full))
            yield g
            c = CounterMetricFamily(
                "sparsever:pending_rolled_back",
                "Hierarchical verification: pending tokens the full target rejected (never emitted)",
            )
            c.add_metric([], float(s.get("num_draft_tokens", 0) - s.get("num_accepted_tokens", 0)))
            yield c
            c = CounterMetricFamily(
                "sparsever:level_time_seconds",
                "Hierarchical verification: time per level (draft, intermediate, full verification)",
                labels=["level"],
            )
            c.add_metric(["draft"], float(drafting.get("hier_draft_time_s", 0.0)))
            c.add_metric(["intermediate"], float(drafting.get("hier_intermediate_time_s", 0.0)))
            c.add_metric(["full"], float(s.get("verify_time_s", 0.0)))
            yield c
            c = CounterMetricFamily(
                "sparsever:reuse_layers_skipped",
                "Hierarchical verification: decoder layers full passes skipped by starting from the "
                "intermediate verifier's hidden states (reuse_hidden_states)",
            )
            c.add_metric([], float(drafting.get("hier_reuse_layers_skipped", 0)))
            yield c
        g = GaugeMetricFamily(
            "sparsever:per_position_acceptance",
            "Acceptance rate of the draft token at each position",
            labels=["position"],
        )
        for i, value in enumerate(s.get("per_position_acceptance", [])):
            g.add_metric([str(i)], float("nan") if value is None else float(value))
        yield g


def ensure_metrics_dir() -> str:
    """Create (once per process tree) the snapshot directory and export it to child processes."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not directory:
        import tempfile

        directory = tempfile.mkdtemp(prefix="vllm-sparsever-metrics-")
        os.environ[METRICS_DIR_ENV] = directory
    return directory


def register_prometheus_collector() -> None:
    """Expose the workers' metrics on this process's Prometheus registry (front end)."""
    global _collector_registered
    with _collector_lock:
        if _collector_registered:
            return
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return
        REGISTRY.register(SparseverCollector(ensure_metrics_dir()))
        _collector_registered = True
