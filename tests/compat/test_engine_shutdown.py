"""compat.engine: vLLM's offline engine keeps its client at `llm_engine.engine_core`, with `shutdown()`."""

import inspect

from vllm_sparsever.compat.engine import shutdown_llm


def test_llm_engine_holds_an_engine_core_client_with_shutdown():
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine

    assert "self.engine_core" in inspect.getsource(LLMEngine.__init__)
    assert callable(getattr(EngineCoreClient, "shutdown", None))
    from vllm.v1.engine.core_client import InprocClient, MPClient

    for client in (EngineCoreClient, InprocClient, MPClient):  # the grace period is a keyword
        assert "timeout" in inspect.signature(client.shutdown).parameters, client
    from vllm import LLM

    assert "self.llm_engine" in inspect.getsource(LLM.__init__)


def test_shutdown_llm_calls_the_client_and_tolerates_none():
    calls = []

    class Client:
        def shutdown(self, timeout=None):
            calls.append(timeout)

    class Engine:
        engine_core = Client()

    class FakeLLM:
        llm_engine = Engine()

    shutdown_llm(FakeLLM())
    shutdown_llm(object())  # no engine: nothing to do
    assert calls == [60.0]
