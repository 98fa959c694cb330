"""The 2D migration plan (pure): who owns each (layer, KV head) before and after a switch.

Rank g of topology TP×PP owns layer ℓ and KV head h when g = s·TP + r with s the pipeline stage
whose layers hold ℓ (:func:`remp.topology.stage_layers`, vLLM's layout: L/PP each, uneven when
PP does not divide L) and r = ⌊h / (H/TP)⌋ (tensor rank) — vLLM's rank order.
A switch moves, for every layer, each contiguous head range whose owner changes; ranges whose
owner stays are local copies (same rank, possibly another layer slot or head offset). Slices are
keyed by block id: vLLM block ids are global, identical on every rank.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from remp.topology import Topology, max_stage_layers, stage_range, stage_starts


@dataclass(frozen=True)
class Slice:
    """Heads [head_start, head_end) of global layer ``layer`` go from rank ``src`` to ``dst``."""

    layer: int
    head_start: int
    head_end: int
    src: int
    dst: int

    @property
    def heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclass(frozen=True)
class RankView:
    """Where global (layer, head) live inside one rank of a topology."""

    topo: Topology
    num_layers: int
    num_kv_heads: int

    @property
    def max_layers_per_stage(self) -> int:
        """The most layers a stage holds (stages differ by one when PP does not divide L): a
        rank's share of a block is at most this many layers × its KV heads."""
        return max_stage_layers(self.num_layers, self.topo.pp)

    @property
    def stage_starts(self) -> tuple[int, ...]:
        return stage_starts(self.num_layers, self.topo.pp)

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.topo.tp

    def owner(self, layer: int, head: int) -> int:
        stage = bisect_right(self.stage_starts, layer) - 1
        return stage * self.topo.tp + head // self.heads_per_rank

    def stage_of(self, rank: int) -> int:
        return rank // self.topo.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.topo.tp

    def layers_of(self, rank: int) -> range:
        return stage_range(self.num_layers, self.topo.pp, self.stage_of(rank))

    def heads_of(self, rank: int) -> range:
        r = self.tp_rank_of(rank)
        return range(r * self.heads_per_rank, (r + 1) * self.heads_per_rank)

    def local_head(self, head: int) -> int:
        return head % self.heads_per_rank


def check_shape(topo: Topology, num_layers: int, num_kv_heads: int) -> None:
    if not 1 <= topo.pp <= num_layers or num_kv_heads % topo.tp:
        raise ValueError(f"{topo} cannot split {num_layers} layers × {num_kv_heads} KV heads "
                         "(TP must divide the KV heads, PP be at most the layers)")


def migration_plan(old: Topology, new: Topology, num_layers: int, num_kv_heads: int) -> list[Slice]:
    """Every slice of every layer, layer by layer (layer-major order), local copies included."""
    check_shape(old, num_layers, num_kv_heads)
    check_shape(new, num_layers, num_kv_heads)
    a = RankView(old, num_layers, num_kv_heads)
    b = RankView(new, num_layers, num_kv_heads)
    cuts = _cuts(num_kv_heads, a.heads_per_rank, b.heads_per_rank)
    out: list[Slice] = []
    for layer in range(num_layers):
        for lo, hi in zip(cuts, cuts[1:]):
            out.append(Slice(layer, lo, hi, a.owner(layer, lo), b.owner(layer, lo)))
    return out


def remote_moves(old: Topology, new: Topology, num_layers: int,
                 num_kv_heads: int) -> dict[tuple[int, int, int, int], list[int]]:
    """The plan's worker-to-worker slices grouped by (src, dst, head start, head end) → their
    layers (ascending): equal to grouping :func:`migration_plan`'s non-local slices, but the owners
    are looked up once per run of layers that share both pipeline stages, not per layer (the
    controller plans fleets of nodes with it)."""
    check_shape(old, num_layers, num_kv_heads)
    check_shape(new, num_layers, num_kv_heads)
    a = RankView(old, num_layers, num_kv_heads)
    b = RankView(new, num_layers, num_kv_heads)
    cuts = _cuts(num_kv_heads, a.heads_per_rank, b.heads_per_rank)
    bounds = sorted({*a.stage_starts, *b.stage_starts})
    grouped: dict[tuple[int, int, int, int], list[int]] = {}
    for l0, l1 in zip(bounds, bounds[1:]):
        for lo, hi in zip(cuts, cuts[1:]):
            src, dst = a.owner(l0, lo), b.owner(l0, lo)
            if src != dst:
                grouped.setdefault((src, dst, lo, hi), []).extend(range(l0, l1))
    return grouped


def _cuts(n: int, step_a: int, step_b: int) -> list[int]:
    """0 .. n cut where either topology's split (every ``step_a`` or ``step_b``) starts a part."""
    return sorted({*range(0, n, step_a), *range(0, n, step_b), n})


def layer_order(old: Topology, new: Topology, num_layers: int) -> list[int]:
    """The order layers migrate in: interleaved across pipeline stages so each rank alternates
    between layers it gains and layers it releases — peak extra memory stays about one per-rank
    layer instead of accumulating several new layers before the old ones are released."""
    g = max(1, min(num_layers // old.pp, num_layers // new.pp))
    return sorted(range(num_layers), key=lambda ly: (ly % g, ly))


def slice_bytes(s: Slice, num_blocks: int, bytes_per_block_head: int) -> int:
    return s.heads * num_blocks * bytes_per_block_head


def plan_bytes(plan: list[Slice], num_blocks: int, bytes_per_block_head: int) -> dict[str, int]:
    """Bytes moved between ranks (``remote``) and copied within a rank (``local``)."""
    remote = sum(slice_bytes(s, num_blocks, bytes_per_block_head) for s in plan if not s.local)
    local = sum(slice_bytes(s, num_blocks, bytes_per_block_head) for s in plan if s.local)
    return {"remote": remote, "local": local}


def layer_bytes(num_kv_heads: int, num_blocks: int, bytes_per_block_head: int) -> int:
    """One whole layer's KV (all heads) for ``num_blocks`` blocks."""
    return num_kv_heads * num_blocks * bytes_per_block_head
