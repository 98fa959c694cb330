import faulthandler
import os
import sys
import threading
import time

import grpc
import psutil
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


# ----------------------------------------------------------------------------- gRPC kept up
# Every gRPC channel holds gRPC's global state (grpc_init); when the last one goes, gRPC shuts
# down in a thread of its own under its init lock, and the next channel's grpc_init waits for
# that lock holding the GIL: wherever the shut-down needs the GIL (grpc/grpc#42247 shows one
# way), the whole process freezes, and no signal handler runs. The tests open a channel per
# call, thousands of such cycles a run; CI once sat 80 minutes in one test with nothing
# printed, which fits this. One idle channel, never connected, open for the whole run, keeps
# gRPC up.
_GRPC_KEPT_UP = grpc.insecure_channel("127.0.0.1:9")


# ----------------------------------------------------------------------------- the backstop
# pytest-timeout (``timeout`` in pyproject.toml) fails a test that runs too long with SIGALRM:
# the test's own clean-up then reaps the agents it started. A signal cannot end a test whose
# main thread is stuck where its handler never runs or never returns (a C library waiting on a
# condition, a deadlock on a lock or the GIL). Then, ``timeout`` + G s into one test
# (G = $REMP_TEST_BACKSTOP_GRACE_S, 120), a thread prints every thread's stack to stderr, kills
# what the run started and exits with code 70; where no Python thread can run (the GIL held),
# faulthandler's C watchdog prints the stacks at ``timeout`` + 2G s and exits with code 1.
BACKSTOP_EXIT = 70
_current: dict = {}


def _backstop(limit: float, config, err) -> None:
    while True:
        time.sleep(min(5.0, limit / 4))
        nodeid, since = _current.get("test", (None, 0.0))
        if nodeid is None or time.monotonic() - since < limit:
            continue
        err.write(f"\n+++ backstop: {nodeid} still running after {limit:.0f} s; "
                  "every thread's stack follows, then the run exits +++\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        for p in psutil.Process().children(recursive=True):
            try:
                err.write(f"killing child {p.pid}: {' '.join(p.cmdline()[:8])}\n")
                p.kill()
            except psutil.Error:
                pass
        err.flush()
        os._exit(BACKSTOP_EXIT)


def pytest_configure(config):
    try:
        timeout = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not installed
        return
    if timeout <= 0:
        return
    grace = float(os.environ.get("REMP_TEST_BACKSTOP_GRACE_S", "120"))
    # the real stderr (a test's own is captured at fd level while it runs)
    err = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")
    _current.update(err=err, hard=timeout + 2 * grace)
    threading.Thread(target=_backstop, args=(timeout + grace, config, err), daemon=True,
                     name="test-backstop").start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    _current["test"] = (item.nodeid, time.monotonic())
    if "err" in _current:
        faulthandler.dump_traceback_later(_current["hard"], exit=True, file=_current["err"])
    yield
    if "err" in _current:
        faulthandler.cancel_dump_traceback_later()
    _current.pop("test", None)
