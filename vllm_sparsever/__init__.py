"""vllm-sparsever: cheaper verification for speculative decoding in vLLM."""

__version__ = "0.1.0"


def register() -> None:
    """Entry point of `vllm.general_plugins`; runs in every vLLM process."""
    from vllm_sparsever.integration.registration import register_all

    register_all()
