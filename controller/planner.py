"""The switch planner (pure, no I/O): is a target valid, who moves what where, how long it takes.

Inputs are plain values the controller already holds for a node (its registration: model shape,
candidates, measured bandwidths, KV pool facts; its history: measured phase seconds). The plan
names every worker-to-worker KV transfer (2D: layers → pipeline stages, KV heads → tensor ranks,
from :func:`remp.kvplan.migration_plan`) and every rank's new weight shard, with byte counts, and
predicts per-phase and total time.
"""

from __future__ import annotations

import functools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from remp.errors import InvalidArgument
from remp.kvplan import RankView, remote_moves
from remp.topology import ModelShape, Topology, format_topologies, topology_problems
from remp.transaction import Phase

# Fixed-cost phases when a node has no measured history yet (seconds, measured on the CPU
# build: bench/results/switch_vs_restart_cpu.json medians rounded up).
DEFAULT_FIXED_PHASE_S = {
    Phase.QUIESCING: 0.03,
    Phase.PREPARING_WORKERS: 0.005,
    Phase.MPU_APPLIED: 0.005,
    Phase.REBINDING: 0.01,
}
DEFAULT_KV_BANDWIDTH_BPS = 1e9  # used only when the agent reported none
DEFAULT_WEIGHT_BANDWIDTH_BPS = 1e9


@dataclass(frozen=True)
class NodeFacts:
    """What the planner needs to know about one node."""

    shape: ModelShape
    devices: int
    candidates: tuple[Topology, ...]
    weight_bytes: int                 # whole model
    kv_bytes_per_block_head: int      # one KV head of one layer for one block (K and V)
    live_blocks: int                  # blocks holding running requests' KV now
    kv_bandwidth_bps: float = 0.0
    weight_bandwidth_bps: float = 0.0


class Transfer(NamedTuple):  # NamedTuple: built ~25× per plan, 4× cheaper than a dataclass
    src_rank: int
    dst_rank: int
    layers: tuple[int, ...]
    kv_head_start: int
    kv_head_end: int
    kv_bytes: int


class ShardLoad(NamedTuple):
    rank: int
    layers: tuple[int, ...]
    tp_rank: int
    tp_size: int
    weight_bytes: int


@dataclass
class Plan:
    source: Topology
    target: Topology
    noop: bool = False
    transfers: list[Transfer] = field(default_factory=list)
    shard_loads: list[ShardLoad] = field(default_factory=list)
    kv_bytes_total: int = 0
    weight_bytes_total: int = 0
    predicted: dict[Phase, float] = field(default_factory=dict)
    predicted_total_s: float = 0.0
    requests_to_preempt: int = 0


def check_target(facts: NodeFacts, current: Topology, target: Topology) -> None:
    """INVALID_ARGUMENT naming the valid targets when ``target`` cannot be switched to."""
    valid = list(facts.candidates)
    problems = topology_problems(target, facts.shape, facts.devices)
    if problems:
        raise InvalidArgument(f"invalid target {target}: {'; '.join(problems)} "
                              f"(valid targets: {format_topologies(valid)})")
    if target not in facts.candidates:
        raise InvalidArgument(f"target {target} is not a candidate of this node "
                              f"(valid targets: {format_topologies(valid)})")


@functools.lru_cache(maxsize=4096)
def _moves(old: Topology, new: Topology, num_layers: int, num_kv_heads: int
           ) -> tuple[tuple[tuple[int, int, int, int], tuple[int, ...]], ...]:
    """Worker-to-worker moves of the 2D plan, grouped by (src, dst, head range) → layers.

    Equal to grouping :func:`remp.kvplan.migration_plan`'s non-local slices (a unit test checks
    it; :func:`remp.kvplan.remote_moves`). Depends only on the shapes, so a fleet of nodes serving
    one model shares the result (cached)."""
    grouped = remote_moves(old, new, num_layers, num_kv_heads)
    return tuple((k, tuple(v)) for k, v in sorted(grouped.items()))


@functools.lru_cache(maxsize=4096)
def _kv_summary(old: Topology, new: Topology, num_layers: int, num_kv_heads: int
                ) -> tuple[tuple[tuple[int, int, int, int, tuple[int, ...], int], ...], int, int]:
    """The moves as (src, dst, head lo, head hi, layers, units), units = layers × heads (bytes
    = units × a node's bytes per block-head × live blocks), plus the busiest rank's units (sent
    or received) and the total: all the plan's KV arithmetic that depends only on the shapes."""
    moves, per_rank_out, per_rank_in = [], defaultdict(int), defaultdict(int)
    for (src, dst, lo, hi), layers in _moves(old, new, num_layers, num_kv_heads):
        units = len(layers) * (hi - lo)
        moves.append((src, dst, lo, hi, layers, units))
        per_rank_out[src] += units
        per_rank_in[dst] += units
    busiest = max([*per_rank_out.values(), *per_rank_in.values(), 0])
    return tuple(moves), busiest, sum(m[5] for m in moves)


def clear_shape_caches() -> None:
    """Forget the per-shape results (the benchmark's cold case: a fleet of different models)."""
    for cached in (_moves, _kv_summary, _shard_layout):
        cached.cache_clear()


@functools.lru_cache(maxsize=4096)
def _shard_layout(target: Topology, num_layers: int, num_kv_heads: int
                  ) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """(rank, layers, tp rank) of every rank of ``target``; depends only on the shapes."""
    view = RankView(target, num_layers, num_kv_heads)
    return tuple((r, tuple(view.layers_of(r)), view.tp_rank_of(r))
                 for r in range(target.world_size))


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def plan_switch(facts: NodeFacts, current: Topology, target: Topology,
                history: dict[Phase, list[float]] | None = None, overlap: bool = True) -> Plan:
    """The whole plan for ``current`` → ``target``; ``history`` holds measured seconds per fixed
    phase from this node's earlier switches (their median replaces the defaults)."""
    check_target(facts, current, target)
    plan = Plan(current, target)
    if target == current:
        plan.noop = True
        return plan
    s = facts.shape
    # KV: group the slices of one (src, dst, head range) over layers; local copies move no bytes
    # between workers and are left out of the transfer list.
    per_block = facts.kv_bytes_per_block_head * facts.live_blocks
    moves, busiest_units, total_units = _kv_summary(current, target, s.num_layers,
                                                    s.num_kv_heads)
    plan.transfers = [Transfer(src, dst, layers, lo, hi, units * per_block)
                      for src, dst, lo, hi, layers, units in moves]
    plan.kv_bytes_total = total_units * per_block
    # Weights: every rank of the target loads its (layers, tp slice) from the host weight store.
    per_layer_rank = facts.weight_bytes / s.num_layers / target.tp
    plan.shard_loads = [ShardLoad(rank, layers, tp_rank, target.tp,
                                  int(per_layer_rank * len(layers)))
                        for rank, layers, tp_rank in _shard_layout(target, s.num_layers,
                                                                   s.num_kv_heads)]
    plan.weight_bytes_total = sum(x.weight_bytes for x in plan.shard_loads)
    # Time: every rank sends/receives concurrently over its own link; the host weight store is
    # one shared source (PCIe / memory bandwidth), so reload time uses the total.
    kv_bw = facts.kv_bandwidth_bps or DEFAULT_KV_BANDWIDTH_BPS
    w_bw = facts.weight_bandwidth_bps or DEFAULT_WEIGHT_BANDWIDTH_BPS
    kv_s = busiest_units * per_block / kv_bw
    reload_s = plan.weight_bytes_total / w_bw
    hist = history or {}
    for ph, default in DEFAULT_FIXED_PHASE_S.items():
        plan.predicted[ph] = _median(hist.get(ph, [])) or default
    plan.predicted[Phase.MIGRATE_KV] = kv_s
    plan.predicted[Phase.RELOAD_SHARDS] = reload_s
    data_path = max(kv_s, reload_s) if overlap else kv_s + reload_s
    plan.predicted_total_s = sum(plan.predicted[p] for p in DEFAULT_FIXED_PHASE_S) + data_path
    return plan
