"""vLLM's own errors on an imported request become typed remp errors (INVALID_ARGUMENT for what
vLLM refuses to run, UNAVAILABLE for a dead engine), never gRPC UNKNOWN. A stand-in for
AsyncLLM.generate raises what vLLM 0.32.0 raises; EngineHandle.import_request is the real one."""

import grpc
import pytest

from node_agent.engine_plugin import EngineHandle
from remp.errors import InvalidArgument, Unavailable

# importing vLLM (and torch) in this process: their own deprecation warnings are not ours
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning", "ignore::UserWarning")


class FailingEngine:
    def __init__(self, exc: Exception):
        self.exc = exc

    async def generate(self, prompt, params, request_id):
        raise self.exc
        yield  # an async generator, like AsyncLLM.generate


def _errors():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    return [(ValueError("Token id 9999 is out of vocabulary"), InvalidArgument),
            (VLLMValidationError("prompt too long"), InvalidArgument),
            (EngineDeadError(), Unavailable)]


@pytest.mark.parametrize("i", range(3))
async def test_vllm_errors_are_typed(i):
    exc, want = _errors()[i]
    handle = EngineHandle.__new__(EngineHandle)
    handle.engine = FailingEngine(exc)
    with pytest.raises(want) as e:
        async for _ in handle.import_request("r1", [5, 6], [], 4, 0.0, True, None):
            pass
    assert e.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
