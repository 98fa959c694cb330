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
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

CONNECTOR_NAME = "RempImportConnector"
MODULE_PATH = "node_agent.engine_plugin.connector"


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
    return p if isinstance(p, dict) and "remp_import" in p else None


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
            with safe_open(load.path, framework="pt") as f:
                for name, layer in forward_context.no_compile_layers.items():
                    kv = getattr(layer, "kv_cache", None)
                    if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                        continue
                    src = f.get_tensor(f"L{extract_layer_index(name)}")  # [blocks, all heads, ...]
                    heads = kv.shape[1]
                    part = src.narrow(1, tp_rank * heads, heads)
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
