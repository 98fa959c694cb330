"""The remp import connector: a vLLM KV connector that loads a migrated request's KV (part of the
engine plugin, pinned to vLLM 0.32.0).

Cross-host request migration exports a running request's KV from host A as one payload file (per
global layer: the request's blocks × all KV heads, in the engine's per-layer layout) and resubmits
the request on host B as prompt + tokens generated so far, with ``kv_transfer_params =
{"remp_import": <payload path>, "tokens": n}``. Here, on B:

* scheduler side (engine core): ``get_num_new_matched_tokens`` reports those ``n`` tokens (every
  token but the last) as externally computed, so vLLM allocates their blocks and computes only
  the last token — exactly the decode step host A would have run next;
* worker side (every rank): ``start_load_kv`` writes this rank's layers and KV heads of the
  payload into the request's blocks before the forward pass (synchronous).

Requests without ``remp_import`` never touch it: the healthy path costs one dict lookup per new
request. Only the agent's own imports are honoured: ``kv_transfer_params`` also arrive from the
OpenAI API (any HTTP client may send them), so an import must carry the agent's per-process key
and name a file in the agent's private import directory (both from the environment the agent
gives its engine); anything else is an ordinary request. The agent checks every payload (names,
shapes, dtype, sizes, finite values) before it submits the request; the worker checks shapes
again and never lets a payload it cannot load take the engine down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from node_agent.engine_plugin.imports import trusted_import
from node_agent.kv.codec import layer_key, rank_heads

CONNECTOR_NAME = "RempImportConnector"
MODULE_PATH = "node_agent.engine_plugin.connector"
log = logging.getLogger("remp.node_agent.connector")


def kv_transfer_config() -> dict:
    """The ``--kv-transfer-config`` that installs this connector."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": MODULE_PATH,
            "kv_role": "kv_both"}


@dataclass
class _Load:
    request_id: str
    path: str
    tokens: int
    block_ids: list[int]


@dataclass
class RempImportMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


def _params(request) -> dict | None:
    p = getattr(request, "kv_transfer_params", None)
    if not isinstance(p, dict) or "remp_import" not in p:
        return None
    if not trusted_import(p):  # e.g. sent to the OpenAI API: an ordinary request
        return None
    return p


class RempImportConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._pending: dict[str, _Load] = {}  # scheduler side: allocated, load in the next step
        self.loaded: dict[str, int] = {}  # worker side: request id -> tokens loaded (tests)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        p = _params(request)

        if p is None or request.request_id in self._pending:
            return 0, False
        # every token but the last: vLLM computes that one (it needs at least one)
        n = min(int(p["tokens"]), request.num_tokens - 1)
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        p = _params(request)
        if p is None or num_external_tokens <= 0:
            return
        ids = blocks.get_block_ids()[0]
        self._pending[request.request_id] = _Load(request.request_id, p["remp_import"],
                                                  int(p["tokens"]), list(ids))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = RempImportMetadata(list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RempImportMetadata) or not meta.loads:
            return
        from safetensors import safe_open
        from vllm.distributed import parallel_state as ps
        from vllm.model_executor.models.utils import extract_layer_index

        tp_rank = ps.get_tensor_model_parallel_rank()
        for load in meta.loads:
            try:
                self._load_one(load, forward_context, tp_rank, safe_open, extract_layer_index)
            except Exception as exc:  # noqa: BLE001 - a payload never takes the engine down
                # the agent checked it before submitting; this is a bug, not a client's bytes.
                # The request continues without that KV (wrong tokens, not a dead engine).
                log.error("remp import of %s failed: %s: %s", load.request_id,
                          type(exc).__name__, exc)

    def _load_one(self, load: _Load, forward_context, tp_rank: int, safe_open,
                  extract_layer_index) -> None:
        with safe_open(load.path, framework="pt") as f:
            names = set(f.keys())
            for name, layer in forward_context.no_compile_layers.items():
                kv = getattr(layer, "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                    continue
                key = layer_key(extract_layer_index(name))
                if key not in names:
                    raise ValueError(f"payload lacks {key}")
                src = f.get_tensor(key)  # [blocks, all heads, ...]
                heads = kv.shape[1]
                if (src.dim() != kv.dim() or tuple(src.shape[2:]) != tuple(kv.shape[2:])
                        or src.shape[1] < (tp_rank + 1) * heads):
                    raise ValueError(f"{key}: shape {tuple(src.shape)} does not fit the KV "
                                     f"cache {tuple(kv.shape)} at TP rank {tp_rank}")
                part = rank_heads(src, tp_rank, heads)
                nb = min(part.shape[0], len(load.block_ids))
                ids = torch.tensor(load.block_ids[:nb], dtype=torch.long, device=kv.device)
                kv.index_copy_(0, ids, part[:nb].to(device=kv.device, dtype=kv.dtype))
        self.loaded[load.request_id] = load.tokens

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return
