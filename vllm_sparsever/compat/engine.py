"""Shutting down an offline `vllm.LLM`'s engine (vLLM 0.32 has no public call for it).

A command that lets the process exit with the engine core still up gets vLLM's "MPClient: engine core
exited unexpectedly; starting cleanup" warning after its result, which reads like a crash. The
engine's client (`llm.llm_engine.engine_core`, an EngineCoreClient) has `shutdown(timeout=)`; its
default grace period (5 s) is shorter than an engine core's teardown after a long job, and vLLM then
logs "force killing remaining process EngineCore" after the result: the grace period is raised.
"""

from __future__ import annotations

from typing import Any


# Seconds the engine core and its workers get to exit on their own before vLLM kills them.
SHUTDOWN_GRACE_S = 60.0


def shutdown_llm(llm: Any) -> None:
    """Stop `llm`'s engine core and its processes now (idempotent; a no-op for an engine without one)."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(engine_core, "shutdown", None)
    if shutdown is not None:
        shutdown(timeout=SHUTDOWN_GRACE_S)
