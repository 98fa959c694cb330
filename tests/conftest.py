import os

import pytest

from remp.auth import ENV_FILE, Credentials

from devstack.modelgen import make_model


@pytest.fixture(scope="session", autouse=True)
def favoured_test_session():
    """The tests are the clients: their session runs at autogroup nice -20 where permitted, ahead
    of the agents, controllers and Redis servers they start in sessions of their own, as clients
    on another host would be (devstack.agentproc.favour_this_session: without it an agent's
    busy-waiting workers starved the test process for seconds on 2 cores; CI once saw a no-op
    call take 13 s). Restored when the run ends."""
    from devstack.agentproc import favour_this_session

    favour_this_session()
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The project's deterministic tiny random Llama (bf16 checkpoint)."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def redis_server():
    """A private redis-server per test module (modules that need another kind define their
    own fixture of this name)."""
    from remp.redisproc import RedisServer

    with RedisServer() as r:
        yield r


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory):
    """One vLLM cache for every agent the session starts (they inherit the environment; an agent
    keeps a VLLM_CACHE_ROOT it is given). vLLM inspects a model class in a subprocess that
    imports vLLM once more unless its cache has the answer: 7 s of each engine start here when
    every agent had a cache of its own."""
    old = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm-cache"))
    yield
    if old is None:
        os.environ.pop("VLLM_CACHE_ROOT", None)
    else:
        os.environ["VLLM_CACHE_ROOT"] = old


@pytest.fixture(scope="session", autouse=True)
def remp_credentials(tmp_path_factory):
    """Every server the tests start (in process or as a child, which inherits the environment)
    checks this set; test clients send the role each method needs (remp.auth)."""
    creds = Credentials.generate()
    path = creds.write(tmp_path_factory.mktemp("credentials") / "credentials.json")
    old = os.environ.get(ENV_FILE)
    os.environ[ENV_FILE] = str(path)
    yield creds
    if old is None:
        os.environ.pop(ENV_FILE, None)
    else:
        os.environ[ENV_FILE] = old
