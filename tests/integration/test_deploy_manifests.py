"""deploy/ validated with what runs here (no Docker engine, no cluster):

- Kubernetes manifests against the Kubernetes 1.37 JSON schemas, strict (unknown fields fail),
  offline (``kubernetes-validate``); ``kubectl kustomize`` when kubectl is installed;
- docker-compose.yml against the compose-spec schema (``check-jsonschema``'s vendored copy);
- every remp command line in them (container args, health checks) parsed by remp's own CLI
  parsers, every ``REMP_*`` variable a real setting, every profile/port they name existing;
- the Prometheus configs: every scrape target is a port a remp process serves /metrics on;
- the Dockerfile copies only paths that exist and installs extras pyproject.toml declares;
- no secret in them: no Secret object (a re-apply must never overwrite real credentials), no
  secret-looking env value, no token/password/credentialled URL in any args; every remp process
  gets $REMP_CREDENTIALS_FILE (a 0400 copy of the Secret); the Redis start-up script (password on
  stdin) and its probe run against a real redis-server.

What this does not exercise (no engine, no cluster here) is listed in deploy/README.md."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
BIN = Path(sys.executable).parent


def k8s_docs() -> list[dict]:
    return [d for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def containers() -> list[dict]:
    out = []
    for d in k8s_docs():
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            out.append({"doc": d, "pod": spec, "c": c})
    return out


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_kubernetes_manifests_match_the_schemas_strictly():
    r = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", "1.33.0",
                        *map(str, K8S)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in k8s_docs()}
    for want in [("Deployment", "remp-controller"), ("Lease", "remp-controller-leader"),
                 ("DaemonSet", "remp-agent"), ("Deployment", "remp-policy"),
                 ("Deployment", "remp-dashboard"), ("StatefulSet", "remp-redis")]:
        assert want in kinds, want


def test_the_validator_rejects_a_broken_manifest(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((DEPLOY / "k8s" / "dashboard.yaml").read_text().split("---")[1])
    doc["spec"]["replicas"] = "one"
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    bad.write_text(yaml.safe_dump(doc))
    r = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "replicas" in r.stdout + r.stderr


def test_kustomization_lists_every_manifest():
    # (kubectl is not installed here; `kubectl kustomize deploy/k8s` was not run)
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    listed = sorted(kust["resources"])
    on_disk = sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml")
                     if p.name != "kustomization.yaml")
    assert listed == on_disk
    assert all(d.get("kind") and d.get("metadata", {}).get("name") for d in k8s_docs())


def test_agent_daemonset_gpu_nodes_and_shared_memory_weight_store():
    ds = next(d for d in k8s_docs() if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    c = pod["containers"][0]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    dep = next(d for d in k8s_docs() if d["kind"] == "Deployment"
               and d["metadata"]["name"] == "remp-controller")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_compose_file_matches_the_compose_spec():
    r = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                        str(DEPLOY / "docker-compose.yml")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    services = compose()["services"]
    assert {"redis", "controller", "agent", "policy", "dashboard"} <= set(services)
    assert services["agent"]["shm_size"]


def _parse(args: list[str]) -> None:
    """Parse a remp command line with remp's own parsers (SystemExit on an unknown flag)."""
    from ops.policy_cli import _parser as policy_parser
    from ops.cli import build_parser

    args = [re.sub(r"\$\((\w+)\)", r"x\1", a) for a in args]  # k8s $(VAR) expansion
    if args[0] == "policy":
        policy_parser().parse_args(args[1:])
    else:
        build_parser().parse_args(args)


def remp_command_lines() -> list[tuple[str, list[str]]]:
    lines = []
    for x in containers():
        if x["c"]["image"].startswith("remp:"):
            lines.append((x["doc"]["metadata"]["name"], x["c"]["args"]))
    for name, svc in compose()["services"].items():
        if str(svc.get("image", "")).startswith("remp:") or "<<" in svc:
            if "command" in svc:
                lines.append((name, svc["command"]))
            test = svc.get("healthcheck", {}).get("test", [])
            if test[:2] == ["CMD", "remp"]:
                lines.append((f"{name} healthcheck", test[2:]))
    return lines


def test_every_remp_command_line_parses():
    lines = remp_command_lines()
    assert len(lines) >= 8
    for name, args in lines:
        try:
            _parse(args)
        except SystemExit as exc:
            pytest.fail(f"{name}: `remp {' '.join(args)}` does not parse ({exc})")


def test_every_remp_env_var_is_a_setting_and_profiles_exist():
    from controller.config import ControllerSettings
    from dashboard.config import DashboardSettings
    from node_agent.config import AgentSettings
    from policy.config import PolicySettings
    from policy.profiles import BUILTIN_PROFILES

    from remp.auth import ENV_FILE

    known = {"REMP_LOG_FORMAT", "REMP_LOG_LEVEL", ENV_FILE}
    for cls in (ControllerSettings, DashboardSettings, AgentSettings, PolicySettings):
        prefix = cls.model_config["env_prefix"]
        known |= {prefix + f.upper() for f in cls.model_fields}
    envs = [e["name"] for x in containers() for e in x["c"].get("env", [])]
    envs += [k for s in compose()["services"].values() for k in (s.get("environment") or {})]
    remp_envs = [e for e in envs if e.startswith("REMP_")]
    assert remp_envs and not set(remp_envs) - known, set(remp_envs) - known
    for _, args in remp_command_lines():
        if "--profile" in args:
            prof = args[args.index("--profile") + 1]
            ok = prof in BUILTIN_PROFILES or (ROOT / prof.replace("/opt/remp/", "")).is_file()
            assert ok, prof


def _metrics_ports_k8s() -> dict[str, str]:
    out = {}
    for x in containers():
        ann = x["doc"]["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            ports = {str(p["containerPort"]) for p in x["c"]["ports"]}
            assert ann["prometheus.io/port"] in ports, x["doc"]["metadata"]["name"]
            out[x["doc"]["metadata"]["name"]] = ann["prometheus.io/port"]
    return out


def test_prometheus_configs_scrape_what_serves_metrics():
    k8s = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = k8s["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep and "prometheus_io_scrape" in keep[0]["source_labels"][0]
    assert _metrics_ports_k8s() == {"remp-controller": "9151", "remp-agent": "8000",
                                    "remp-policy": "9171"}
    # the agent's port is the OpenAI API one, where vLLM's app serves /metrics
    agent = next(x for x in containers() if x["doc"]["kind"] == "DaemonSet")["c"]["args"]
    assert agent[agent.index("--http-port") + 1] == "8000"

    comp = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-compose.yml").read_text())
    services = compose()["services"]
    for sc in comp["scrape_configs"]:
        for target in sc["static_configs"][0]["targets"]:
            host, port = target.split(":")
            cmd = services[host]["command"]
            flag = "--http-port" if host == "agent" else "--metrics-port"
            assert cmd[cmd.index(flag) + 1] == port, target
    mounted = services["prometheus"]["volumes"][0].split(":")[0]
    assert (DEPLOY / mounted).resolve() == (DEPLOY / "prometheus" / "prometheus-compose.yml")


def test_dockerfile_copies_existing_paths_and_known_extras():
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, re.M):
        for p in src.split():
            assert (ROOT / p).exists(), p
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert re.search(r'pip install "\.\[\$EXTRA\]"', text)
    assert {"cpu", "gpu"} <= set(extras)
    pkgs = [p for p in ("remp", "controller", "node_agent", "policy", "dashboard")]
    for p in pkgs:
        assert f"COPY {p}/ {p}/" in text, p


# ---------------------------------------------------------------------------- secrets

SECRETISH_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|PASSWD|API_KEY", re.I)
# a URL whose password is a literal (not a $(VAR) / $VAR reference)
CREDENTIALLED_URL = re.compile(r"://[^/\s@:]*:(?!\$)[^/\s@]+@")
REMP_CONTAINERS = ("remp-controller", "remp-agent", "remp-policy", "remp-dashboard")


def all_pod_containers() -> list[tuple[str, dict, dict]]:
    out = []
    for d in k8s_docs():
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            out.append((d["metadata"]["name"], pod, c))
    return out


def argv_strings(c: dict) -> list[str]:
    return [str(x) for x in (c.get("command") or []) + (c.get("args") or [])]


def test_no_manifest_carries_a_secret_value_or_a_default():
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert not {"secretGenerator", "configMapGenerator"} & set(kust)
    assert [d["metadata"]["name"] for d in k8s_docs() if d["kind"] == "Secret"] == []
    for path in [*(DEPLOY / "k8s").glob("*.yaml"), DEPLOY / "docker-compose.yml"]:
        text = path.read_text()
        assert "change-me" not in text and "stringData" not in text, path
        assert not CREDENTIALLED_URL.search(text), (path, CREDENTIALLED_URL.search(text))
    for name, _, c in all_pod_containers():
        for e in c.get("env", []):
            if SECRETISH_NAME.search(e["name"]):
                assert "value" not in e and e["valueFrom"]["secretKeyRef"], (name, e)
            if "value" in e and "://" in e["value"]:
                assert not CREDENTIALLED_URL.search(e["value"]), (name, e)
        for a in argv_strings(c):
            assert not re.search(r"--(controller-)?token|--redis-url|--api-key", a), (name, a)
            assert not re.search(r"requirepass\s+(?!\$)", a), (name, a)
    for svc_name, svc in compose()["services"].items():
        for k, v in (svc.get("environment") or {}).items():
            assert not SECRETISH_NAME.search(k), (svc_name, k)
            assert "${" not in str(v), (svc_name, k, v)  # nothing from the caller's shell
        for a in [*(svc.get("entrypoint") or []), *(svc.get("command") or [])]:
            assert not re.search(r"--(controller-)?token|--redis-url|--api-key", str(a)), a
    secrets = compose()["secrets"]
    assert set(secrets) == {"remp-credentials", "redis-password"}
    for s in secrets.values():
        assert set(s) == {"file"} and s["file"].startswith("./secrets/")
    ignore = (DEPLOY / "secrets" / ".gitignore").read_text().split("\n")
    assert "*" in ignore and "!.gitignore" in ignore, "deploy/secrets/ must be git-ignored"


def test_every_remp_pod_reads_its_credentials_from_a_private_copy_of_the_secret():
    seen = set()
    for d in k8s_docs():
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        if d["metadata"]["name"] not in REMP_CONTAINERS or not pod:
            continue
        seen.add(d["metadata"]["name"])
        vols = {v["name"]: v for v in pod["volumes"]}
        secret = vols["credentials-secret"]["secret"]
        assert secret["secretName"] == "remp-credentials" and secret["defaultMode"] == 0o440
        assert vols["credentials"]["emptyDir"]["medium"] == "Memory"
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] and sc["fsGroup"] == sc["runAsUser"] == 10001
        (init,) = pod["initContainers"]
        assert init["command"] == ["install", "-m", "0400", "/secret/credentials.json",
                                   "/run/remp/credentials.json"]
        c = pod["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["REMP_CREDENTIALS_FILE"]["value"] == "/run/remp/credentials.json"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert "credentials-secret" not in mounts  # only the 0400 copy
        assert mounts["credentials"] == {"name": "credentials", "mountPath": "/run/remp",
                                         "readOnly": True}
        assert "--redis-url" not in c["args"]
        prefix = {"remp-controller": "REMP_CONTROLLER", "remp-policy": "REMP_POLICY"}
        if d["metadata"]["name"] in prefix:
            url = env[prefix[d["metadata"]["name"]] + "_REDIS_URL"]["value"]
            assert url == "redis://:$(REDIS_PASSWORD)@remp-redis:6379/0"
            names = [e["name"] for e in c["env"]]
            assert names.index("REDIS_PASSWORD") < names.index(
                prefix[d["metadata"]["name"]] + "_REDIS_URL")  # k8s expands earlier vars only
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
                "name": "remp-redis", "key": "password"}
    assert seen == set(REMP_CONTAINERS)
    services = compose()["services"]
    for name in ("controller", "agent", "policy", "dashboard"):
        svc = services[name]
        assert svc["environment"]["REMP_CREDENTIALS_FILE"] == "/run/remp/credentials.json"
        assert "remp-secrets:/run/remp:ro" in svc["volumes"], name
    init = services["secrets-init"]
    script = init["entrypoint"][2]
    assert "install -o 10001 -g 10001 -m 0400 /run/secrets/remp-credentials " \
           "/run/remp/credentials.json" in script
    assert set(init["secrets"]) == {"remp-credentials", "redis-password"}
    for name in ("controller", "policy"):
        assert "$(cat /run/remp/redis-password)@redis:6379/0" in services[name]["entrypoint"][2]


def _sh_syntax_ok(script: str) -> None:
    r = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, (script, r.stderr)


def test_the_shell_scripts_parse():
    services = compose()["services"]
    for name in ("secrets-init", "controller", "policy"):
        _sh_syntax_ok(services[name]["entrypoint"][2].replace("$$", "$"))
    for _, _, c in all_pod_containers():
        cmd = c.get("command") or []
        if cmd[:2] == ["sh", "-c"]:
            _sh_syntax_ok(cmd[2])


def test_redis_start_script_keeps_the_password_out_of_argv_and_its_probe_works(tmp_path):
    from remp.redisproc import redis_server_binary

    sts = next(d for d in k8s_docs() if d["kind"] == "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["env"][0]["name"] == "REDIS_PASSWORD"
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "remp-redis", "key": "password"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = c["command"][2].replace("--dir /data", f"--dir {tmp_path} --port {port} "
                                     "--bind 127.0.0.1")
    script = script.replace("exec redis-server", f"exec {redis_server_binary()}")
    password = "k8s-test-password-0123456789abcdef"
    env = {**os.environ, "REDIS_PASSWORD": password}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        probe = c["readinessProbe"]["exec"]["command"]
        cli = shutil.which("redis-cli")
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert password not in cmdline and "redis-server" in cmdline  # exec'd, no shell left
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(64).startswith(b"-NOAUTH")
        if cli:
            fixed = [probe[0], probe[1], probe[2].replace("redis-cli", f"{cli} -p {port}")]
            assert subprocess.run(fixed, env=env, capture_output=True, timeout=30).returncode == 0
            wrong = {**env, "REDIS_PASSWORD": "wrong"}
            assert subprocess.run(fixed, env=wrong, capture_output=True,
                                  timeout=30).returncode != 0
    finally:
        proc.terminate()
        proc.wait(10)
