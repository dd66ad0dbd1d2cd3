"""Everything that touches vLLM: speculative-config mapping, worker and model runner, metrics export."""
