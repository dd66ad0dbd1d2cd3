"""Where built models and data live (`$VLLM_SPARSEVER_HOME`), PyPI packages as file carriers, and
the sha256 manifests of finished folders: shared by the model and data builders (offline)."""
