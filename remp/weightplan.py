"""The weight resharding plan (pure): which slices of each new rank's shard already sit on which
old rank, and which bytes must be read from the host store.

The same 2D reasoning as :mod:`remp.kvplan`, applied to vLLM's Llama parameters. Rank
g = s·TP + r of topology TP×PP holds, in vLLM's merged layout:

* layers [s·L/PP, (s+1)·L/PP) (pipeline stage s);
* per layer, the rows of the column-parallel weights that TP rank r owns — ``qkv_proj`` =
  [q heads r·H/TP… | k heads r·K/TP… | v heads …] and ``gate_up_proj`` = [gate rows | up rows] —
  and the matching columns of the row-parallel ``o_proj`` and ``down_proj``; the two RMS norms
  whole (replicated across TP);
* on the first stage the embedding, on the last the final norm and the LM head, both
  vocab-parallel: the vocabulary padded to a multiple of ``vocab_padding`` (vLLM's
  ``pad_vocab_size``, 64) and split evenly, the padding rows zero.

Every shard is a set of :class:`Piece` s: an index range of one checkpoint tensor (HF names) along
its split dimension, placed at an offset of one parameter along the same dimension (the other
dimension is always whole). A new rank's piece is cut wherever an old rank's piece starts or ends,
and each part is copied from an old rank that holds it (itself first), or from the host store when
no reachable old rank does. With every old rank reachable (the ranks of one host, or of one
process) the old shards hold the whole checkpoint between them, so nothing comes from the store —
for a world-size growth onto a woken rank too; the store is read only for what the reachable
ranks lack (a new rank on a host with no old rank, a lost rank: ``reachable``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from remp.topology import Topology, stage_range

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
EMBED, FINAL = "model.embed_tokens.weight", "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class WeightShape:
    """The parts of a Llama config that decide the shards."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    head_size: int | None = None
    vocab_padding: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                     "intermediate_size", "vocab_size", "vocab_padding"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_attention_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def padded_vocab(self) -> int:
        p = self.vocab_padding
        return (self.vocab_size + p - 1) // p * p

    @classmethod
    def from_hf(cls, cfg: dict, dtype: str | None = None) -> "WeightShape":
        return cls(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                   num_attention_heads=cfg["num_attention_heads"],
                   num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                   intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                   dtype=dtype or cfg.get("torch_dtype") or "bfloat16",
                   head_size=cfg.get("head_dim"))

    def hf(self) -> dict:
        """The HF config keys the project's loader (``llama_shard_pieces``) reads."""
        return dict(num_hidden_layers=self.num_layers, hidden_size=self.hidden_size,
                    num_attention_heads=self.num_attention_heads,
                    num_key_value_heads=self.num_kv_heads,
                    intermediate_size=self.intermediate_size, vocab_size=self.vocab_size)

    def checkpoint(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor (HF names) and its shape."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {EMBED: (v, h)}
        for ly in range(self.num_layers):
            p = f"model.layers.{ly}."
            a = p + "self_attn."
            out.update({a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h),
                        a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q),
                        p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                        p + "post_attention_layernorm.weight": (h,)})
        out.update({FINAL: (h,), LM_HEAD: (v, h)})
        return out

    def checkpoint_bytes(self) -> int:
        return sum(_prod(s) for s in self.checkpoint().values()) * self.dtype_bytes


LLAMA2_7B = WeightShape(32, 4096, 32, 32, 11008, 32000)
LLAMA2_13B = WeightShape(40, 5120, 40, 40, 13824, 32000)
LLAMA2_70B = WeightShape(80, 8192, 64, 8, 28672, 32000)
TINY = WeightShape(4, 256, 8, 4, 512, 2048)  # devstack/modelgen.py's defaults


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Piece:
    """Indices [key_start, key_start + length) along ``dim`` of checkpoint tensor ``key`` sit at
    [param_start, param_start + length) along ``dim`` of this rank's parameter ``param``.
    ``dim`` None: a whole 1-D tensor. ``key`` None: vocabulary padding (zeros, no source)."""

    key: str | None
    dim: int | None
    key_start: int
    length: int
    param: str
    param_start: int
    layer: int  # -1: embedding; num_layers: final norm and LM head

    @property
    def end(self) -> int:
        return self.key_start + self.length


def check_topology(shape: WeightShape, topo: Topology) -> None:
    problems = []
    if not 1 <= topo.pp <= shape.num_layers:
        problems.append(f"PP{topo.pp} is more stages than the {shape.num_layers} layers")
    for what, n in (("attention heads", shape.num_attention_heads),
                    ("KV heads", shape.num_kv_heads),
                    ("intermediate size", shape.intermediate_size),
                    ("padded vocabulary", shape.padded_vocab)):
        if n % topo.tp:
            problems.append(f"TP{topo.tp} does not divide the {n} {what}")
    if problems:
        raise ValueError(f"{topo}: " + "; ".join(problems))


def shard(shape: WeightShape, topo: Topology, rank: int
          ) -> tuple[dict[str, tuple[int, ...]], list[Piece]]:
    """Rank ``rank``'s parameters (name → shape, vLLM's merged layout, in load order) and the
    pieces that fill them, padding included."""
    check_topology(shape, topo)
    if not 0 <= rank < topo.world_size:
        raise ValueError(f"rank {rank} is not in {topo}")
    L, h, tp = shape.num_layers, shape.hidden_size, topo.tp
    stage, r = divmod(rank, tp)
    hd = shape.head_dim
    q, kv = shape.num_attention_heads * hd // tp, shape.num_kv_heads * hd // tp
    i, vp = shape.intermediate_size // tp, shape.padded_vocab // tp
    params: dict[str, tuple[int, ...]] = {}
    pieces: list[Piece] = []

    def vocab(name: str, layer: int) -> None:
        params[name] = (vp, h)
        lo, hi = r * vp, (r + 1) * vp
        real = max(0, min(hi, shape.vocab_size) - lo)
        if real:
            pieces.append(Piece(name, 0, lo, real, name, 0, layer))
        if real < vp:
            pieces.append(Piece(None, 0, lo + real, vp - real, name, real, layer))

    if stage == 0:
        vocab(EMBED, -1)
    for ly in stage_range(L, topo.pp, stage):
        pre = f"model.layers.{ly}."
        qkv, o = pre + "self_attn.qkv_proj.weight", pre + "self_attn.o_proj.weight"
        gate_up, down = pre + "mlp.gate_up_proj.weight", pre + "mlp.down_proj.weight"
        params[qkv] = (q + 2 * kv, h)
        pieces += [Piece(pre + "self_attn.q_proj.weight", 0, r * q, q, qkv, 0, ly),
                   Piece(pre + "self_attn.k_proj.weight", 0, r * kv, kv, qkv, q, ly),
                   Piece(pre + "self_attn.v_proj.weight", 0, r * kv, kv, qkv, q + kv, ly)]
        params[o] = (h, q)
        pieces.append(Piece(o, 1, r * q, q, o, 0, ly))
        params[gate_up] = (2 * i, h)
        pieces += [Piece(pre + "mlp.gate_proj.weight", 0, r * i, i, gate_up, 0, ly),
                   Piece(pre + "mlp.up_proj.weight", 0, r * i, i, gate_up, i, ly)]
        params[down] = (h, i)
        pieces.append(Piece(down, 1, r * i, i, down, 0, ly))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            params[pre + norm] = (h,)
            pieces.append(Piece(pre + norm, None, 0, h, pre + norm, 0, ly))
    if stage == topo.pp - 1:
        params[FINAL] = (h,)
        pieces.append(Piece(FINAL, None, 0, h, FINAL, 0, L))
        vocab(LM_HEAD, L)
    return params, pieces


def piece_cross(shape: WeightShape, p: Piece) -> int:
    """Elements per index of the split dimension (the whole other dimension; 1 for 1-D)."""
    return 1 if p.dim is None else shape.hidden_size


@dataclass(frozen=True)
class Move:
    """Indices [dst_start, dst_start + length) along ``dim`` of new rank ``dst``'s parameter
    ``param`` come from old rank ``src``'s parameter ``src_param`` at ``src_start`` (``src`` None:
    from the host store, checkpoint tensor ``key`` at ``key_start``; ``key`` None as well: zero
    fill, the vocabulary padding). ``nbytes``: the bytes it writes."""

    dst: int
    param: str
    dim: int | None
    dst_start: int
    length: int
    src: int | None
    src_param: str | None
    src_start: int
    key: str | None
    key_start: int
    layer: int
    nbytes: int

    @property
    def kind(self) -> str:
        if self.key is None:
            return "zero"
        if self.src is None:
            return "store"
        return "local" if self.src == self.dst else "peer"


@dataclass
class WeightPlan:
    shape: WeightShape
    old: Topology
    new: Topology
    moves: list[Move]
    new_params: dict[int, dict[str, tuple[int, ...]]] = field(repr=False)

    def for_rank(self, dst: int) -> list[Move]:
        return [m for m in self.moves if m.dst == dst]

    def shard_bytes(self, dst: int) -> int:
        return sum(_prod(s) for s in self.new_params[dst].values()) * self.shape.dtype_bytes

    def pair_bytes(self) -> dict[tuple[int | None, int], int]:
        """(old rank or None for the store, new rank) → bytes; local copies are (r, r); zero
        fill is not counted."""
        out: dict[tuple[int | None, int], int] = defaultdict(int)
        for m in self.moves:
            if m.kind != "zero":
                out[(m.src, m.dst)] += m.nbytes
        return dict(out)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {"local": 0, "peer": 0, "store": 0, "zero": 0}
        for m in self.moves:
            out[m.kind] += m.nbytes
        return out

    def receive_bytes(self) -> dict[int, int]:
        """Per new rank: bytes it receives from other ranks and from the store (not local)."""
        out = {r: 0 for r in range(self.new.world_size)}
        for m in self.moves:
            if m.kind in ("peer", "store"):
                out[m.dst] += m.nbytes
        return out

    def send_bytes(self) -> dict[int, int]:
        """Per old rank: bytes it sends to other ranks."""
        out = {r: 0 for r in range(self.old.world_size)}
        for m in self.moves:
            if m.kind == "peer":
                out[m.src] += m.nbytes
        return out

    def store_bytes(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.new.world_size)}
        for m in self.moves:
            if m.kind == "store":
                out[m.dst] += m.nbytes
        return out

    def summary(self) -> dict:
        k, recv, send = self.bytes_by_kind(), self.receive_bytes(), self.send_bytes()
        store = self.store_bytes()
        pairs = {f"{'store' if s is None else s}->{d}": b
                 for (s, d), b in sorted(self.pair_bytes().items(), key=lambda x: (
                     -1 if x[0][0] is None else x[0][0], x[0][1]))}
        return {"old": str(self.old), "new": str(self.new), "moves": len(self.moves),
                "local_bytes": k["local"], "peer_bytes": k["peer"], "store_bytes": k["store"],
                "zero_bytes": k["zero"],
                "new_shard_bytes_max": max(self.shard_bytes(r) for r in range(self.new.world_size)),
                "receive_bytes": recv, "max_receive_bytes": max(recv.values()),
                "send_bytes": send, "max_send_bytes": max(send.values()),
                "store_bytes_per_rank": store, "pair_bytes": pairs}


def same_host(gpus_per_host: int) -> Callable[[int, int], bool]:
    """``reachable`` for ranks placed ``gpus_per_host`` to a host in rank order (old and new rank
    g on host g // gpus_per_host), with no peer copies across hosts."""
    return lambda src, dst: src // gpus_per_host == dst // gpus_per_host


def plan_weights(shape: WeightShape, old: Topology, new: Topology, *,
                 reachable: Callable[[int, int], bool] | None = None) -> WeightPlan:
    """Every move that builds every new rank's shard, layer-major (embedding, layers in order,
    final norm and LM head), new ranks in order within a layer. ``reachable(old_rank, new_rank)``:
    may the old rank send to the new one (default: every old rank, one host); what no reachable old
    rank holds is read from the host store. A part held by several old ranks (the replicated norms)
    comes from the new rank itself when it holds it, else from one picked by the new rank's id
    (spreads the senders)."""
    check_topology(shape, old)
    check_topology(shape, new)
    held: dict[str, list[tuple[int, Piece]]] = defaultdict(list)
    for rank in range(old.world_size):
        for p in shard(shape, old, rank)[1]:
            if p.key is not None:
                held[p.key].append((rank, p))
    bpe = shape.dtype_bytes
    moves: list[Move] = []
    new_params: dict[int, dict[str, tuple[int, ...]]] = {}
    for dst in range(new.world_size):
        params, pieces = shard(shape, new, dst)
        new_params[dst] = params
        for p in pieces:
            cross = piece_cross(shape, p) * bpe
            if p.key is None:
                moves.append(Move(dst, p.param, p.dim, p.param_start, p.length, None, None, 0,
                                  None, p.key_start, p.layer, p.length * cross))
                continue
            olds = [(r, q) for r, q in held[p.key] if q.key_start < p.end and p.key_start < q.end]
            cuts = sorted({p.key_start, p.end, *(c for _, q in olds for c in (q.key_start, q.end)
                                                  if p.key_start < c < p.end)})
            for lo, hi in zip(cuts, cuts[1:]):
                cover = [(r, q) for r, q in olds if q.key_start <= lo and hi <= q.end]
                ok = [(r, q) for r, q in cover if reachable is None or reachable(r, dst)]
                dst_start = p.param_start + lo - p.key_start
                if not ok:
                    m = Move(dst, p.param, p.dim, dst_start, hi - lo, None, None, 0, p.key, lo,
                             p.layer, (hi - lo) * cross)
                else:
                    mine = [x for x in ok if x[0] == dst]
                    r, q = mine[0] if mine else ok[dst % len(ok)]
                    m = Move(dst, p.param, p.dim, dst_start, hi - lo, r, q.param,
                             q.param_start + lo - q.key_start, p.key, lo, p.layer,
                             (hi - lo) * cross)
                if _merge(moves, m) is not None:
                    moves.append(m)
    moves.sort(key=lambda m: (m.layer, m.dst))  # stable: load order within a (layer, rank)
    return WeightPlan(shape, old, new, moves, new_params)


def _merge(moves: list[Move], m: Move) -> Move | None:
    """Fold ``m`` into the previous move when it continues it on both sides (returns None)."""
    if moves:
        a = moves[-1]
        if (a.dst == m.dst and a.param == m.param and a.src == m.src
                and a.src_param == m.src_param and a.key == m.key and a.dim == m.dim
                and a.dst_start + a.length == m.dst_start
                and a.key_start + a.length == m.key_start
                and (a.src is None or a.src_start + a.length == m.src_start)):
            moves[-1] = Move(a.dst, a.param, a.dim, a.dst_start, a.length + m.length, a.src,
                             a.src_param, a.src_start, a.key, a.key_start, a.layer,
                             a.nbytes + m.nbytes)
            return None
    return m


def candidate_pairs(topos: Iterable[Topology]) -> list[tuple[Topology, Topology]]:
    """Every ordered pair of distinct topologies."""
    ts = list(topos)
    return [(a, b) for a in ts for b in ts if a != b]
