"""The top floor of serving: vLLM plugin registration, speculative-config mapping, the worker and model
runner. vLLM internals are reached through `vllm_sparsever.compat`."""

# The plugin modules a vLLM worker imports at start (worker class, runner, sparse verification,
# metrics): what the import-weight test and benchmark load. Kept import-free here on purpose.
WORKER_MODULES = (
    "vllm_sparsever.integration.worker",
    "vllm_sparsever.verification.sparse.setup",
    "vllm_sparsever.verification.sparse.runtime",
    "vllm_sparsever.verification.sparse.attention",
    "vllm_sparsever.verification.sparse.ffn",
    "vllm_sparsever.verification.sparse.moe",
    "vllm_sparsever.metrics",
)
