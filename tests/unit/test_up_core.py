"""`remp up`'s pure parts, no processes: the restart budget, the credentials it prepares, the
per-child credential files, URL redaction, the removed --token flag, and the supervision loop
driven with fake children and a virtual clock."""

from __future__ import annotations

import json
import os
import stat
from argparse import Namespace
from pathlib import Path

import pytest

from remp.auth import Credentials, Role
from remp.errors import ConfigError
from remp.redisproc import redact_url
from devstack.up import (RestartBudget, Stack, Supervised, child_credentials, prepare_credentials,
                     write_private)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# ---------------------------------------------------------------------------- restart budget

def test_restart_budget_backs_off_then_gives_up_and_forgets_old_deaths():
    b = RestartBudget(limit=3, window_s=100, base_s=1, max_delay_s=3)
    assert [b.on_death(t) for t in (0, 1, 2)] == [1, 2, 3]  # 1, 2, 4 capped at 3
    assert b.on_death(3) is None  # a 4th death within 100 s
    b = RestartBudget(limit=2, window_s=10)
    assert b.on_death(0) == 1 and b.on_death(1) == 2
    assert b.on_death(50) == 1  # the window forgot the first two
    assert RestartBudget(limit=0).on_death(0) is None  # --max-restarts 0: stop at once


# ---------------------------------------------------------------------------- credentials

def test_credentials_new_then_reused_then_rotated(tmp_path):
    path, c1, status = prepare_credentials(tmp_path)
    assert path == tmp_path / "credentials.json" and status == "new"
    assert mode(path) == 0o600 and set(c1.tokens) == set(Role)
    _, c2, status = prepare_credentials(tmp_path)
    assert status == "reused" and c2.tokens == c1.tokens  # the operator's CLI keeps working
    _, c3, status = prepare_credentials(tmp_path, rotate=True)
    assert status.startswith("rotated") and set(c3.tokens.values()).isdisjoint(c1.tokens.values())
    assert mode(path) == 0o600


def test_a_readable_credentials_file_is_replaced_not_reused(tmp_path):
    path, c1, _ = prepare_credentials(tmp_path)
    os.chmod(path, 0o644)
    _, c2, status = prepare_credentials(tmp_path)
    assert status.startswith("replaced") and "readable by others" in status
    assert set(c2.tokens.values()).isdisjoint(c1.tokens.values()) and mode(path) == 0o600


def test_a_given_credentials_file_needs_every_role_and_is_never_rotated(tmp_path):
    full = Credentials.generate().write(tmp_path / "full.json")
    path, creds, status = prepare_credentials(tmp_path / "up", full)
    assert (path, status) == (full, "given") and set(creds.tokens) == set(Role)
    with pytest.raises(ConfigError, match="credentials create --force"):
        prepare_credentials(tmp_path / "up", full, rotate=True)
    part = Credentials.generate().only(Role.AGENT).write(tmp_path / "agent-only.json")
    with pytest.raises(ConfigError, match="missing: operator, controller, policy"):
        prepare_credentials(tmp_path / "up", part)
    assert not (tmp_path / "up" / "credentials.json").exists()


def test_each_child_holds_only_its_own_token_and_verifies_the_others(tmp_path):
    creds = Credentials.generate()
    for role in Role:
        text = child_credentials(creds, role)
        for other in Role:
            assert (creds.tokens[other] in text) == (other == role)
        mine = Credentials.load(write_private(tmp_path / f"{role.value}.json", text), env={})
        assert dict(mine.tokens) == {role: creds.tokens[role]}
        assert all(mine.role_of(creds.tokens[r]) == r for r in Role)  # verifies every role
        assert mode(tmp_path / f"{role.value}.json") == 0o600


def test_write_private_is_0600_even_over_a_readable_file(tmp_path):
    p = tmp_path / "addresses.json"
    p.write_text("{}")
    os.chmod(p, 0o644)
    write_private(p, '{"a": 1}')
    assert mode(p) == 0o600 and json.loads(p.read_text()) == {"a": 1}


def test_redact_url_hides_every_password():
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("rediss://user:s3cret@h:6380/1?x=1") == "rediss://user:***@h:6380/1?x=1"
    assert redact_url("redis://s3cret@h:6379") == "redis://***@h:6379"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert "s3cret" not in redact_url("redis://:s3cret@[::1:6379")


# ---------------------------------------------------------------------------- the CLI flag

@pytest.mark.parametrize("flag", ["--token", "--controller-token"])
def test_up_token_flags_fail_with_an_explanation(flag, capsys):
    from ops.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["up", flag, "abcdefghijklmnopqrstuvwxyz"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"{flag} was removed" in err and "credentials.json" in err
    assert "abcdefghijklmnopqrstuvwxyz" not in err
    a = build_parser().parse_args(["up", "--new-credentials", "--no-agent"])
    assert a.new_credentials and not a.agent and a.credentials_file is None


@pytest.mark.parametrize("args", [["--api-key", "sk-secret-1"], ["--api-key=sk-secret-1"]])
def test_an_api_key_for_the_agent_is_refused_on_the_command_line(args):
    from devstack.up import check_agent_args

    with pytest.raises(ConfigError, match="VLLM_API_KEY") as exc:
        check_agent_args(["--max-num-seqs", "4", *args])
    assert "sk-secret-1" not in str(exc.value)
    check_agent_args(["--max-num-seqs", "4", "--", "--enforce-eager"])


def test_a_killed_agents_weight_store_is_removed(tmp_path, monkeypatch):
    from devstack.up import weight_store_cleanup

    store = tmp_path / "remp-n1-4242"
    store.mkdir()
    (store / "model.safetensors").write_bytes(b"x" * 2**20)
    other = tmp_path / "remp-n1-4243"  # another agent's: left alone
    other.mkdir()
    clean = weight_store_cleanup("n1", ["--weight-store-root", str(tmp_path)])
    assert clean(4242) == f"removed its weight store {store} (1.0 MiB)"
    assert not store.exists() and other.exists() and clean(4242) is None
    monkeypatch.setenv("REMP_AGENT_WEIGHT_STORE_ROOT", str(tmp_path))
    assert weight_store_cleanup("n1", [])(4243) and not other.exists()


# ---------------------------------------------------------------------------- supervision

class FakeChild(Supervised):
    def __init__(self, name, limit=5):
        super().__init__(name, budget=RestartBudget(limit=limit))
        self.up, self.is_ready, self.starts, self.reaped = True, True, 1, 0

    def alive(self):
        return self.up

    @property
    def pid(self):
        return 1000 + self.starts

    @property
    def returncode(self):
        return None if self.up else -9

    def restart(self):
        self.restarts += 1
        self.starts += 1
        self.up, self.is_ready = True, False

    def reap(self):
        self.reaped += 1
        return []

    def ready(self):
        return self.is_ready


def stack_with(*children) -> Stack:
    s = Stack(Namespace(max_restarts=5))
    s.children = list(children)
    s._last_snapshot = float("inf")  # no process-tree snapshots of fakes
    s.said = []
    s.say = s.said.append
    return s


def test_a_dead_child_is_restarted_after_its_delay_while_the_others_run():
    agent, ctl = FakeChild("agent"), FakeChild("controller")
    s = stack_with(ctl, agent)
    s.supervise_once(0)
    assert s.said == []
    agent.up = False
    s.supervise_once(10)
    assert agent.reaped == 1 and agent.restart_at == 11
    assert "agent was killed by SIGKILL; restarting it in 1 s (restart 1 of at most 5" in s.said[0]
    s.supervise_once(10.5)
    assert agent.starts == 1  # not yet
    s.supervise_once(11)
    assert agent.starts == 2 and s.said[-1] == "restarted agent (pid 1002)"
    s.supervise_once(11.5)
    assert s.said[-1] == "restarted agent (pid 1002)"  # not ready yet
    agent.is_ready = True
    s.supervise_once(12)
    assert s.said[-1] == "agent ready again"
    assert ctl.starts == 1 and ctl.reaped == 0  # the controller was left alone
    agent.up = False  # dies again: twice the delay
    s.supervise_once(20)
    assert agent.restart_at == 22


def test_a_child_dying_too_often_stops_the_stack_with_a_clear_message():
    agent = FakeChild("agent", limit=1)
    s = stack_with(agent)
    agent.up = False
    s.supervise_once(0)
    s.supervise_once(1)
    agent.up = False  # dies while recovering
    with pytest.raises(RuntimeError, match=r"agent was killed by SIGKILL: it died 2 times in "
                       r"10 min \(--max-restarts 1\); stopping the stack"):
        s.supervise_once(2)


def test_a_failed_restart_stops_the_stack():
    redis = FakeChild("redis")

    def broken():
        raise RuntimeError("port in use")
    redis.restart = broken
    s = stack_with(redis)
    redis.up = False
    s.supervise_once(0)
    with pytest.raises(RuntimeError, match=r"redis could not be restarted \(port in use\); "
                       "stopping the stack"):
        s.supervise_once(5)


def test_cpu_agents_get_a_short_worker_spin_unless_told_otherwise():
    from devstack.up import with_agent_defaults

    assert with_agent_defaults(["--dtype", "float32"], cpu=True) == [
        "--dtype", "float32", "--worker-spin-seconds", "0.02"]
    assert with_agent_defaults(["--worker-spin-seconds", "1"], cpu=True) == [
        "--worker-spin-seconds", "1"]
    assert with_agent_defaults(["--worker-spin-seconds=0"], cpu=True) == [
        "--worker-spin-seconds=0"]
    assert with_agent_defaults(["--dtype", "float32"], cpu=False) == ["--dtype", "float32"]
