"""The ``remp`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remp.cliargs import add_credentials_arg, cli_credentials, invalid_setting


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"remp: error: {message} (see: {self.prog} --help)\n")


def _agent_parser(sub) -> None:
    p = sub.add_parser("agent", help="run a node agent embedding vLLM",
                       description="Run a node agent: vLLM engine + NodeAgent gRPC + OpenAI HTTP API. "
                                   "Arguments after -- go to vLLM unchanged.")
    p.add_argument("--model", required=True, type=Path, help="HuggingFace model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--node", help="node name (default: hostname)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--devices", type=int, help="devices workers may use (CPU default: cores)")
    p.add_argument("--candidates", help="comma-separated candidate topologies, e.g. TP2PP1,TP1PP2")
    p.add_argument("--host")
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--http-port", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--kv-cache-gib", type=float,
                   help="CPU: KV cache space per worker in GiB (default 1; fractions allowed)")
    p.add_argument("--seed", type=int)
    p.add_argument("--served-model-name")
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--weight-store-root", type=Path,
                   help="where the host weight store lives (default /dev/shm)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false", default=None,
                   help="report ready without a warm-up generation")
    p.add_argument("--no-warm-up-candidates", dest="warm_up_candidates", action="store_false",
                   default=None, help="skip visiting every candidate topology before ready "
                   "(the first switch into each then pays its kernels' one-time set-up)")
    p.add_argument("--no-world-changes", dest="world_changes", action="store_false",
                   default=None, help="only candidates of the configured world size (the engine "
                   "then starts just the workers that topology needs; no STANDBY workers)")
    p.add_argument("--request-migration", dest="request_migration", action="store_true",
                   default=None, help="accept and send running requests to other agents "
                   "(installs the remp import KV connector; needed for DrainNode / recovery)")
    p.add_argument("--prefill-table", type=Path,
                   help="measured prefill times (remp profile) for migrate-vs-recompute")
    p.add_argument("--migration-bandwidth-limit", type=float,
                   help="throttle request migrations (bytes/s)")
    p.add_argument("--kv-int8", dest="kv_int8", choices=["off", "on", "auto"],
                   help="INT8 KV for request migrations: off (default), on, or auto (the cost "
                   "model's choice; not token-exact)")
    p.add_argument("--weight-reshard", dest="weight_reshard", choices=["auto", "p2p", "store"],
                   help="build a switch's new weight shards peer to peer (p2p) or from the host "
                   "store (store); auto (default): p2p on GPU, store on CPU")
    p.add_argument("--verify-weights", dest="verify_weights", action="store_true", default=None,
                   help="compare every switch's new shards with the host store before commit")
    p.add_argument("--cache-runners", dest="cache_runners", action="store_true", default=None,
                   help="keep each left topology's model runner (weights, no KV) and reuse it "
                   "when switching back (memory: the weights of every visited topology)")
    p.add_argument("--no-switching", dest="switching", action="store_false", default=None,
                   help="plain vLLM: no switch set-up (no weight store, no prebuilt groups)")
    p.add_argument("--tls-cert", type=Path, help="serve gRPC over TLS with this certificate")
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--tls-client-ca", type=Path,
                   help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--controller", help="controller host:port to register with")
    p.add_argument("--label", dest="labels", action="append", metavar="KEY=VALUE",
                   help="a label registered with the controller (repeatable); a rollout "
                   "can select nodes by label (remp rollout --label KEY=VALUE)")
    p.add_argument("--migration-peers", help="comma-separated host:port of agents this one may "
                   "send requests to besides the controller's registered nodes")
    p.add_argument("--peer-tls-ca", type=Path, help="CA of the target agents' certificates "
                   "(request migration over TLS)")
    p.add_argument("--tls-client-cert", type=Path, help="this agent's client certificate "
                   "towards other agents (mutual TLS; with --tls-client-key)")
    p.add_argument("--tls-client-key", type=Path)
    p.add_argument("--max-engine-restarts", type=int, help="engine deaths restarted in "
                   "process within the window before the agent exits 1 (default 3)")
    p.add_argument("--engine-restart-window-seconds", type=float)
    add_credentials_arg(p, "--controller-token")
    p.add_argument("--heartbeat-seconds", type=float,
                   help="heartbeat period (default: a third of the controller's lease)")
    p.add_argument("--advertise-address", help="host:port the controller reaches this agent at")
    p.add_argument("--worker-spin-seconds", type=float,
                   help="vLLM workers' busy-wait after each message (vLLM: 1 s); 0.02 frees the "
                        "cores between requests on a shared CPU host")
    p.add_argument("extra_vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _credentials_parser(sub) -> None:
    p = sub.add_parser("credentials", help="create or read remp credentials (docs/security.md)")
    csub = p.add_subparsers(dest="credentials_cmd", required=True, parser_class=_Parser)
    c = csub.add_parser("create", help="write fresh random tokens for every role (mode 0600)")
    c.add_argument("file", type=Path)
    c.add_argument("--force", action="store_true", help="replace an existing file (rotation)")
    c.add_argument("--verify-only", nargs="*", default=None, metavar="ROLE",
                   help="also print, per role given, the sha256: digest a server can hold "
                   "instead of the token")
    t = csub.add_parser("token", help="print one role's token (for grpcurl -H / scripts)")
    t.add_argument("role", choices=[r.value for r in _roles()])
    t.add_argument("--credentials-file", type=Path)


def _roles():
    from remp.auth import Role

    return list(Role)


def cmd_credentials(a) -> int:
    from remp.auth import Credentials, Role, digest
    from remp.errors import ConfigError

    if a.credentials_cmd == "create":
        if a.file.exists() and not a.force:
            return fail(f"{a.file} exists (pass --force to replace it: every process must then "
                        "be given the new file)", 1)
        creds = Credentials.generate()
        creds.write(a.file)
        print(f"wrote {a.file} (mode 0600; roles: {', '.join(r.value for r in Role)})")
        for name in a.verify_only or ():
            role = Role(name)
            print(f"{role.value}: sha256:{digest(creds.tokens[role]).hex()}")
        return 0
    try:
        creds = cli_credentials(a.credentials_file)
    except ConfigError as exc:
        return fail(str(exc), 1)
    tok = creds.tokens.get(Role(a.role))
    if not tok:
        return fail(f"no {a.role} token in {creds.source}", 1)
    print(tok)
    return 0


def _make_model_parser(sub) -> None:
    p = sub.add_parser("make-model", help="write the deterministic tiny random Llama")
    p.add_argument("dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)


def _controller_parser(sub) -> None:
    p = sub.add_parser("controller", help="run the controller (gRPC, state in Redis)",
                       description="Run the controller. Without --redis-url it starts a private "
                                   "redis-server (nothing persisted).")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--redis-url", help="redis://[:password@]host:port/db (rediss:// for TLS)")
    p.add_argument("--redis-prefix")
    add_credentials_arg(p)
    p.add_argument("--lease-seconds", type=float)
    p.add_argument("--agent-tls-ca", type=Path)
    p.add_argument("--agent-tls-cert", type=Path)
    p.add_argument("--agent-tls-key", type=Path)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port "
                   "(0: a free one, logged; default: off)")


def _dashboard_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="run the ops dashboard (web page over the controller)",
                       description="Run the ops dashboard: read-only for anyone who can reach "
                                   "it; approving and switching need a login with the operator "
                                   "credential (docs/security.md).")
    p.add_argument("--controller", help="controller host:port (or REMP_DASHBOARD_CONTROLLER)")
    p.add_argument("--policy", help="policy service host:port")
    add_credentials_arg(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="HTTP port (0: a free one, logged; default 8080)")
    p.add_argument("--allowed-hosts", help="comma-separated Host header values the dashboard "
                   "answers (DNS-rebinding guard; default: the bind address, localhost, "
                   "127.0.0.1, [::1], with and without the port)")
    p.add_argument("--cookie-secure", action=argparse.BooleanOptionalAction, default=None,
                   help="mark the session cookie Secure (default: on unless bound to loopback; "
                   "needs HTTPS in front)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="remp", description="live TP x PP topology switching for vLLM")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _agent_parser(sub)
    _controller_parser(sub)
    _make_model_parser(sub)
    _dashboard_parser(sub)
    _credentials_parser(sub)
    from devstack import up
    from ops import prefill
    from ops import commands as ops_cli

    ops_cli.add_parsers(sub)
    from ops import rollout_cli

    rollout_cli.add_parser(sub)
    up.add_parser(sub)
    prefill.add_parser(sub)
    sub.add_parser("policy", help="the policy service: evaluate | serve | ... "
                   "(remp policy --help)", add_help=False)
    return ap


def fail(message: str, code: int = 2) -> int:
    print(f"remp: error: {message}", file=sys.stderr)
    return code


def cmd_make_model(a) -> int:
    from devstack.modelgen import TinyLlamaSpec, make_model

    try:
        spec = TinyLlamaSpec(hidden_size=a.hidden_size, num_layers=a.layers,
                             num_attention_heads=a.heads, num_kv_heads=a.kv_heads,
                             vocab_size=a.vocab, dtype=a.dtype, seed=a.seed)
    except ValueError as exc:
        return fail(str(exc))
    out = make_model(a.dir, spec)
    print(out)
    return 0


def cmd_agent(a) -> int:
    import asyncio

    from pydantic import ValidationError

    from remp import logs
    from remp.errors import ConfigError

    extra = list(a.extra_vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    elif extra:
        return fail(f"unrecognized arguments: {' '.join(extra)} (pass vLLM arguments after --)")
    fields = {k: v for k, v in vars(a).items()
              if v is not None and k not in ("cmd", "extra_vllm_args", "candidates", "_removed")}
    if a.candidates:
        fields["candidates"] = [c for c in a.candidates.split(",") if c.strip()]
    fields["extra_vllm_args"] = extra
    try:
        from node_agent.config import AgentSettings, resolve

        settings = AgentSettings(**fields)
        cfg = resolve(settings)
    except ValidationError as exc:
        return fail(invalid_setting(exc))
    except ConfigError as exc:
        return fail(str(exc))
    try:
        logs.configure(node=settings.node)
    except ValueError as exc:
        return fail(str(exc))
    from node_agent import server

    try:
        return asyncio.run(server.run(cfg))
    except OSError as exc:
        return fail(str(exc), 1)


def _serve(a, settings_cls, node: str, serve) -> int:
    """One service command: its settings from the flags given (the rest from the environment and
    defaults; a bad value is a one-line error, exit 2), logging, then the server's main. A bad
    configuration found at start exits 2; a port, file or start-up failure exits 1."""
    from pydantic import ValidationError

    from remp import logs
    from remp.errors import ConfigError

    fields = {k: v for k, v in vars(a).items() if v is not None and k not in ("cmd", "_removed")}
    try:
        settings = settings_cls(**fields)
    except ValidationError as exc:
        return fail(invalid_setting(exc))
    logs.configure(node=node)
    try:
        return serve(settings)
    except ConfigError as exc:
        return fail(str(exc), 2)
    except (OSError, RuntimeError, TimeoutError) as exc:
        return fail(str(exc), 1)


def cmd_controller(a) -> int:
    from controller import server
    from controller.config import ControllerSettings

    return _serve(a, ControllerSettings, "controller", server.main)


def cmd_dashboard(a) -> int:
    from dashboard import server
    from dashboard.config import DashboardSettings

    return _serve(a, DashboardSettings, "dashboard", server.main)


def cmd_up(a) -> int:
    from devstack import up

    return up.main(a)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["policy"]:  # the policy service owns its sub-commands (ops/policy_cli.py)
        from ops.policy_cli import main as policy_main

        return policy_main(argv[1:])
    a = build_parser().parse_args(argv)
    from ops import prefill, rollout_cli
    from ops import commands as ops_cli

    return {"agent": cmd_agent, "controller": cmd_controller, "make-model": cmd_make_model,
            "dashboard": cmd_dashboard, "up": cmd_up, "profile": prefill.main,
            "credentials": cmd_credentials, "rollout": rollout_cli.cmd_rollout,
            **ops_cli.COMMANDS}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
