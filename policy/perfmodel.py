"""Performance model of one host serving a dense Llama-shaped model, per TP x PP topology and
world size 1..8, built from measured operator times (pure functions over loaded tables).

Sources, in order of trust:

- **Non-attention operators** (QKV / output projections, gated MLP, norms, RoPE, residual add,
  embedding): Vidur's per-operator medians measured on one H100 80GB for the sharded shapes of
  TP 1, 2, 4, 8 and 1…4096 tokens per step (``policy/perfdata/vidur``, see its PROVENANCE.md).
  Linear interpolation in the token count; above 4096 tokens, the 4096-token time per token.
- **Collectives**: Vidur's NCCL all-reduce (2, 4, 8 workers) and send/recv medians by message size
  on an 8xH100 DGX (NVLink 4 / NVSwitch), log-log interpolation in the size. Two all-reduces per
  layer at TP > 1 (attention output, MLP output) of tokens x hidden x 2 bytes; one send/recv of
  the same size per pipeline hand-off.
- **Attention** (Vidur's public data has none): pluggable ``AttentionSource``.
  ``MeasuredAttention`` reads ``policy/perfdata/h200/attention.csv`` (measured on an H200 for this
  project) when that file exists; until then ``BoundAttention``, a *bound, not a measurement*:
  decode = KV bytes read / (HBM bandwidth x 0.8) + 8 us, prefill = causal FLOPs
  4 * q * kv_mean * heads * head_dim / (989 TFLOP/s x 0.5) + KV bytes / bandwidth + 8 us.
- **LM head** (not in Vidur's table): roofline of the hidden x vocab / TP GEMM (80 % of HBM
  bandwidth, 60 % of peak FLOPs), once per step on the last stage.

**H200 vs H100.** Same Hopper compute (989 TFLOP/s dense BF16) and NVLink 4, so compute-bound
times and collectives are unchanged. HBM3e is 4.8 TB/s vs 3.35 TB/s and 141 GB vs 80 GB. Each
Vidur operator time t is rescaled by its own roofline: t_H200 = t_H100 * max(C, M * 3.35/4.8) /
max(C, M), where C = FLOPs / peak and M = bytes moved / HBM bandwidth of that operator at that
token count and TP (elementwise operators are all memory: factor 0.698; a 1-token 70B MLP GEMM is
weight-bound: 0.698; a 4096-token GEMM is compute-bound: 1.0) -- except a fixed first 12 us of
every kernel (launch, ramp-up, tail), which does not scale (``rescale_kernel_ms``; the measured
attention table is scaled to the H100 the same way). Without that part the model said 0.698 x
for every decode stack; the stacks measured on both GPUs ran 0.73-0.89 x (smaller shards gain
less), and with it the model comes within about 0.01. The KV cache gets the larger memory. This is a
*scaling*, labelled as such in every profile built from it.

**Serving model** (vLLM V1 defaults for 80+ GB GPUs: chunked prefill, ``max_num_batched_tokens``
8192, ``max_num_seqs`` 1024, ``gpu_memory_utilization`` 0.9). Reference request ``I`` tokens in,
``O`` out. At offered load λ, in steady state a pipeline round R (one step of every micro-batch,
pp stages) holds b = λ·O·R decoding sequences and λ·I·R prefill tokens (Little's law); R is the
fixed point of R = pp * stage(b/pp decodes at mean context I + O/2, λ·I·R/pp prefill tokens) +
hand-offs + step overhead. TPOT p50 = R. Capacity (``capacity_rps``) = the largest λ with a fixed
point whose batch fits the token budget, ``max_num_seqs`` and the KV cache. TTFT = the prompt's
chunked prefill (ceil(I / free budget) rounds, each with the prompt's chunk) + half a round
(waiting for the next step) + a queue wait (p50 / p90 quantiles). The queue is M/M/c: c slots,
the requests running at capacity (Little's law: capacity x (O rounds + the prefill) at capacity),
served at the capacity in all; a request waits only when every slot is taken (Erlang C), which
is how a continuous-batching engine queues (its batch takes a new request every step until the
KV cache, the token budget or ``max_num_seqs`` is full). Until 2026-12-07 it was M/M/1 (one
server at the capacity), which made TTFT 4-40x vLLM's on an H100 at 0.5-0.94 x capacity and the
SLO capacity at TP 1 a third of what vLLM served (bench/results/vllm_gpu_vs_model_h100-2026-12-07.md);
p90 uses a p90-length prompt (log-normal lengths, σ 0.8) and TPOT p90 = p50 * exp(1.28 * 0.15).
KV capacity per GPU = 0.9 x memory - weights / (TP*PP) - activation reserve; KV heads are
replicated when TP > KV heads.
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from remp.topology import ModelShape, Topology, candidate_topologies, max_stage_layers

PERFDATA = Path(__file__).resolve().parent / "perfdata"
VIDUR_DIR = PERFDATA / "vidur" / "h100"
H200_ATTENTION_CSV = PERFDATA / "h200" / "attention.csv"
_Z90 = 1.2815515655446004

OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
ELEMENTWISE = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")


# ============================================================================================
# Hardware and model shapes
# ============================================================================================


@dataclass(frozen=True)
class GPUSpec:
    name: str
    mem_bytes: float
    hbm_bytes_s: float
    peak_flops: float = 989e12  # dense BF16, H100 SXM and H200 SXM alike

    @property
    def bw_ratio_to_h100(self) -> float:
        return H100.hbm_bytes_s / self.hbm_bytes_s


# The part of a kernel's time that does not scale with HBM bandwidth (launch, ramp-up, tail):
# when a time measured on one GPU is rescaled to another by a bandwidth factor, only the rest
# scales. Fitted on the measured H100 / H200 pairs (bench/results/gpu_pair_h100_h200-2026-12-07-
# {70b,7b}-stack.md and -2026-12-06-attention.md; docs/policy.md "The performance model"):
# 12 us brings the modelled decode-stack ratios within about 0.01 of the measured ones (scaling the
# whole time missed by up to 0.19) and the cuDNN decode attention pair to a median 3 % (was 10 %).
FIXED_KERNEL_MS = 0.012


def rescale_kernel_ms(t_ms: float, factor: float, fixed_ms: float = FIXED_KERNEL_MS) -> float:
    """A kernel time measured on one GPU, on another where its bandwidth-bound part takes
    ``factor`` x as long: the first ``fixed_ms`` stays, the rest scales."""
    t0 = min(t_ms, fixed_ms)
    return t0 + (t_ms - t0) * factor


H100 = GPUSpec("h100", mem_bytes=80e9, hbm_bytes_s=3.35e12)
H200 = GPUSpec("h200", mem_bytes=141e9, hbm_bytes_s=4.8e12)
GPUS = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    vidur_table: str  # file stem in policy/perfdata/vidur/h100
    head_dim: int = 128
    dtype_bytes: int = 2
    # per-operator scale applied to the Vidur table (1.0: the table's own model); a shape that
    # differs from the measured one is scaled by its GEMM width ratio (labelled "shape-scaled")
    op_scale: tuple[tuple[str, float], ...] = ()

    @property
    def layer_params(self) -> float:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return qkv + o + 3 * self.hidden * self.ffn

    @property
    def params(self) -> float:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    def kv_heads_per_rank(self, tp: int) -> float:
        return max(1.0, self.kv_heads / tp)

    def max_stage_layers(self, pp: int) -> int:
        """The most layers a stage holds (vLLM's layout, ``remp.topology.stage_layers``: stages
        differ by one layer when PP does not divide the layers): the stage that bounds a
        pipeline round, a rank's weights and its KV per token."""
        return max_stage_layers(self.layers, pp)

    def kv_bytes_per_token(self, tp: int, pp: int) -> float:
        """KV bytes one token occupies on the fullest rank (its stage's layers, its heads): block
        ids are global, so that rank bounds every rank's block count."""
        return (self.max_stage_layers(pp) * 2 * self.kv_heads_per_rank(tp) * self.head_dim
                * self.dtype_bytes)


LLAMA2_7B = ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000, "llama2-7b")
LLAMA2_70B = ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000, "llama2-70b")
# Llama-3 shapes, from the Llama-2 H100 tables: 70B has the same layer shape (only the vocab
# differs); 8B = 7B with GQA (8 KV heads: QKV width 6144 vs 12288) and FFN 14336 vs 11008.
LLAMA3_70B = ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, "llama2-70b")
LLAMA3_8B = ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, "llama2-7b", op_scale=(
    ("attn_pre_proj", 6144 / 12288), ("mlp_up_proj", 14336 / 11008), ("mlp_act", 14336 / 11008),
    ("mlp_down_proj", 14336 / 11008)))
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B)}


# ============================================================================================
# Tables
# ============================================================================================


@dataclass(frozen=True)
class OpTable:
    """Vidur per-operator medians: tokens [n], times ms [tp][op] -> [n]."""

    tokens: np.ndarray
    ms: dict[int, dict[str, np.ndarray]]

    def op_ms(self, op: str, tp: int, tokens: float) -> float:
        x, y = self.tokens, self.ms[tp][op]
        if tokens <= x[-1]:
            return float(np.interp(tokens, x, y))
        return float(y[-1] * tokens / x[-1])


@functools.lru_cache(maxsize=8)
def load_op_table(stem: str, root: str = str(VIDUR_DIR)) -> OpTable:
    """A few (TP, tokens) points were profiled twice in Vidur's file; their medians are averaged."""
    with open(Path(root) / f"{stem}_mlp.csv") as f:
        rows = list(csv.DictReader(f))
    tps = sorted({int(r["num_tensor_parallel_workers"]) for r in rows})
    ms: dict[int, dict[str, np.ndarray]] = {}
    tokens = None
    for tp in tps:
        sel = [r for r in rows if int(r["num_tensor_parallel_workers"]) == tp]
        t = np.array(sorted({int(r["num_tokens"]) for r in sel}), dtype=float)
        if tokens is None:
            tokens = t
        elif not np.array_equal(tokens, t):
            raise ValueError(f"{stem}: token grid differs between TP degrees")
        idx = np.searchsorted(t, [int(r["num_tokens"]) for r in sel])
        cnt = np.bincount(idx, minlength=len(t))
        ms[tp] = {op: np.bincount(idx, weights=[float(r[f"{op}_median_ms"]) for r in sel], minlength=len(t)) / cnt
                  for op in OPS + ("emb",)}
    return OpTable(tokens, ms)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CollectiveTable:
    """NCCL medians by (workers) -> (sizes bytes, ms); log-log interpolation, linear beyond."""

    by_workers: dict[int, tuple[np.ndarray, np.ndarray]]

    def ms(self, workers: int, size_bytes: float) -> float:
        if workers <= 1 or size_bytes <= 0:
            return 0.0
        sizes, times = self.by_workers[workers]
        if size_bytes >= sizes[-1]:
            return float(times[-1] * size_bytes / sizes[-1])
        s = max(size_bytes, sizes[0])
        return float(np.exp(np.interp(np.log(s), np.log(sizes), np.log(times))))


@functools.lru_cache(maxsize=4)
def load_collective(name: str, root: str = str(VIDUR_DIR)) -> CollectiveTable:
    with open(Path(root) / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for w in sorted({int(r["num_workers"]) for r in rows}):
        sel = sorted((r for r in rows if int(r["num_workers"]) == w), key=lambda r: int(r["size_bytes"]))
        sizes = np.array([float(r["size_bytes"]) for r in sel])
        times = np.array([float(r["median_ms"]) for r in sel])
        # monotone envelope: a larger message never takes less time (medians are noisy at 2-64 KiB)
        out[w] = (sizes, np.maximum.accumulate(times))
    return CollectiveTable(out)


# ============================================================================================
# Attention sources
# ============================================================================================


class AttentionSource(Protocol):
    """Attention kernel time (ms) on one rank for its per-rank head counts."""

    name: str

    def decode_ms(self, q_heads: float, kv_heads: float, head_dim: int, batch: float, kv_len: float) -> float: ...

    def prefill_ms(self, q_heads: float, kv_heads: float, head_dim: int, q_len: float, kv_len: float) -> float: ...


@dataclass(frozen=True)
class BoundAttention:
    """A bandwidth / FLOP *bound*, not a measurement: decode reads every cached K and V once;
    prefill does 4 * q * mean_kv * heads * head_dim causal FLOPs."""

    gpu: GPUSpec
    bw_eff: float = 0.8
    flop_eff: float = 0.5
    launch_ms: float = 0.008

    @property
    def name(self) -> str:
        return f"bound-{self.gpu.name}"

    def decode_ms(self, q_heads, kv_heads, head_dim, batch, kv_len) -> float:
        if batch <= 0:
            return 0.0
        kv_bytes = batch * kv_len * 2 * kv_heads * head_dim * 2
        return self.launch_ms + kv_bytes / (self.gpu.hbm_bytes_s * self.bw_eff) * 1e3

    def prefill_ms(self, q_heads, kv_heads, head_dim, q_len, kv_len) -> float:
        if q_len <= 0:
            return 0.0
        mean_kv = max(kv_len - q_len / 2, q_len / 2)
        flops = 4 * q_len * mean_kv * q_heads * head_dim
        kv_bytes = kv_len * 2 * kv_heads * head_dim * 2
        return (self.launch_ms + flops / (self.gpu.peak_flops * self.flop_eff) * 1e3
                + kv_bytes / (self.gpu.hbm_bytes_s * self.bw_eff) * 1e3)


class MeasuredAttention:
    """Attention from a measured table (``policy/perfdata/h200/attention.csv`` columns: kind
    (prefill|prefill_chunk|decode|decode_paged), q_heads, kv_heads, head_dim, batch, q_len,
    kv_len, dtype, backend, median_ms, ...). Per (q_heads, kv_heads, head_dim) the medians are
    interpolated (log-log) in the work: KV tokens read (batch x kv_len) for decode, batch x q_len
    x mean kv for prefill; beyond the measured range, proportional to the work. A head count with
    no rows falls back to ``fallback`` scaled by the table's measured/bound ratio for the nearest
    measured head count. Measured on ``measured_on``; used on another GPU, decode (memory-bound)
    scales by the HBM bandwidth ratio beyond its fixed first 12 us (``rescale_kernel_ms``) and
    prefill (compute-bound) is unchanged."""

    # Which measured rows stand for vLLM's kernels (policy/perfdata/h200/PROVENANCE.md): cuDNN
    # for decode and whole prefill (what SDPA picks, and closest to FA3/FlashInfer on Hopper);
    # for chunked prefill torch's flash (cuDNN needs a dense mask there; flash is FA2-class, so
    # pessimistic). The paged-gather rows (an upper bound) and flex / efficient rows are not used.
    ROWS_USED = frozenset({("decode", "cudnn"), ("prefill", "cudnn"), ("prefill_chunk", "flash")})

    def __init__(self, path: Path | str, measured_on: GPUSpec, target: GPUSpec) -> None:
        self.path = Path(path)
        self.measured_on = measured_on
        self.target = target
        self.fallback = BoundAttention(target)
        self.name = f"measured-{measured_on.name}" + (f"-scaled-to-{target.name}" if measured_on != target else "")
        with open(self.path) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            raise ValueError(f"{self.path}: no rows")
        self._curves: dict[tuple[str, float, float, int], tuple[np.ndarray, np.ndarray]] = {}
        groups: dict[tuple[str, float, float, int], list[tuple[float, float]]] = {}
        for r in rows:
            kind = r["kind"].strip()
            if (kind, r.get("backend", "").strip()) not in self.ROWS_USED:
                continue
            fam = "decode" if kind.startswith("decode") else "prefill"
            qh, kh, hd = float(r["q_heads"]), float(r["kv_heads"]), int(float(r["head_dim"]))
            b, q, kv = float(r["batch"]), float(r["q_len"]), float(r["kv_len"])
            work = b * kv if fam == "decode" else b * q * max(kv - q / 2, q / 2)
            groups.setdefault((fam + ":" + kind, qh, kh, hd), []).append((work, float(r["median_ms"])))
        for key, pts in groups.items():
            pts.sort()
            w = np.array([p[0] for p in pts])
            t = np.maximum.accumulate(np.array([p[1] for p in pts]))
            self._curves[key] = (w, t)
        self.kinds = sorted({k[0] for k in self._curves})

    def _lookup(self, fam: str, qh: float, kh: float, hd: int, work: float) -> float | None:
        prefer = {"decode": ("decode:decode",),
                  "prefill": ("prefill:prefill", "prefill:prefill_chunk")}[fam]
        for kind in prefer:
            c = self._curves.get((kind, float(qh), float(kh), hd))
            if c is None:
                continue
            w, t = c
            if work <= w[0]:
                return float(t[0])
            if work >= w[-1]:
                return float(t[-1] * work / w[-1])
            return float(np.exp(np.interp(np.log(work), np.log(w), np.log(t))))
        return None

    def decode_ms(self, q_heads, kv_heads, head_dim, batch, kv_len) -> float:
        if batch <= 0:
            return 0.0
        t = self._lookup("decode", q_heads, kv_heads, head_dim, batch * kv_len)
        if t is None:
            return self.fallback.decode_ms(q_heads, kv_heads, head_dim, batch, kv_len)
        return rescale_kernel_ms(t, self.measured_on.hbm_bytes_s / self.target.hbm_bytes_s)

    def prefill_ms(self, q_heads, kv_heads, head_dim, q_len, kv_len) -> float:
        if q_len <= 0:
            return 0.0
        t = self._lookup("prefill", q_heads, kv_heads, head_dim, q_len * max(kv_len - q_len / 2, q_len / 2))
        return self.fallback.prefill_ms(q_heads, kv_heads, head_dim, q_len, kv_len) if t is None else t


def attention_source(gpu: GPUSpec, path: Path | str | None = None) -> AttentionSource:
    """The measured H200 table when it exists (scaled to ``gpu``), else the bound."""
    p = Path(path) if path is not None else H200_ATTENTION_CSV
    if p.is_file():
        try:
            return MeasuredAttention(p, H200, gpu)
        except (ValueError, KeyError):
            pass
    return BoundAttention(gpu)


# ============================================================================================
# The model
# ============================================================================================


def erlang_c(servers: float, rho: float) -> float:
    """The probability that an arrival waits in an M/M/c queue of c = floor(``servers``) >= 1
    servers at utilisation ``rho`` in [0, 1) (Erlang C; c = 1 gives rho, the M/M/1 case)."""
    c = max(1, int(math.floor(servers)))
    if rho <= 0:
        return 0.0
    rho = min(rho, 0.999999)
    a, b = rho * c, 1.0
    for k in range(1, c + 1):  # Erlang B by its recursion, stable for large c
        b = a * b / (k + a * b)
    return b / (1 - rho * (1 - b))


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 3e9
    step_overhead_ms: float = 1.5  # scheduler, sampling, input preparation per engine step
    pp_step_overhead_ms: float = 0.3  # extra per stage per step at PP > 1
    lm_bw_eff: float = 0.8
    lm_flop_eff: float = 0.6


@dataclass(frozen=True)
class RequestShape:
    input_tokens: int = 1024
    output_tokens: int = 256
    prompt_sigma: float = 0.8
    tpot_sigma: float = 0.15


class PerfModel:
    """Iteration time, TPOT, TTFT, KV capacity and capacity per topology for one model on one GPU
    type. Pure: the tables are inputs."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, attention: AttentionSource | None = None,
                 engine: EngineConfig = EngineConfig(), request: RequestShape = RequestShape(),
                 ops: OpTable | None = None, all_reduce: CollectiveTable | None = None,
                 send_recv: CollectiveTable | None = None) -> None:
        self.m, self.gpu, self.e, self.req = model, gpu, engine, request
        self.attn = attention if attention is not None else attention_source(gpu)
        self.ops = ops or load_op_table(model.vidur_table)
        self.ar = all_reduce or load_collective("all_reduce")
        self.sr = send_recv or load_collective("send_recv")
        self._scale = dict(model.op_scale)

    # ---- one operator, H100 -> this GPU ----
    def _op_roofline(self, op: str, tp: int, n: float) -> tuple[float, float]:
        """(compute s, memory s) on an H100 for one operator at n tokens and TP tp."""
        m, h = self.m, self.m.hidden
        if op in ELEMENTWISE:
            return 0.0, 1.0
        width = {"attn_pre_proj": (m.heads + 2 * m.kv_heads) * m.head_dim,
                 "attn_post_proj": m.heads * m.head_dim,
                 "mlp_up_proj": 2 * m.ffn, "mlp_down_proj": m.ffn}[op] / tp
        w = h * width
        flops = 2 * n * w
        bytes_ = 2 * (w + n * (h + width))
        return flops / H100.peak_flops, bytes_ / H100.hbm_bytes_s

    def op_ms(self, op: str, tp: int, n: float) -> float:
        t = self.ops.op_ms(op, tp, n) * self._scale.get(op, 1.0)
        if self.gpu.hbm_bytes_s == H100.hbm_bytes_s:
            return t
        c, mem = self._op_roofline(op, tp, n)
        return rescale_kernel_ms(t, max(c, mem * self.gpu.bw_ratio_to_h100) / max(c, mem))

    def lm_head_ms(self, tp: int, n: float) -> float:
        w = self.m.vocab * self.m.hidden / tp
        return 1e3 * max(2 * n * w / (self.gpu.peak_flops * self.e.lm_flop_eff),
                         2 * w / (self.gpu.hbm_bytes_s * self.e.lm_bw_eff))

    # ---- one layer, one stage, one round ----
    def layer_ms(self, tp: int, decode_batch: float, ctx: float, prefill_tokens: float,
                 prefill_ctx: float | None = None) -> float:
        """One layer on one TP rank: the Vidur operators at n = decodes + prefill tokens, decode
        and prefill attention for the per-rank heads, two all-reduces."""
        n = decode_batch + prefill_tokens
        if n <= 0:
            return 0.0
        m = self.m
        qh, kh = m.heads / tp, m.kv_heads_per_rank(tp)
        t = sum(self.op_ms(op, tp, n) for op in OPS)
        t += self.attn.decode_ms(qh, kh, m.head_dim, decode_batch, ctx)
        if prefill_tokens > 0:
            t += self.attn.prefill_ms(qh, kh, m.head_dim, prefill_tokens,
                                      prefill_ctx if prefill_ctx is not None else prefill_tokens)
        if tp > 1:
            t += 2 * self.ar.ms(tp, n * m.hidden * m.dtype_bytes)
        return t

    def stage_ms(self, topo: Topology, decode_batch: float, ctx: float, prefill_tokens: float,
                 prefill_ctx: float | None = None) -> float:
        """One engine step of one micro-batch on the slowest pipeline stage (the one with the
        most layers; the last stage's LM head and the first's embedding spread over the round)."""
        n = decode_batch + prefill_tokens
        t = self.m.max_stage_layers(topo.pp) * self.layer_ms(topo.tp, decode_batch, ctx, prefill_tokens,
                                                         prefill_ctx)
        t += self.lm_head_ms(topo.tp, max(decode_batch, 1.0)) / topo.pp  # spread: once per round
        t += self.op_ms_emb(topo.tp, n) / topo.pp
        if topo.pp > 1:
            t += self.sr.ms(2, n * self.m.hidden * self.m.dtype_bytes) + self.e.pp_step_overhead_ms
        return t

    def op_ms_emb(self, tp: int, n: float) -> float:
        return self.ops.op_ms("emb", tp, max(n, 1.0))

    def round_ms(self, topo: Topology, decode_batch: float, prefill_tokens: float,
                 ctx: float | None = None, prefill_ctx: float | None = None) -> float:
        """A pipeline round: every micro-batch one step (pp micro-batches, each b/pp decodes and
        prefill/pp tokens) = pp x stage time + the step overhead. TPOT at this batch."""
        ctx = ctx if ctx is not None else self.req.input_tokens + self.req.output_tokens / 2
        pp = topo.pp
        return (pp * self.stage_ms(topo, decode_batch / pp, ctx, prefill_tokens / pp, prefill_ctx)
                + self.e.step_overhead_ms)

    # ---- memory ----
    def weights_per_rank_bytes(self, topo: Topology) -> float:
        """The fullest rank's weights: its stage's layers and a share of the embedding and LM
        head (``params / world`` when PP divides the layers)."""
        m = self.m
        per_stage = m.max_stage_layers(topo.pp) * m.layer_params + 2 * m.vocab * m.hidden / topo.pp
        return per_stage * m.dtype_bytes / topo.tp

    def kv_tokens(self, topo: Topology) -> float:
        """KV cache capacity in tokens (every rank holds its heads of its stage's layers)."""
        room = (self.gpu.mem_bytes * self.e.gpu_memory_utilization - self.weights_per_rank_bytes(topo)
                - self.e.activation_reserve_bytes)
        if room <= 0:
            return 0.0
        return room / self.m.kv_bytes_per_token(topo.tp, topo.pp)

    def fits(self, topo: Topology) -> bool:
        per_seq = self.req.input_tokens + self.req.output_tokens
        return (self.kv_tokens(topo) >= 4 * per_seq and self.m.heads % topo.tp == 0
                and topo.pp <= self.m.layers and topo.tp in self.ops.ms)

    def max_running(self, topo: Topology) -> float:
        return min(self.e.max_num_seqs, self.kv_tokens(topo) / (self.req.input_tokens + self.req.output_tokens))

    # ---- steady state ----
    def steady_round_ms(self, topo: Topology, rate: float) -> float | None:
        """The fixed point R = round(b = λ·O·R, prefill = λ·I·R) (ms); None above capacity.
        R is bounded by the token budget (b + prefill <= pp * budget), ``max_num_seqs`` and the KV
        cache (b <= max running); f(R) - R falls with R, so the smallest root is found by bisection
        when f(R_max) <= R_max."""
        I, O = self.req.input_tokens, self.req.output_tokens
        R0 = self.round_ms(topo, 0.0, 0.0)
        if rate <= 0:
            return R0
        r_max = min(topo.pp * self.e.max_num_batched_tokens / (rate * (I + O)),
                    self.max_running(topo) / (rate * O)) * 1e3

        def f(R: float) -> float:
            return self.round_ms(topo, rate * O * R / 1e3, rate * I * R / 1e3)

        if r_max <= R0 or f(r_max) > r_max:
            return None
        lo, hi = R0, r_max
        for _ in range(50):
            mid = (lo + hi) / 2
            if f(mid) > mid:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-5 * hi:
                break
        return f(hi)

    @functools.lru_cache(maxsize=None)
    def capacity_rps(self, topo: Topology) -> float:
        if not self.fits(topo):
            return 0.0
        lo, hi = 0.0, 1.0
        while self.steady_round_ms(topo, hi) is not None:
            lo, hi = hi, hi * 2
            if hi > 1e6:
                break
        for _ in range(30):
            mid = (lo + hi) / 2
            if self.steady_round_ms(topo, mid) is None:
                hi = mid
            else:
                lo = mid
        return lo

    def prefill_ms(self, topo: Topology, rate: float, prompt: float, R: float) -> float:
        """Chunked prefill of one prompt at load: ceil(prompt / free budget) rounds, each round
        with the running decodes and the chunk (plus the other prompts' share of prefill)."""
        I, O = self.req.input_tokens, self.req.output_tokens
        b = rate * O * R / 1e3
        p_other = rate * I * R / 1e3
        free = max(self.e.max_num_batched_tokens - b / topo.pp - p_other / topo.pp, 256.0)
        chunks = max(1, math.ceil(prompt / free))
        chunk = prompt / chunks
        t = 0.0
        for k in range(chunks):
            t += self.round_ms(topo, b, p_other + chunk * topo.pp, prefill_ctx=(k + 1) * chunk)
        return t

    @functools.lru_cache(maxsize=None)
    def queue_slots(self, topo: Topology) -> float:
        """The queue's servers: the requests in the engine at capacity (Little's law: capacity x
        the time a request spends in it, its prefill and O rounds), at least 1."""
        cap = self.capacity_rps(topo)
        if cap <= 0:
            return 1.0
        at = 0.999 * cap
        R = self.steady_round_ms(topo, at) or self.steady_round_ms(topo, 0.99 * cap) \
            or self.round_ms(topo, 0.0, 0.0)
        I, O = self.req.input_tokens, self.req.output_tokens
        return max(1.0, cap * (O * R + self.prefill_ms(topo, at, I, R)) / 1e3)

    def queue(self, topo: Topology, rate: float) -> tuple[float, float]:
        """The TTFT queue at offered ``rate``, M/M/c: (the probability a request waits, the rate
        of the waiting time's exponential tail), P(W > t) = busy · exp(-gap · t)."""
        cap = self.capacity_rps(topo)
        rho = min(rate / cap, 0.999) if cap > 0 else 1.0
        return erlang_c(self.queue_slots(topo), rho), cap * (1 - rho)

    def mean_queue_wait_s(self, topo: Topology, rate: float) -> float:
        busy, gap = self.queue(topo, rate)
        return busy / gap

    def point(self, topo: Topology, rate: float) -> tuple[float, float, float, float] | None:
        """(ttft50, ttft90, tpot50, tpot90) in seconds at offered ``rate``; None above capacity."""
        R = self.steady_round_ms(topo, rate)
        if R is None:
            return None
        busy, gap = self.queue(topo, rate)

        def wait(q: float) -> float:
            return math.log(busy / (1 - q)) / gap if busy > 1 - q else 0.0

        I = self.req.input_tokens
        i90 = I * math.exp(_Z90 * self.req.prompt_sigma)
        t50 = (self.prefill_ms(topo, rate, I, R) + R / 2) / 1e3 + wait(0.5)
        t90 = (self.prefill_ms(topo, rate, i90, R) + 0.9 * R) / 1e3 + wait(0.9)
        d50 = R / 1e3
        return t50, t90, d50, d50 * math.exp(_Z90 * self.req.tpot_sigma)

    def switch_downtime_s(self, src: Topology, dst: Topology) -> float:
        """Labelled estimate (not measured on GPUs): 0.4 s of worker / group rebind + the
        destination shard reloaded from host memory at 25 GB/s per GPU (PCIe Gen5, achieved)."""
        if src == dst:
            return 0.0
        return 0.4 + self.weights_per_rank_bytes(dst) / 25e9


VIDUR_TPS = (1, 2, 4, 8)  # the TP degrees Vidur measured


def topologies(spec: ModelSpec, max_world: int = 8) -> tuple[Topology, ...]:
    """The topologies a remp agent on a ``max_world``-GPU host registers for ``spec``
    (``remp.topology.candidate_topologies``: TP divides the heads and KV heads, PP at most the
    layers — stages uneven by one layer where PP does not divide them, as vLLM lays them out —
    world at most the host's; a world that does not divide the host's runs too, its groups laid
    out over the active ranks), limited to the TP degrees Vidur measured. By world size, then TP
    descending: every world 1-8 (3 as PP3, 5 as PP5, 6 as TP2PP3 and PP6, 7 as PP7)."""
    shape = ModelShape(num_layers=spec.layers, num_attention_heads=spec.heads,
                       num_kv_heads=spec.kv_heads, hidden_size=spec.hidden, head_size=spec.head_dim)
    return tuple(t for t in candidate_topologies(shape, max_world) if t.tp in VIDUR_TPS)


# ============================================================================================
# Profiles (the format policy.profiles reads)
# ============================================================================================

DEFAULT_SLO_MS = {"llama2-7b": (1000.0, 50.0), "llama3-8b": (1000.0, 50.0),
                  "llama2-70b": (2000.0, 100.0), "llama3-70b": (2000.0, 100.0)}


def profile_name(gpu: str, model: str) -> str:
    return f"{gpu}x8-{model}"


def build_profile(model: str, gpu: str, attention_csv: Path | str | None = None):
    """A ``policy.profiles.Profile`` for ``model`` on an 8-GPU ``gpu`` host: every topology of
    ``topologies`` (every world size 1-8 an agent on 8 GPUs registers) whose weights and a
    minimal KV cache fit, a load sweep from 0 to 0.995 x capacity, switch downtimes for every
    pair, and the default SLO of the model size."""
    from policy.profile_types import SLO, Profile, TopologyCurve

    spec, g = MODELS[model], GPUS[gpu]
    attn = attention_source(g, attention_csv)
    pm = PerfModel(spec, g, attn)
    curves = []
    fracs = np.concatenate([np.linspace(0.0, 0.9, 31), np.linspace(0.92, 0.995, 6)])
    for topo in topologies(spec, 8):
        if not pm.fits(topo):
            continue
        cap = pm.capacity_rps(topo)
        loads, pts = [], []
        for f in fracs:
            q = pm.point(topo, float(f * cap))
            if q is not None:
                loads.append(float(f * cap))
                pts.append(q)
        curves.append(TopologyCurve(topo, cap, tuple(loads), tuple(q[0] for q in pts),
                                    tuple(q[1] for q in pts), tuple(q[2] for q in pts),
                                    tuple(q[3] for q in pts)))
    topos = [c.topology for c in curves]
    pairs = {(str(a), str(b)): pm.switch_downtime_s(a, b) for a in topos for b in topos if a != b}
    ttft_ms, tpot_ms = DEFAULT_SLO_MS[model]
    scaled = " (shape-scaled from the Llama-2 table)" if spec.op_scale or spec.vidur_table != model else ""
    gpu_note = ("H100: Vidur's measured operator times as they are" if gpu == "h100" else
                "H200: Vidur's H100 operator times rescaled by each operator's roofline for "
                "4.8 vs 3.35 TB/s HBM beyond a fixed 12 us per kernel (same compute, same "
                "NVLink), 141 GB memory")
    return Profile(
        name=profile_name(gpu, model),
        kind="modelled",
        curves=tuple(curves),
        input_tokens=pm.req.input_tokens,
        output_tokens=pm.req.output_tokens,
        switch_downtime_s=max(pairs.values()) if pairs else 0.0,
        default_slo=SLO(ttft_ms / 1e3, tpot_ms / 1e3),
        notes=(f"modelled from measured operator data (policy/perfmodel.py): {spec.name}{scaled} "
               f"on 8x {gpu.upper()}; {gpu_note}; attention: {attn.name}"
               + (" (a bandwidth/FLOP bound, not a measurement)" if attn.name.startswith("bound") else "")
               + "; switch downtime estimated (0.4 s + shard reload at 25 GB/s), not measured"),
        pair_downtime_s=pairs,
        params={"model": spec.name, "gpu": gpu, "attention": attn.name,
                "kv_tokens": {str(t): round(pm.kv_tokens(t)) for t in topos},
                "max_num_batched_tokens": pm.e.max_num_batched_tokens,
                "max_num_seqs": pm.e.max_num_seqs},
    )


BUILTIN = tuple(profile_name(g, m) for g in ("h100", "h200") for m in ("llama2-7b", "llama2-70b", "llama3-8b", "llama3-70b"))
