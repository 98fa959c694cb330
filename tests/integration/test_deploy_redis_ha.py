"""deploy/redis-ha/ start scripts (what docker-compose.ha.yml and the Kubernetes overlay run)
against real redis-server processes on loopback: a seed primary, a replica and three sentinels
find each other; the password is in no argv; kill -9 of the primary fails over to the replica;
the killed server started again by its script joins as a replica of the new primary."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from remp.redisconn import client, write_acknowledged

HA = Path(__file__).resolve().parents[2] / "deploy" / "redis-ha"
PASSWORD = "deploy-ha-test-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert proc.poll() is None and time.monotonic() < deadline, f"nothing on {port}"
        time.sleep(0.05)


class Group:
    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, {}
        self.redis_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.env = {**os.environ, "REDIS_PASSWORD": PASSWORD,
                    "REDIS_SEED": f"127.0.0.1:{self.redis_ports[0]}",
                    "SENTINELS": ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports),
                    "REDIS_BIND": "127.0.0.1", "SENTINEL_BIND": "127.0.0.1",
                    "REDIS_ANNOUNCE_HOST": "127.0.0.1", "SENTINEL_ANNOUNCE_HOST": "127.0.0.1",
                    "DOWN_AFTER_MS": "1000", "FAILOVER_TIMEOUT_MS": "5000"}

    def start_redis(self, i: int) -> subprocess.Popen:
        d = self.tmp / f"redis{i}"
        d.mkdir(exist_ok=True)
        p = subprocess.Popen(["sh", str(HA / "redis-start.sh")], env={
            **self.env, "REDIS_PORT": str(self.redis_ports[i]), "REDIS_DIR": str(d)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.redis_ports[i], p)
        self.procs[f"redis{i}"] = p
        return p

    def start_sentinel(self, i: int) -> subprocess.Popen:
        d = self.tmp / f"sentinel{i}"
        d.mkdir(exist_ok=True)
        p = subprocess.Popen(["sh", str(HA / "sentinel-start.sh")], env={
            **self.env, "SENTINEL_PORT": str(self.sentinel_ports[i]),
            "SENTINEL_CONF": str(d / "sentinel.conf")},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.sentinel_ports[i], p)
        self.procs[f"sentinel{i}"] = p
        return p

    def info(self, i: int) -> dict:
        with redis.Redis(port=self.redis_ports[i], password=PASSWORD, socket_timeout=2,
                         decode_responses=True) as r:
            return r.info("replication")

    def sentinels_known(self, port: int) -> list:
        with redis.Redis(port=port, password=PASSWORD, socket_timeout=2) as s:
            return s.execute_command("SENTINEL", "sentinels", "remp")

    def master_flags(self, port: int) -> str:
        with redis.Redis(port=port, password=PASSWORD, socket_timeout=2,
                         decode_responses=True) as s:
            return s.execute_command("SENTINEL", "master", "remp").get("flags", "")

    def primary(self) -> int:
        with redis.Redis(port=self.sentinel_ports[0], password=PASSWORD, socket_timeout=2,
                         decode_responses=True) as s:
            return int(s.execute_command("SENTINEL", "get-master-addr-by-name", "remp")[1])

    def until(self, what, timeout: float, message: str) -> float:
        t0 = time.monotonic()
        while not what():
            assert time.monotonic() - t0 < timeout, message
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def group(tmp_path):
    g = Group(tmp_path)
    yield g
    g.stop()


def test_the_deploy_scripts_form_a_group_that_fails_over(group):
    g = group
    g.start_redis(0)
    g.start_redis(1)
    for i in range(3):
        g.start_sentinel(i)
    g.until(lambda: g.info(1).get("master_link_status") == "up", 20, "the replica did not sync")
    assert g.info(0)["role"] == "master" and g.primary() == g.redis_ports[0]
    for name, p in g.procs.items():  # exec'd (no shell left) and no password in argv
        cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode()
        assert "redis-server" in cmd and PASSWORD not in cmd, (name, cmd)
    for i in range(3):
        conf = Path(g.tmp / f"sentinel{i}" / "sentinel.conf")
        assert conf.stat().st_mode & 0o077 == 0
    g.until(lambda: all(len(g.sentinels_known(p)) == 2 for p in g.sentinel_ports), 20,
            "the sentinels did not find each other")
    # every sentinel has seen the primary up (what a Sentinel client checks before using it)
    g.until(lambda: all(g.master_flags(p) == "master" for p in g.sentinel_ports), 20,
            "the sentinels do not see the primary")
    url = (f"redis+sentinel://:{PASSWORD}@"
           + ",".join(f"127.0.0.1:{p}" for p in g.sentinel_ports) + "/remp")

    async def write(i: int, replicas: int) -> None:
        r = client(url, max_connections=2, timeout=2.0, socket_timeout=3.0)
        try:
            await write_acknowledged(r, replicas, 2000, ("SET", f"k{i}", "v"))
        finally:
            await r.aclose()
    asyncio.run(write(0, 1))
    os.killpg(g.procs["redis0"].pid, signal.SIGKILL)
    g.procs.pop("redis0").wait()
    took = g.until(lambda: g.primary() == g.redis_ports[1], 30, "no failover")
    # a Sentinel client takes a primary only once a sentinel reports it up (flags "master");
    # right after the promotion that can lag a moment, as a client's retries would
    g.until(lambda: any(g.master_flags(p) == "master" for p in g.sentinel_ports), 20,
            "no sentinel reports the new primary up")
    asyncio.run(write(1, 0))
    # the old primary, started again by its script, comes back as a replica of the new one
    g.start_redis(0)
    assert g.info(0)["role"] == "slave"
    g.until(lambda: g.info(0).get("master_link_status") == "up", 20, "it did not sync")
    with redis.Redis(port=g.redis_ports[0], password=PASSWORD, decode_responses=True) as r:
        assert r.mget(["k0", "k1"]) == ["v", "v"]
    print(f"deploy scripts: failover after {took:.2f} s")


# ------------------------------------------------------------------ the manifests
def _merge(base, patch):
    """Kubernetes strategic merge, as far as these patches use it: maps merge, lists of maps
    with a ``name`` merge by name (new names appended), anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [dict(x) for x in base]
        for item in patch:
            i = next((j for j, x in enumerate(out) if x["name"] == item["name"]), None)
            if i is None:
                out.append(item)
            else:
                out[i] = _merge(out[i], item)
        return out
    return patch


def overlay_docs() -> list[dict]:
    """deploy/redis-ha's kustomization applied by hand (kubectl is not installed here)."""
    import yaml

    from tests.integration.test_deploy_manifests import k8s_docs

    kust = yaml.safe_load((HA / "kustomization.yaml").read_text())
    assert kust["resources"][0] == "../k8s"
    docs = k8s_docs() + [d for r in kust["resources"][1:]
                         for d in yaml.safe_load_all((HA / r).read_text()) if d]
    for p in kust["patches"]:
        patch = yaml.safe_load((HA / p["path"]).read_text())
        key = (patch["kind"], patch["metadata"]["name"])
        i = next(i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == key)
        docs[i] = _merge(docs[i], patch)
    for g in kust["configMapGenerator"]:
        for f in g["files"]:
            assert (HA / f).is_file(), f
    return docs


def test_kubernetes_overlay_validates_strictly_and_wires_sentinel(tmp_path):
    import sys

    import yaml

    docs = overlay_docs()
    out = tmp_path / "overlay.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    r = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict",
                        "-k", "1.33.0", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    redis_sts = by[("StatefulSet", "remp-redis")]
    assert redis_sts["spec"]["replicas"] == 2
    sentinel = by[("StatefulSet", "remp-sentinel")]
    assert sentinel["spec"]["replicas"] == 3
    for name, prefix in (("remp-controller", "REMP_CONTROLLER"), ("remp-policy", "REMP_POLICY")):
        c = by[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        names = [e["name"] for e in c["env"]]
        env = {e["name"]: e for e in c["env"]}
        url = env[f"{prefix}_REDIS_URL"]["value"]
        assert url.startswith("redis+sentinel://:$(REDIS_PASSWORD)@remp-sentinel-0.")
        assert names.index("REDIS_PASSWORD") < names.index(f"{prefix}_REDIS_URL")
    ctl = by[("Deployment", "remp-controller")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "REMP_CONTROLLER_REDIS_WAIT_REPLICAS", "value": "1"} in ctl["env"]
    dep = by[("Deployment", "remp-controller")]  # controller HA: two, one leads (a lease)
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"] == {"type": "RollingUpdate"}
    names = [e["name"] for e in ctl["env"]]
    assert {"name": "REMP_CONTROLLER_LEADER_LEASE_SECONDS", "value": "3"} in ctl["env"]
    assert names.index("POD_IP") < names.index("REMP_CONTROLLER_ADVERTISE_ADDRESS")
    for sts in (redis_sts, sentinel):  # $(POD_NAME) is defined before it is used
        c = sts["spec"]["template"]["spec"]["containers"][0]
        names = [e["name"] for e in c["env"]]
        for e in c["env"]:
            if "$(POD_NAME)" in e.get("value", ""):
                assert names.index("POD_NAME") < names.index(e["name"])
            if "PASSWORD" in e["name"]:
                assert "value" not in e and e["valueFrom"]["secretKeyRef"]["name"] == "remp-redis"
        assert c["command"][:2] == ["sh", "/ha/redis-start.sh" if sts is redis_sts
                                    else "/ha/sentinel-start.sh"]


def test_compose_ha_override_matches_the_spec_and_parses():
    import sys

    import yaml

    from controller.config import ControllerSettings
    from policy.config import PolicySettings

    path = HA.parent / "docker-compose.ha.yml"
    r = subprocess.run([str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema",
                        "vendor.compose-spec", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    services = yaml.safe_load(path.read_text())["services"]
    assert {"redis", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3", "controller",
            "policy"} <= set(services)
    known = {"REMP_CONTROLLER_" + f.upper() for f in ControllerSettings.model_fields}
    known |= {"REMP_POLICY_" + f.upper() for f in PolicySettings.model_fields}
    for name, svc in services.items():
        for k, v in (svc.get("environment") or {}).items():
            assert not k.startswith("REMP_") or k in known, k
            assert "PASSWORD" not in k or k.endswith("_FILE"), k
        ep = svc.get("entrypoint") or []
        if ep[:2] == ["sh", "-c"]:
            script = ep[2].replace("$$", "$")
            assert subprocess.run(["sh", "-n", "-c", script], timeout=30).returncode == 0
            assert "redis+sentinel://:$(cat /run/remp/redis-password)@sentinel-1:26379" in script
        elif ep:
            assert ep[0] == "sh" and (HA / Path(ep[1]).name).is_file(), ep
