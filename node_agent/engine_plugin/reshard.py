"""Worker side of peer-to-peer weight resharding (``--weight-reshard p2p``) and of
``--verify-weights``: glue between a vLLM worker's models and the engine-agnostic executor
(:mod:`node_agent.weight_reshard`).

A switch's new model is built as before (``CPUModelRunner`` + ``load_model``); the ``remp_shm``
loader asks :data:`core_side.RESHARD_HOOK` first, which fills the new model's parameters from the
old model's (this rank's and, over a dedicated gloo/NCCL group, its peers'), before vLLM's
post-load processing (packing) runs. Every rank of the world takes part, the ones leaving the
topology as senders only. The ranks first agree (an all-reduce) that each still holds its old
shard whole; if any does not, all of them load from the host store instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from node_agent.kv.transport import TorchDistTransport
from node_agent.weight_store import MappedStore
from node_agent.weight_reshard import check, execute, verify
from remp.topology import Topology
from remp.weightplan import DTYPE_BYTES, WeightShape, plan_weights

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def weight_shape_of(hf_config, dtype: torch.dtype) -> tuple[WeightShape | None, str]:
    """The planner's view of the served model, or None and why p2p cannot reshard it (the
    planner knows vLLM's merged Llama layout without biases or tied embeddings)."""
    cfg = hf_config.to_dict()
    archs = cfg.get("architectures") or []
    name = str(dtype).removeprefix("torch.")
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return None, f"architecture {archs} (p2p knows {', '.join(SUPPORTED_ARCHITECTURES)})"
    if cfg.get("tie_word_embeddings"):
        return None, "tied embeddings"
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        return None, "biases"
    if name not in DTYPE_BYTES:
        return None, f"dtype {name}"
    try:
        return WeightShape.from_hf(cfg, dtype=name), ""
    except (KeyError, ValueError) as exc:
        return None, f"config: {exc}"


class _LazyStore:
    """The host store's checkpoint tensors by name, mapped on first use
    (:class:`~node_agent.weight_store.MappedStore`): a peer-to-peer reshard on one host never
    reads it."""

    def __init__(self, path: str):
        self.path, self._store = path, None

    def tensor(self, key: str) -> torch.Tensor:
        if self._store is None:
            self._store = MappedStore.open(Path(self.path))
        return self._store.tensor(key)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def plain_params(runner) -> dict[str, torch.Tensor] | None:
    model = getattr(runner, "model", None)
    return None if model is None else dict(model.named_parameters())


def reshard(rank: int, shape: WeightShape, old: Topology, new: Topology,
            old_params: dict | None, new_params: dict | None, group, store_path: str
            ) -> dict | None:
    """Build this rank's new shard peer to peer; None when some rank cannot (every rank then
    loads from the store). Collective over ``group``: every rank of the world calls it."""
    plan = plan_weights(shape, old, new)
    mine = old_params if rank < old.world_size else None
    try:
        check(plan, rank, mine, new_params)
        ok = 1
    except ValueError:
        ok = 0
    flag = torch.tensor([ok], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    if not int(flag.item()):
        return None
    store = _LazyStore(store_path)
    try:
        st = execute(plan, rank, mine, new_params, TorchDistTransport(group), store=store.tensor)
    finally:
        store.close()
    return st.as_dict()


def verify_params(rank: int, shape: WeightShape, topo: Topology, params: dict,
                  store_path: str) -> int:
    """``--verify-weights``: this rank's parameters against the store, bit for bit (the store's
    tensors cast to the engine's dtype as vLLM's loader casts them). Raises WeightMismatch."""
    store = _LazyStore(store_path)
    try:
        return verify(shape, topo, rank, params, store.tensor)
    finally:
        store.close()


def env_flag(name: str) -> bool:
    return os.environ.get(name) == "1"
