"""Topology model and its validity rules (pure: no I/O, no vLLM).

A topology is TP x PP for one model replica on one host. It is valid for a model when TP divides
both the attention heads and the KV heads (each rank owns whole KV heads, so the 2D KV migration is
a pure head slice) and every pipeline stage gets at least one layer (PP <= layers), and it fits the
host when TP*PP <= devices.

Stages own consecutive layers laid out as vLLM 0.32 lays them out (:func:`stage_layers`): L // PP
each, and when PP does not divide L the remainder one more each on the stages just before the
last (the last holds the final norm and LM head, the first the embedding). So world 3, 6 and 7
(PP3, TP2PP3, PP7) exist for 32- and 80-layer models too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_TOPO_RE = re.compile(r"^\s*TP\s*(\d+)\s*[xX×]?\s*PP\s*(\d+)\s*$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Topology:
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}PP{self.pp}"

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """Parse ``TP2PP1`` / ``tp2xpp1`` / ``TP2×PP1``."""
        m = _TOPO_RE.match(text)
        if not m:
            raise ValueError(f"invalid topology {text!r}: expected the form TP<n>PP<m>, e.g. TP2PP1")
        return cls(int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model's config that decide which topologies are valid."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    hidden_size: int
    head_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "hidden_size", "head_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")


def topology_problems(topo: Topology, shape: ModelShape, devices: int) -> list[str]:
    """Every reason ``topo`` is not valid for ``shape`` on ``devices`` devices (empty: valid)."""
    problems: list[str] = []
    if topo.tp < 1 or topo.pp < 1:
        return [f"{topo}: TP and PP must be >= 1"]
    if shape.num_attention_heads % topo.tp:
        problems.append(
            f"{topo}: TP={topo.tp} does not divide the {shape.num_attention_heads} attention heads"
        )
    if shape.num_kv_heads % topo.tp:
        problems.append(f"{topo}: TP={topo.tp} does not divide the {shape.num_kv_heads} KV heads")
    if topo.pp > shape.num_layers:
        problems.append(f"{topo}: PP={topo.pp} is more stages than the {shape.num_layers} layers")
    if topo.world_size > devices:
        problems.append(f"{topo}: TP*PP={topo.world_size} is more than the {devices} devices")
    return problems


@lru_cache(maxsize=256)
def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers of each pipeline stage, first to last: vLLM 0.32's ``get_pp_indices`` without
    ``VLLM_PP_LAYER_PARTITION`` (the agent refuses that variable: one fixed partition cannot
    serve every PP a switch may pick). ``L // PP`` each; a remainder ``x`` adds one layer to each
    of the ``x`` stages before the last, counted back from it."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"PP={pp} cannot split {num_layers} layers")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


@lru_cache(maxsize=256)
def stage_starts(num_layers: int, pp: int) -> tuple[int, ...]:
    """First layer of each stage, then ``num_layers``: stage ``s`` owns layers
    ``[starts[s], starts[s + 1])``."""
    out = [0]
    for n in stage_layers(num_layers, pp):
        out.append(out[-1] + n)
    return tuple(out)


def stage_range(num_layers: int, pp: int, stage: int) -> range:
    """The global layers pipeline stage ``stage`` owns."""
    starts = stage_starts(num_layers, pp)
    return range(starts[stage], starts[stage + 1])


def max_stage_layers(num_layers: int, pp: int) -> int:
    """The most layers any stage holds: what bounds a rank's weights and per-block KV."""
    return max(stage_layers(num_layers, pp))


def candidate_topologies(shape: ModelShape, devices: int) -> list[Topology]:
    """All valid topologies for the model on ``devices`` devices, by world size then TP descending."""
    out = [
        Topology(tp, pp)
        for tp in range(1, devices + 1)
        for pp in range(1, devices // tp + 1)
        if not topology_problems(Topology(tp, pp), shape, devices)
    ]
    return sorted(out, key=lambda t: (t.world_size, -t.tp))


def format_topologies(topos: list[Topology]) -> str:
    return ", ".join(str(t) for t in topos) or "(none)"
