"""Worker snapshots: throttled, but the last state of a burst always reaches the file."""

import json
import time

from vllm_sparsever.metrics import SnapshotWriter, SparseverMetrics


def test_throttled_write_is_flushed_after_the_interval(tmp_path):
    writer = SnapshotWriter(rank=0, directory=str(tmp_path))
    metrics = SparseverMetrics(num_spec_tokens=3)
    writer.write(metrics, force=True)
    metrics.observe_step(step_time_s=0.01, verify_time_s=0.005, draft_time_s=0.001, is_verify=True)
    writer.write(metrics)  # inside the throttle interval: deferred, not dropped
    path = tmp_path / "rank0.json"
    assert json.loads(path.read_text())["num_verify_steps"] == 0
    deadline = time.time() + 5
    while json.loads(path.read_text())["num_verify_steps"] != 1:
        assert time.time() < deadline, "deferred snapshot never written"
        time.sleep(0.05)
