"""Worker snapshots: throttled, but the last state of a burst always reaches the file.

A fake clock and a recording timer factory drive the throttle, so nothing depends on how fast the
machine runs the test (no sleep loops).
"""

import json
import threading

import pytest

from vllm_sparsever.metrics import _SNAPSHOT_INTERVAL_S, SnapshotWriter, SparseverMetrics


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTimer:
    """Stands in for threading.Timer: records its delay and runs its function only when fired."""

    def __init__(self, interval, function) -> None:
        self.interval, self.function = interval, function
        self.daemon = False
        self.started = False

    def start(self) -> None:
        self.started = True

    def fire(self) -> None:
        assert self.started, "the writer never started its timer"
        self.function()


@pytest.fixture
def writer_and_clock(tmp_path):
    clock, timers = FakeClock(), []

    def timer_factory(interval, function):
        timers.append(FakeTimer(interval, function))
        return timers[-1]

    writer = SnapshotWriter(rank=0, directory=str(tmp_path), clock=clock, timer_factory=timer_factory)
    return writer, clock, timers, tmp_path / "rank0.json"


def _verify_steps(path) -> int:
    return json.loads(path.read_text())["num_verify_steps"]


def _observe(metrics: SparseverMetrics) -> None:
    metrics.observe_step(step_time_s=0.01, verify_time_s=0.005, draft_time_s=0.001, is_verify=True)


def test_throttled_write_is_deferred_then_flushed_with_the_latest_state(writer_and_clock):
    writer, clock, timers, path = writer_and_clock
    metrics = SparseverMetrics(num_spec_tokens=3)
    writer.write(metrics, force=True)
    assert _verify_steps(path) == 0 and timers == []

    _observe(metrics)
    clock.now += 0.1
    writer.write(metrics)  # inside the throttle interval: deferred, not dropped
    assert _verify_steps(path) == 0
    assert len(timers) == 1 and timers[0].started and timers[0].daemon
    assert timers[0].interval == pytest.approx(_SNAPSHOT_INTERVAL_S - 0.1)

    _observe(metrics)
    clock.now += 0.05
    writer.write(metrics)  # same burst: one pending timer, still nothing written
    assert len(timers) == 1 and _verify_steps(path) == 0

    clock.now += _SNAPSHOT_INTERVAL_S
    timers[0].fire()
    assert _verify_steps(path) == 2  # the burst's last state, not the first deferred one

    # The flush restarted the interval: the next write is throttled again, with a new timer.
    _observe(metrics)
    clock.now += 0.01
    writer.write(metrics)
    assert _verify_steps(path) == 2 and len(timers) == 2
    assert timers[1].interval == pytest.approx(_SNAPSHOT_INTERVAL_S - 0.01)


def test_write_after_the_interval_and_forced_write_are_immediate(writer_and_clock):
    writer, clock, timers, path = writer_and_clock
    metrics = SparseverMetrics(num_spec_tokens=3)
    writer.write(metrics, force=True)
    _observe(metrics)
    clock.now += _SNAPSHOT_INTERVAL_S + 1e-3
    writer.write(metrics)
    assert _verify_steps(path) == 1 and timers == []
    _observe(metrics)
    writer.write(metrics, force=True)  # same instant, but forced
    assert _verify_steps(path) == 2 and timers == []


def test_timer_firing_twice_writes_once(writer_and_clock):
    writer, clock, timers, path = writer_and_clock
    metrics = SparseverMetrics(num_spec_tokens=3)
    writer.write(metrics, force=True)
    _observe(metrics)
    clock.now += 0.1
    writer.write(metrics)
    timers[0].fire()
    assert _verify_steps(path) == 1
    path.unlink()
    timers[0].fire()  # nothing pending any more
    assert not path.exists()


def test_real_timer_flushes_the_deferred_state(tmp_path):
    # The default timer (threading.Timer) really runs the flush: wait for its thread, not for the clock.
    timers = []

    def recording_timer(interval, function):
        timers.append(threading.Timer(interval, function))
        return timers[-1]

    clock = FakeClock()
    writer = SnapshotWriter(rank=3, directory=str(tmp_path), clock=clock, timer_factory=recording_timer)
    metrics = SparseverMetrics(num_spec_tokens=3)
    writer.write(metrics, force=True)
    _observe(metrics)
    writer.write(metrics)
    assert len(timers) == 1
    timers[0].join(timeout=30)
    assert not timers[0].is_alive(), "the snapshot timer never ran"
    assert _verify_steps(tmp_path / "rank3.json") == 1
