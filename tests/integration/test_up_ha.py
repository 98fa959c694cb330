"""`remp up --ha --no-agent`: Redis as a primary, a replica and three sentinels (real
processes); the controller and the policy reach it through Sentinel, the controller waits for
the replica on acknowledged writes. kill -9 of the primary: the sentinels promote the replica,
the controller is SERVING again and the policy's writes work; `remp up` restarts the killed
server, which rejoins as a replica. No password in any argv."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from remp.auth import Credentials, Role, sync_channel
from remp.policy.v1 import policy_pb2, policy_pb2_grpc
from remp.redisconn import parse_sentinel_url
from tests.integration.test_up_cli import health, wait_serving
from tests.upstack import UpProcess, environ


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up-ha") / "up"
    up = UpProcess(["--no-agent", "--ha"], log_dir)
    try:
        up.wait_ready(120)
        yield up
    finally:
        up.kill()


def set_mode(stack, mode) -> int:
    creds = Credentials.load(stack.log_dir / "credentials.json", env={})
    with sync_channel(stack.addr["policy"], creds.only(Role.OPERATOR)) as ch:
        return policy_pb2_grpc.PolicyStub(ch).SetMode(
            policy_pb2.SetModeRequest(mode=mode, node=""), timeout=10).mode


def test_ha_stack_fails_over_when_the_primary_is_killed(stack):
    ctl_pid = next(p.pid for p in stack.descendants() if " controller " in " ".join(p.cmdline()))
    env = environ(ctl_pid)
    url = env["REMP_CONTROLLER_REDIS_URL"]
    assert url.startswith("redis+sentinel://") and env["REMP_CONTROLLER_REDIS_WAIT_REPLICAS"] == "1"
    loc = parse_sentinel_url(url)
    assert stack.argv_offenders([loc.password]) == []
    assert loc.password not in stack.output

    def primary() -> int:
        with redis.Redis(port=loc.sentinels[0][1], password=loc.password, socket_timeout=2,
                         decode_responses=True) as s:
            return int(s.execute_command("SENTINEL", "get-master-addr-by-name",
                                         loc.service)[1])
    old = primary()
    assert set_mode(stack, policy_pb2.MODE_ADVISORY) == policy_pb2.MODE_ADVISORY
    victim = next(p for p in stack.descendants()
                  if "redis-server" in p.name() and any(
                      c.laddr.port == old for c in p.net_connections("inet")
                      if c.status == "LISTEN"))
    n = len(stack.lines)
    victim.kill()
    t0 = time.monotonic()
    while primary() == old:
        assert time.monotonic() - t0 < 30, "no failover in 30 s"
        time.sleep(0.2)
    failover = time.monotonic() - t0
    wait_serving(stack.addr["controller"], "remp.controller.v1.Controller", 30)
    deadline = time.monotonic() + 20
    while True:  # a write, after it (UNAVAILABLE while no sentinel reports the new primary up)
        try:
            assert set_mode(stack, policy_pb2.MODE_OFF) == policy_pb2.MODE_OFF
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
            time.sleep(0.2)
    recovered = time.monotonic() - t0
    # remp up restarts the killed server; Sentinel makes it a replica of the new primary
    stack.wait_line("restarted redis primary", 30, after=n)
    with redis.Redis(port=old, password=loc.password, socket_timeout=2,
                     decode_responses=True) as r:
        deadline = time.monotonic() + 30
        while r.info("replication").get("role") != "slave":
            assert time.monotonic() < deadline, "the old primary did not rejoin as a replica"
            time.sleep(0.3)
    assert health(stack.addr["controller"], "remp.controller.v1.Controller") == "SERVING"
    print(f"redis failover {failover:.2f} s; controller serving and policy writing after "
          f"{recovered:.2f} s")
