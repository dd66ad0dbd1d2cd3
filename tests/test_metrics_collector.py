"""The Prometheus collector: per-reason dense fallbacks become a labelled counter family."""

from vllm_sparsever.metrics import SnapshotWriter, SparseverCollector, SparseverMetrics


def test_fallbacks_per_component_and_reason(tmp_path):
    metrics = SparseverMetrics(num_spec_tokens=3)
    metrics.sparsity = {"attention_fallbacks": 3, "attention_fallback_metadata_mismatch": 2,
                        "attention_fallback_kernel_error": 1, "ffn_neurons_read": 10}
    metrics.num_dense_fallbacks = 3
    SnapshotWriter(rank=0, directory=str(tmp_path)).write(metrics, force=True)

    families = {f.name: f for f in SparseverCollector(str(tmp_path)).collect()}
    fallbacks = {(s.labels["component"], s.labels["reason"]): s.value
                 for s in families["sparsever:dense_fallbacks"].samples if s.name.endswith("_total")}
    assert fallbacks == {("attention", "metadata_mismatch"): 2.0, ("attention", "kernel_error"): 1.0}
    total = [s.value for s in families["sparsever:num_dense_fallbacks"].samples if s.name.endswith("_total")]
    assert total == [3.0]


def test_drafting_levels_are_a_gauge_and_counts_a_counter(tmp_path):
    metrics = SparseverMetrics(num_spec_tokens=3)
    metrics.drafting = {"draft_model_catch_up_tokens": 40, "draft_model_vocab_tokens": 32800,
                        "evict_clock_pass_s_rows1": 0.15, "evict_price_pass_share": 0.2, "evict_steps": 7,
                        "hier_intermediate_acceptance_rate": 0.5}
    SnapshotWriter(rank=0, directory=str(tmp_path)).write(metrics, force=True)

    families = {f.name: f for f in SparseverCollector(str(tmp_path)).collect()}
    counters = {s.labels["counter"]: s.value for s in families["sparsever:drafting"].samples
                if s.name.endswith("_total")}
    levels = {s.labels["name"]: s.value for s in families["sparsever:drafting_level"].samples}
    assert counters == {"draft_model_catch_up_tokens": 40.0, "evict_steps": 7.0}
    assert levels == {"draft_model_vocab_tokens": 32800.0, "evict_clock_pass_s_rows1": 0.15,
                      "evict_price_pass_share": 0.2, "hier_intermediate_acceptance_rate": 0.5}
    assert families["sparsever:drafting_level"].type == "gauge"
