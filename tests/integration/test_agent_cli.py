"""`remp agent` start-up validation: wrong settings exit at once with one clear line."""

import os
import subprocess
import sys
import time

import pytest


def run_agent(*args, timeout=30):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ops.cli", "agent", *args],
                       capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("args,message", [
    (["--model", "/definitely/not/here"], "model directory '/definitely/not/here' does not exist"),
    (["--tp", "3"], "TP3PP1: TP=3 does not divide the 8 attention heads"),
    (["--tp", "2", "--pp", "2", "--devices", "2"], "TP2PP2: TP*PP=4 is more than the 2 devices"),
    (["--pp", "5", "--devices", "8"], "PP=5 is more stages than the 4 layers"),
    (["--tp", "0"], "invalid setting tp"),
    (["--candidates", "TP2PP9"], "candidate TP2PP9 is not valid"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])
def test_bad_settings_fail_fast_with_one_line(tiny_model, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_model), "--device", "cpu", *args]
    r, took = run_agent(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("remp: error: ")
    assert message in lines[0]
    assert took < 15  # no engine was started (vLLM is not even imported)


def test_valid_targets_listed_in_error(tiny_model):
    r, _ = run_agent("--model", str(tiny_model), "--device", "cpu", "--devices", "2", "--tp", "4")
    assert "valid on this host: TP1PP1, TP2PP1, TP1PP2" in r.stderr


def test_make_model_cli_is_deterministic(tmp_path):
    for d in ("a", "b"):
        subprocess.run([sys.executable, "-m", "ops.cli", "make-model", str(tmp_path / d)],
                       check=True, capture_output=True)
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()


def test_http_port_in_use_is_a_clear_error(tiny_model):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r, _ = run_agent("--model", str(tiny_model), "--device", "cpu", "--http-port", str(port))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"cannot bind the HTTP API to 127.0.0.1:{port}" in r.stderr


@pytest.mark.parametrize("env,message", [
    ({"REMP_AGENT_TLS_CLIENT_CERT": "/x.crt"}, "needs both tls_client_cert and tls_client_key"),
    ({"REMP_AGENT_MIGRATION_PEERS": "10.0.0.2"}, "migration peer '10.0.0.2' is not host:port"),
])
def test_migration_link_settings_fail_fast(tiny_model, env, message):
    r = subprocess.run([sys.executable, "-m", "ops.cli", "agent", "--model", str(tiny_model),
                        "--device", "cpu"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, **env})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("remp: error: ") and message in r.stderr, r.stderr
