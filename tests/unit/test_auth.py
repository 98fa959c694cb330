"""remp.auth: the access table covers every RPC, credentials load safely, the checks answer the
right status, and no CLI takes a secret in argv."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import grpc
import pytest

from remp import auth
from remp.auth import PUBLIC, RPC_ACCESS, Credentials, Denied, Role
from remp.controller.v1 import controller_pb2
from remp.errors import ConfigError
from remp.node_agent.v1 import fault_injection_pb2, node_agent_pb2
from remp.policy.v1 import policy_pb2


def all_methods() -> set[str]:
    out = set()
    for mod, svc in ((controller_pb2, "Controller"), (node_agent_pb2, "NodeAgent"),
                     (fault_injection_pb2, "FaultInjection"), (policy_pb2, "Policy")):
        s = mod.DESCRIPTOR.services_by_name[svc]
        out |= {f"/{s.full_name}/{m.name}" for m in s.methods}
    return out


def test_the_table_lists_every_rpc_of_every_service_and_nothing_else():
    assert set(RPC_ACCESS) == all_methods()


def test_state_changing_and_request_data_rpcs_are_not_public():
    must = {"RegisterNode", "Heartbeat", "Reconfigure", "Abort", "RecordRecommendation",
            "Rollout", "ControlRollout",
            "DrainNode", "ListRecoveries", "ExecuteSwitch", "AbortSwitch", "ListRequests",
            "MigrateRequest", "ImportRequest", "SetDraining", "SetMode"}
    for m, roles in RPC_ACCESS.items():
        if m.rsplit("/", 1)[1] in must:
            assert roles, m
    # switches and epochs only from the controller's identity
    assert RPC_ACCESS["/remp.node_agent.v1.NodeAgent/ExecuteSwitch"] == {Role.CONTROLLER}
    assert RPC_ACCESS["/remp.node_agent.v1.NodeAgent/AbortSwitch"] == {Role.CONTROLLER}


def creds() -> Credentials:
    return Credentials.generate()


def md(tok: str):
    return (("authorization", f"Bearer {tok}"),)


def test_authorize_answers_the_right_status():
    c = creds()
    ex = "/remp.node_agent.v1.NodeAgent/ExecuteSwitch"
    assert c.authorize(ex, md(c.tokens[Role.CONTROLLER]), "ipv4:10.0.0.1:5").role == Role.CONTROLLER
    for meta, code in [((), grpc.StatusCode.UNAUTHENTICATED),
                       (md("x" * 40), grpc.StatusCode.UNAUTHENTICATED),
                       ((("authorization", "Basic abc"),), grpc.StatusCode.UNAUTHENTICATED),
                       (md("y" * 100_000), grpc.StatusCode.UNAUTHENTICATED),
                       (md(c.tokens[Role.OPERATOR]), grpc.StatusCode.PERMISSION_DENIED),
                       (md(c.tokens[Role.AGENT]), grpc.StatusCode.PERMISSION_DENIED)]:
        with pytest.raises(Denied) as ei:
            c.authorize(ex, meta, "ipv4:10.0.0.1:5")
        assert ei.value.code == code
        assert "Traceback" not in str(ei.value) and c.tokens[Role.OPERATOR] not in str(ei.value)
    # public: anonymous is fine, a wrong token is not
    pub = "/remp.controller.v1.Controller/ListNodes"
    assert RPC_ACCESS[pub] == PUBLIC
    assert c.authorize(pub, (), "ipv6:[::1]:7").key == "anon@::1"
    with pytest.raises(Denied):
        c.authorize(pub, md("z" * 40), "ipv4:1.2.3.4:1")
    # health and reflection are open; an unknown method of ours is refused
    assert c.authorize("/grpc.health.v1.Health/Check", (), "x").role is None
    with pytest.raises(Denied) as ei:
        c.authorize("/remp.controller.v1.Controller/Nope", (), "x")
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_tls_common_names_map_to_roles():
    c = creds()
    c = Credentials(c.tokens, c.digests, {"remp-controller": Role.CONTROLLER})
    ex = "/remp.node_agent.v1.NodeAgent/ExecuteSwitch"
    got = c.authorize(ex, (), "ipv4:1.1.1.1:1", {"x509_common_name": [b"remp-controller"]})
    assert got.role == Role.CONTROLLER
    with pytest.raises(Denied):
        c.authorize(ex, (), "ipv4:1.1.1.1:1", {"x509_common_name": [b"someone-else"]})


def test_files_are_written_0600_and_group_readable_files_refused(tmp_path):
    c = creds()
    p = c.write(tmp_path / "sub" / "c.json")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    back = Credentials.load(p, env={})
    assert back.tokens == c.tokens and back.enforcing
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        Credentials.load(p, env={})


def test_digests_verify_but_are_never_sent(tmp_path):
    c = creds()
    op = c.tokens[Role.OPERATOR]
    p = tmp_path / "v.json"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"tokens": {"operator": "sha256:" + auth.digest(op).hex(),
                              "agent": c.tokens[Role.AGENT]}}, f)
    v = Credentials.load(p, env={})
    assert v.role_of(op) == Role.OPERATOR and Role.OPERATOR not in v.tokens
    assert v.token_for("/remp.controller.v1.Controller/Heartbeat") == c.tokens[Role.AGENT]
    assert v.token_for("/remp.controller.v1.Controller/Reconfigure") is None


def test_environment_tokens_and_bad_values():
    tok = "e" * 32
    c = Credentials.load(None, env={"REMP_TOKEN_POLICY": tok})
    assert c.role_of(tok) == Role.POLICY and c.source == "environment"
    for bad in ("short", "has space in it 1234567890", "sha256:zz"):
        with pytest.raises(ConfigError):
            Credentials.load(None, env={"REMP_TOKEN_POLICY": bad})
    with pytest.raises(ConfigError, match="unknown role"):
        Credentials.from_mapping({"tokens": {"root": tok}}, "x")


def test_servers_refuse_to_start_without_credentials():
    c = Credentials.load(None, env={})
    with pytest.raises(ConfigError, match="no credentials"):
        c.require_for_server("remp controller")
    Credentials.load(None, env={"REMP_ALLOW_UNAUTHENTICATED": "1"}).require_for_server("x")


def test_only_keeps_verification_and_sends_one_role():
    c = creds()
    a = c.only(Role.AGENT)
    assert set(a.tokens) == {Role.AGENT} and a.digests == c.digests
    assert a.token_for("/remp.node_agent.v1.NodeAgent/ExecuteSwitch") is None


def cli(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("REMP_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                          text=True, env=e, timeout=120)


def test_no_cli_takes_a_secret_in_argv(tmp_path):
    for args in (["controller", "--token", "abc"], ["agent", "--model", str(tmp_path),
                                                      "--controller-token", "abc"],
                 ["dashboard", "--controller", "x:1", "--token", "abc"],
                 ["reconfigure", "n", "TP1PP1", "--token", "abc"],
                 ["policy", "serve", "--token", "abc"]):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "secrets never go on the command line" in r.stderr, r.stderr


def test_credentials_create_and_token(tmp_path):
    f = tmp_path / "c.json"
    r = cli("credentials", "create", str(f))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert cli("credentials", "create", str(f)).returncode == 1  # never overwrites silently
    r = cli("credentials", "token", "operator", "--credentials-file", str(f))
    assert r.stdout.strip() == json.loads(f.read_text())["tokens"]["operator"]


def test_a_bad_credentials_file_is_one_line_for_every_operator_command(tmp_path):
    bad = tmp_path / "c.json"
    Credentials.generate().write(bad)
    os.chmod(bad, 0o644)
    for args in (["status"], ["nodes"], ["reconfigure", "n", "TP1PP2"], ["watch"],
                 ["credentials", "token", "operator"], ["policy", "mode", "off"]):
        r = cli(*args, "--credentials-file", str(bad))
        assert r.returncode in (1, 2), (args, r.stderr)
        assert "readable by others" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_controller_without_credentials_exits_with_one_line():
    r = cli("controller", "--port", "0")
    assert r.returncode == 2
    assert "no credentials configured" in r.stderr and "Traceback" not in r.stderr


def test_rotation_accepts_every_listed_value_and_sends_the_first():
    old, new = "o" * 32, "n" * 32
    c = Credentials.from_mapping({"tokens": {"operator": [new, "sha256:" + auth.digest(old).hex()]}},
                                 "x")
    assert c.role_of(new) == c.role_of(old) == Role.OPERATOR
    assert c.tokens[Role.OPERATOR] == new
    assert c.role_of("p" * 32) is None


def test_docs_security_table_matches_the_access_table():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    pkg = {"Controller": "remp.controller.v1", "NodeAgent": "remp.node_agent.v1",
           "FaultInjection": "remp.node_agent.v1", "Policy": "remp.policy.v1"}
    seen = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] not in pkg:
            continue
        who = cells[2].split("(")[0]
        roles = frozenset() if who.strip().startswith("public") else frozenset(
            Role(w.strip()) for w in who.split(","))
        for rpc in cells[1].split("(")[0].split(","):
            seen[f"/{pkg[cells[0]]}.{cells[0]}/{rpc.strip()}"] = roles
    assert seen == RPC_ACCESS
