"""TLS on every link from the environment ($REMP_TLS_CERT/KEY/CA): the controller and the policy
serve mutual TLS, their clients (the policy's controller client, the CLI) use it, and a client
certificate's common name can stand for a role (credentials' tls_identities)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from devstack.agentproc import ControllerProcess, free_port
from remp.auth import Credentials, Role
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.redisproc import RedisServer
from tests.tlscerts import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory, remp_credentials):
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA(d)
    out = {"ca": ca.cert_path, "dir": d}
    for name in ("remp-controller", "remp-policy", "remp-operator", "stranger"):
        # services serve and call others: their certificates are good for both
        out[name] = ca.issue(name, server=name in ("remp-controller", "remp-policy"),
                             client=True)
    creds = Credentials(remp_credentials.tokens, remp_credentials.digests,
                        {"remp-operator": Role.OPERATOR, "remp-policy": Role.POLICY})
    out["creds"] = creds.write(d / "credentials.json")
    return out


def tls_env(pki, who: str) -> dict[str, str]:
    cert, key = pki[who]
    return {"REMP_TLS_CERT": str(cert), "REMP_TLS_KEY": str(key), "REMP_TLS_CA": str(pki["ca"]),
            "REMP_CREDENTIALS_FILE": str(pki["creds"])}


def channel(pki, who: str | None) -> grpc.Channel:
    ca = pki["ca"].read_bytes()
    if who is None:
        return grpc.secure_channel("127.0.0.1:1", grpc.ssl_channel_credentials(ca))
    cert, key = pki[who]
    return grpc.ssl_channel_credentials(ca, key.read_bytes(), cert.read_bytes())


@pytest.fixture(scope="module")
def ctl(pki, artifacts_dir):
    with RedisServer() as r:
        c = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-tls",
                              env=tls_env(pki, "remp-controller"))
        c.start()
        deadline = time.monotonic() + 60
        while not (artifacts_dir / "ctl-tls-1.log").read_text().count("controller.ready"):
            assert c.proc.poll() is None and time.monotonic() < deadline, \
                c.log_path.read_text()[-2000:]
            time.sleep(0.2)
        yield c
        c.stop()


def reconfigure(addr: str, creds, md=None):
    with grpc.secure_channel(addr, creds) as ch:
        return controller_pb2_grpc.ControllerStub(ch).Reconfigure(
            controller_pb2.ReconfigureRequest(node="nobody",
                                              target=types_pb2.Topology(tp=1, pp=1)),
            metadata=md, timeout=10)


def test_plaintext_is_refused(ctl):
    with grpc.insecure_channel(ctl.addr) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            controller_pb2_grpc.ControllerStub(ch).ListNodes(controller_pb2.ListNodesRequest(),
                                                             timeout=5)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_names_a_role(ctl, pki):
    # the operator's certificate alone is the credential: the call reaches the controller
    with pytest.raises(grpc.RpcError) as ei:
        reconfigure(ctl.addr, channel(pki, "remp-operator"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND, ei.value.details()
    # a certificate from the same CA whose name maps to no role: no credential
    with pytest.raises(grpc.RpcError) as ei:
        reconfigure(ctl.addr, channel(pki, "stranger"))
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the policy's certificate is a policy: Reconfigure yes, Abort no
    with pytest.raises(grpc.RpcError) as ei:
        with grpc.secure_channel(ctl.addr, channel(pki, "remp-policy")) as ch:
            controller_pb2_grpc.ControllerStub(ch).Abort(
                controller_pb2.AbortRequest(switch_id="x"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_cli_and_policy_use_tls_from_the_environment(ctl, pki, artifacts_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMP_")}
    env.update(tls_env(pki, "remp-operator"))
    r = subprocess.run([sys.executable, "-m", "ops.cli", "health", ctl.addr, "--service",
                        "remp.controller.v1.Controller"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "SERVING", r.stderr
    r = subprocess.run([sys.executable, "-m", "ops.cli", "nodes", "--controller", ctl.addr,
                        "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    # the policy serves TLS too and reaches the controller over it
    port = free_port()
    penv = {**os.environ, **tls_env(pki, "remp-policy"), "REMP_LOG_FORMAT": "json"}
    log = artifacts_dir / "policy-tls.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "ops.cli", "policy", "serve", "--port",
                              str(port), "--controller", ctl.addr, "--tick-seconds", "0.3",
                              "--profile", "h200x8-analytic"], stdout=f,
                             stderr=subprocess.STDOUT, env=penv, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                r = subprocess.run([sys.executable, "-m", "ops.cli", "health",
                                    f"127.0.0.1:{port}", "--service", "remp.policy.v1.Policy"],
                                   capture_output=True, text=True, env=env, timeout=60)
                if r.stdout.strip() == "SERVING":
                    break
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.3)
            time.sleep(1.0)  # a few ticks: each lists the controller's nodes over TLS
            lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            assert not [x for x in lines if x.get("event") == "policy.controller_unreachable"], \
                lines[-5:]
        finally:
            p.terminate()
            assert p.wait(30) == 0, log.read_text()[-2000:]
