"""Attention and layer-stack timings on one GPU, for the policy's performance model (issue 16).

    python bench/attention_h200.py --out DIR                  # one H200 (plain torch, no vLLM)
    python bench/attention_h200.py --device cpu --quick --out DIR   # CPU check of the logic, tiny

Vidur's public profiling data (shared/perfdata/vidur) has per-operator H100 times for everything in a
transformer layer except attention. This script measures attention with plain PyTorch
(``torch.nn.functional.scaled_dot_product_attention``, bf16) for the per-rank head counts of
Llama-2-7B/70B and Llama-3-8B/70B at TP 1, 2, 4, 8, plus one real 4-layer Llama-2-7B-shaped stack
to validate a model built from those tables, plus the layer's operators alone (to calibrate
H100 -> H200), plus two reference ceilings (device copy, large bf16 matmul).

Sections, in order (each capped by time; ``--budget-s`` bounds the whole run, and whatever did
not fit is listed under "skipped" in the JSON):
  env        GPU, memory, clocks, torch/CUDA/cuDNN versions, SDPA backends available
  ceilings   1 GiB device-to-device copy; 8192^3 bf16 matmul (random data)
  check      every SDPA backend / variant against a float32 math reference, small shapes
  layer      4 x Llama-2-7B decoder layer (eager and CUDA-graph replay), prefill + decode
  ops        the layer's operators alone (Vidur's names) for TP 1/2/4/8 shards, 7B and 70B
  decode     q_len 1, contiguous KV [B, Hkv, L, D], GQA via enable_gqa (or q-packing)
  prefill    causal self-attention, batch x prompt length
  chunk      chunked prefill: C new tokens over P cached + C (causal aligned lower-right)
  paged      decode over a vLLM-style paged KV pool [blocks, 16, Hkv, D]: block gather + SDPA
  flex       decode over a paged pool read in place by flex_attention (torch.compile), subset

Timing: CUDA events around each call; before each timed call a 256 MiB memset evicts L2 (so KV and
weights come from HBM, as they do in a real forward) and a short device sleep keeps the GPU busy
while the host enqueues the call, so the event interval is GPU time. Warm-up calls first, then
median / p10 / p90 of --reps (>= 20) calls.

Writes DIR/attention_h200.json (or attention_cpu.json), attention.csv, layer_stack.csv and a .md
summary; prints the summary last.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # pragma: no cover - very old torch
    SDPBackend = None
    sdpa_kernel = None

MODELS = {
    # name: (q_heads, kv_heads, hidden, intermediate)
    "Llama-2-7B": (32, 32, 4096, 11008),
    "Llama-2-70B": (64, 8, 8192, 28672),
    "Llama-3-8B": (32, 8, 4096, 14336),
    "Llama-3-70B": (64, 8, 8192, 28672),
}
TPS = (1, 2, 4, 8)
HEAD_DIM = 128

CSV_ATT_COLS = ["kind", "q_heads", "kv_heads", "head_dim", "batch", "q_len", "kv_len", "dtype",
                "backend", "median_ms", "p10_ms", "p90_ms", "reps"]
CSV_LAYER_COLS = ["what", "model", "tp", "phase", "batch", "q_len", "context", "tokens", "shape",
                  "median_ms", "p10_ms", "p90_ms", "reps"]


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------

def per_rank_configs(models=MODELS, tps=TPS):
    """Deduplicated (q_heads, kv_heads) per rank, with the (model, tp) pairs that map to each."""
    out: dict[tuple[int, int], list[str]] = {}
    for name, (hq, hkv, _, _) in models.items():
        for tp in tps:
            key = (hq // tp, max(1, hkv // tp))
            out.setdefault(key, []).append(f"{name}@TP{tp}")
    return out


def flex_subset():
    """(config, batch, context, page): headline shapes first, then page-size probe, then a grid."""
    heads = [(32, 8), (8, 1), (32, 32), (4, 4), (64, 8)]
    out = [(c, 64, 4096, 128) for c in heads]
    out += [((32, 8), 64, 4096, p) for p in (16, 32, 64)]
    for c in [(32, 8), (8, 1), (32, 32)]:
        for b in (1, 16, 64, 256):
            for l in (1024, 4096, 32768):
                if (c, b, l, 128) not in out and 2 * b * c[1] * l * HEAD_DIM * 2 <= 20e9:
                    out.append((c, b, l, 128))
    return out


def sweep_spec(quick: bool):
    if quick:
        return dict(
            configs=[(4, 4), (4, 1)],
            prefill_len=[64, 128], prefill_batch=[1, 2],
            chunk_c=[32, 64], chunk_p=[0, 128],
            decode_b=[1, 4], decode_l=[64, 256],
            layer=dict(hidden=256, heads=4, kv_heads=4, inter=688, layers=2),
            layer_prefill=[(1, 64), (2, 32)], layer_decode=[(1, 64), (4, 128)],
            ops_tokens=[1, 16, 64], ops_models={"tiny": (4, 4, 256, 688)},
            flex_subset=[((4, 1), 4, 256, 64), ((4, 4), 2, 128, 32)],
            copy_bytes=1 << 24, mm=256, kv_cap_bytes=1 << 30,
        )
    return dict(
        configs=None,  # all of per_rank_configs()
        prefill_len=[128, 256, 512, 1024, 2048, 4096, 8192], prefill_batch=[1, 2, 4, 8],
        chunk_c=[256, 512, 1024, 2048], chunk_p=[0, 2048, 8192, 32768],
        decode_b=[1, 4, 16, 64, 128, 256], decode_l=[128, 512, 1024, 2048, 4096, 8192, 32768],
        layer=dict(hidden=4096, heads=32, kv_heads=32, inter=11008, layers=4),
        layer_prefill=[(1, 512), (1, 2048), (4, 512)],
        layer_decode=[(1, 1024), (16, 1024), (64, 1024), (1, 4096), (16, 4096), (64, 4096)],
        ops_tokens=[1, 16, 64, 128, 256, 512, 1024, 2048, 4096],
        ops_models={"Llama-2-7B": MODELS["Llama-2-7B"], "Llama-2-70B": MODELS["Llama-2-70B"]},
        flex_subset=flex_subset(),
        copy_bytes=1 << 30, mm=8192, kv_cap_bytes=40 * 10**9,
    )


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def _pct(xs, p):
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Timer:
    def __init__(self, device: torch.device, reps: int, warmup: int, flush_mib: int = 256,
                 sleep_cycles: int = 40_000):
        self.device = device
        self.cuda = device.type == "cuda"
        self.reps = reps
        self.warmup = warmup
        self.sleep_cycles = sleep_cycles
        self.flush = torch.empty(flush_mib << 20, dtype=torch.int8, device=device) if self.cuda else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn, reps=None, flush=True):
        """Median/p10/p90 (ms) of `reps` calls of fn (after warm-up). Slow calls get fewer reps."""
        reps = reps or self.reps
        t0 = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t0
        warm = self.warmup if first < 0.05 else 1
        for _ in range(warm - 1 if warm > 1 else 0):
            fn()
        self.sync()
        if first > 0.2:
            reps = min(reps, 20)
        times = []
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
            for s, e in ev:
                if flush:
                    self.flush.zero_()
                if self.sleep_cycles:
                    torch.cuda._sleep(self.sleep_cycles)
                s.record()
                fn()
                e.record()
            self.sync()
            times = [s.elapsed_time(e) for s, e in ev]
        else:
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return dict(median_ms=_pct(times, 50), p10_ms=_pct(times, 10), p90_ms=_pct(times, 90),
                    reps=len(times), min_ms=min(times))


class Deadline:
    def __init__(self, total_s: float):
        self.t0 = time.perf_counter()
        self.total = total_s

    def left(self):
        return self.total - (time.perf_counter() - self.t0)

    def section(self, cap_s: float):
        end = time.perf_counter() + min(cap_s, max(0.0, self.left()))
        return lambda: time.perf_counter() < end


# ----------------------------------------------------------------------------------------------
# attention variants
# ----------------------------------------------------------------------------------------------

def backends_for(device):
    if device.type != "cuda" or SDPBackend is None:
        return {"math": SDPBackend.MATH if SDPBackend is not None else None}
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def randn(shape, dtype, device, scale=1.0):
    t = torch.empty(shape, dtype=dtype, device=device)
    t.normal_(0.0, scale)
    return t


def sdpa_gqa_fn(q, k, v, hq, hkv, is_causal=False, attn_mask=None, method="gqa"):
    """Return a closure running SDPA with GQA handled by `method`:
    gqa    enable_gqa=True (kernel broadcasts KV heads)
    qpack  decode only (q_len 1, no mask): q [B,Hq,1,D] viewed as [B,Hkv,Hq/Hkv,D], i.e. the
           group's query heads become query rows of their KV head -- exact for q_len 1
    expand K/V repeated to Hq heads beforehand (outside the timed call)
    """
    if hq == hkv:
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if method == "gqa":
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                      enable_gqa=True)
    if method == "qpack":
        b, _, one, d = q.shape
        assert one == 1 and attn_mask is None and not is_causal
        qp = q.reshape(b, hkv, hq // hkv, d)
        return lambda: F.scaled_dot_product_attention(qp, k, v).reshape(b, hq, 1, d)
    if method == "expand":
        g = hq // hkv
        ke = k.repeat_interleave(g, dim=1)
        ve = v.repeat_interleave(g, dim=1)
        return lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=attn_mask, is_causal=is_causal)
    raise ValueError(method)


def ref_attention(q, k, v, mask=None):
    """float32 math reference; q [B,Hq,S,D], k/v [B,Hkv,L,D]; mask [S,L] bool (True = attend)."""
    hq, hkv = q.shape[1], k.shape[1]
    qf, kf, vf = q.float(), k.float(), v.float()
    if hq != hkv:
        kf = kf.repeat_interleave(hq // hkv, dim=1)
        vf = vf.repeat_interleave(hq // hkv, dim=1)
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ vf


def lower_right_mask(s, l, device):
    """query i (absolute position l - s + i) sees keys 0 .. l - s + i."""
    qi = torch.arange(s, device=device)[:, None]
    kj = torch.arange(l, device=device)[None, :]
    return kj <= qi + (l - s)


def rel_err(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


# paged KV (vLLM flash layout: [num_blocks, block_size, kv_heads, head_dim] per K and per V)

def make_paged(b, l, hkv, d, block, dtype, device, gen=None):
    nb_per = (l + block - 1) // block
    n_blocks = b * nb_per
    kp = randn((n_blocks, block, hkv, d), dtype, device)
    vp = randn((n_blocks, block, hkv, d), dtype, device)
    perm = torch.randperm(n_blocks, device="cpu", generator=gen).to(device)
    table = perm.view(b, nb_per).to(torch.int64)
    return kp, vp, table


def paged_gather_fn(q, kp, vp, table, l, hq, hkv):
    """Gather the blocks of each request into a contiguous [B, L, Hkv, D] view, then SDPA."""
    b = q.shape[0]
    block, d = kp.shape[1], kp.shape[3]

    def fn():
        k = kp[table].view(b, -1, hkv, d)[:, :l].transpose(1, 2)
        v = vp[table].view(b, -1, hkv, d)[:, :l].transpose(1, 2)
        if hq == hkv:
            return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return fn


def paged_reference(q, kp, vp, table, l):
    b, hkv, d = q.shape[0], kp.shape[2], kp.shape[3]
    k = kp[table].view(b, -1, hkv, d)[:, :l].transpose(1, 2)
    v = vp[table].view(b, -1, hkv, d)[:, :l].transpose(1, 2)
    return ref_attention(q, k, v)


class FlexPaged:
    """Decode over a paged pool read in place by flex_attention: the pool is [1, Hkv, pages*page, D]
    (torch's PagedAttention layout); a BlockMask whose KV block = page lists each request's pages
    (its block table) as full blocks, so the kernel reads pages where they lie, no gather."""

    def __init__(self, device, page=128):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        self.BlockMask = BlockMask
        self.page = page
        self.device = device
        import torch._dynamo
        try:
            torch._dynamo.config.cache_size_limit = 64
            torch._dynamo.config.recompile_limit = 64
        except Exception:
            pass
        self.flex = torch.compile(flex_attention, dynamic=False)

    def setup(self, b, l, hq, hkv, d, dtype, gen=None):
        assert l % self.page == 0
        pages_per = l // self.page
        n_pages = b * pages_per
        kpool = randn((1, hkv, n_pages * self.page, d), dtype, self.device)
        vpool = randn((1, hkv, n_pages * self.page, d), dtype, self.device)
        perm = torch.randperm(n_pages, generator=gen).to(self.device)
        table = perm.view(b, pages_per).to(torch.int32)
        q = randn((b, hq, 1, d), dtype, self.device)
        # index tensors as wide as the pool (as torch's PagedAttention builds them): BlockMask
        # densifies them into n_pages columns
        zeros_n = torch.zeros((b, 1, 1), dtype=torch.int32, device=self.device)
        zeros_i = torch.zeros((b, 1, 1, n_pages), dtype=torch.int32, device=self.device)
        full_n = torch.full((b, 1, 1), pages_per, dtype=torch.int32, device=self.device)
        full_i = torch.zeros((b, 1, 1, n_pages), dtype=torch.int32, device=self.device)
        full_i[:, 0, 0, :pages_per] = table
        bm = self.BlockMask.from_kv_blocks(zeros_n, zeros_i, full_n, full_i,
                                           BLOCK_SIZE=(128, self.page),
                                           seq_lengths=(1, n_pages * self.page))
        enable_gqa = hq != hkv

        def fn():
            return self.flex(q, kpool, vpool, block_mask=bm, enable_gqa=enable_gqa)

        def reference():
            idx = (table.to(torch.int64)[:, :, None] * self.page
                   + torch.arange(self.page, device=self.device)).view(b, l)
            k = kpool[0][:, idx].permute(1, 0, 2, 3)  # [B, Hkv, L, D]
            v = vpool[0][:, idx].permute(1, 0, 2, 3)
            return ref_attention(q, k, v)
        return fn, reference


# ----------------------------------------------------------------------------------------------
# Llama layer (for the stack and the operator table)
# ----------------------------------------------------------------------------------------------

def rms_norm(x, w, eps=1e-5):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_tables(max_pos, d, device, dtype, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    t = torch.arange(max_pos, device=device, dtype=torch.float32)
    f = torch.outer(t, inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [..., T, H, D] (neox / HF rotate-half); cos/sin [T, D]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def layer_pre(x, n1, w_qkv, cos, sin, b: int, s: int, hq: int, hkv: int, d: int):
    """Input norm, QKV projection, RoPE on q and k: ([b, s, hq, d], [b, s, hkv, d] x 2)."""
    h = rms_norm(x, n1)
    qkv = F.linear(h, w_qkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = apply_rope(q.view(b, s, hq, d), cos, sin)
    k = apply_rope(k.view(b, s, hkv, d), cos, sin)
    return q, k, v.view(b, s, hkv, d)


def layer_post(x, a, w_o, n2, w_gu, w_down):
    """Output projection + residual, post-attention norm, gated MLP + residual."""
    x = x + F.linear(a, w_o)
    h = rms_norm(x, n2)
    g, u = F.linear(h, w_gu).chunk(2, dim=-1)
    return x + F.linear(F.silu(g) * u, w_down)


def capture_graph(fn):
    """(CUDA graph of one ``fn()`` call, its static output), after two warm-up calls on a side
    stream (allocations and lazy initialisation happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


class LlamaLayer:
    def __init__(self, hidden, heads, kv_heads, inter, dtype, device, head_dim=None):
        d = head_dim or hidden // heads  # a TP shard keeps the head size: heads / TP of them
        self.hidden, self.heads, self.kv_heads, self.d, self.inter = hidden, heads, kv_heads, d, inter
        s = 0.02
        self.w_qkv = randn(((heads + 2 * kv_heads) * d, hidden), dtype, device, s)
        self.w_o = randn((hidden, heads * d), dtype, device, s)
        self.w_gu = randn((2 * inter, hidden), dtype, device, s)
        self.w_down = randn((hidden, inter), dtype, device, s)
        self.n1 = torch.ones(hidden, dtype=dtype, device=device)
        self.n2 = torch.ones(hidden, dtype=dtype, device=device)

    def forward(self, x, b, s, cos, sin, cache=None, ctx=None, pre=layer_pre, post=layer_post):
        """x [b*s, hidden]. Prefill: s tokens per request, causal. Decode (cache given): s == 1,
        the new K/V is written at position ctx of cache (k, v) [b, Hkv, ctx+1, D], attention over
        all ctx+1 positions. ``pre`` / ``post``: the parts before and after attention (eager, or
        compiled by --layer-compile; attention and the cache write stay eager between them, as
        vLLM's piecewise compilation splits at attention)."""
        hq, hkv, d = self.heads, self.kv_heads, self.d
        q, k, v = pre(x, self.n1, self.w_qkv, cos, sin, b, s, hq, hkv, d)
        gqa = dict(enable_gqa=True) if hq != hkv else {}
        if cache is None:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, **gqa)
        else:
            kc, vc = cache
            kc[:, :, ctx] = k[:, 0]
            vc[:, :, ctx] = v[:, 0]
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, **gqa)
        a = a.transpose(1, 2).reshape(b * s, hq * d)
        return post(x, a, self.w_o, self.n2, self.w_gu, self.w_down)


# ----------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------

def _smi(fields):
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip() or r.stderr.strip()
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {e}"


SMI_FIELDS = ("name,memory.total,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
              "power.draw,power.limit,temperature.gpu,pstate,utilization.gpu")


def environment(device):
    env = dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), kernel=platform.release(), python=platform.python_version(),
        torch=torch.__version__, cuda=torch.version.cuda,
        cudnn=(torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
        device=str(device),
    )
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_mem_bytes=p.total_memory, sm_count=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}",
                   l2_bytes=getattr(p, "L2_cache_size", None))
        env["nvidia_smi_fields"] = SMI_FIELDS
        env["nvidia_smi_start"] = _smi(SMI_FIELDS)
        flags = {}
        for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled",
                     "math_sdp_enabled", "is_flash_attention_available"):
            f = getattr(torch.backends.cuda, name, None)
            try:
                flags[name] = f() if f else None
            except Exception as e:  # noqa: BLE001
                flags[name] = f"error: {e}"
        env["sdpa_flags"] = flags
    else:
        env["gpu"] = "cpu"
    return env


def default_choice(q, k, v, is_causal=False, enable_gqa=False):
    """The backend SDPA itself would pick for these inputs (no sdpa_kernel restriction)."""
    try:
        c = torch._fused_sdp_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=is_causal,
                                    scale=None, enable_gqa=enable_gqa)
        try:
            return SDPBackend(c).name
        except Exception:  # noqa: BLE001
            return str(c)
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


# ----------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16
        self.spec = sweep_spec(args.quick)
        self.timer = Timer(self.device, args.reps, args.warmup)
        self.deadline = Deadline(args.budget_s)
        self.att_rows: list[dict] = []
        self.layer_rows: list[dict] = []
        self.result: dict = dict(skipped=[], errors=[], checks=[], default_choice={}, sections={})
        self.backends = backends_for(self.device)
        self.gen = torch.Generator().manual_seed(1234)
        cfgs = per_rank_configs()
        self.configs = self.spec["configs"] or list(cfgs.keys())
        self.config_map = {f"{a}/{b}": v for (a, b), v in cfgs.items()}
        self.working: dict[str, dict] = {}  # kind -> backend -> ok?
        self._compiled = None  # --layer-compile: (compiled layer_pre, compiled layer_post)

    # -- helpers
    def _ctx(self, backend):
        if sdpa_kernel is None or self.backends.get(backend) is None:
            import contextlib
            return contextlib.nullcontext()
        return sdpa_kernel([self.backends[backend]])

    def _free(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _att_row(self, kind, hq, hkv, b, q_len, kv_len, backend, st):
        row = dict(kind=kind, q_heads=hq, kv_heads=hkv, head_dim=HEAD_DIM, batch=b, q_len=q_len,
                   kv_len=kv_len, dtype="bf16", backend=backend,
                   median_ms=round(st["median_ms"], 5), p10_ms=round(st["p10_ms"], 5),
                   p90_ms=round(st["p90_ms"], 5), reps=st["reps"])
        self.att_rows.append(row)
        return row

    def _layer_row(self, what, model, tp, phase, b, q_len, ctx, tokens, shape, st):
        row = dict(what=what, model=model, tp=tp, phase=phase, batch=b, q_len=q_len, context=ctx,
                   tokens=tokens, shape=shape, median_ms=round(st["median_ms"], 5),
                   p10_ms=round(st["p10_ms"], 5), p90_ms=round(st["p90_ms"], 5), reps=st["reps"])
        self.layer_rows.append(row)
        return row

    def _err(self, where, e):
        ls = [x for x in str(e).splitlines() if x.strip()]
        txt = (ls[0][:200] + (" ... " + ls[-1][:200] if len(ls) > 1 else "")) if ls else ""
        msg = f"{where}: {type(e).__name__}: {txt}"
        self.result["errors"].append(msg)
        log("  ERROR", msg)

    # -- env and ceilings
    def env(self):
        self.result["env"] = environment(self.device)
        log(json.dumps(self.result["env"], indent=1))

    def ceilings(self):
        dev, t = self.device, self.timer
        n = self.spec["copy_bytes"] // 2
        src = randn((n,), self.dtype, dev)
        dst = torch.empty_like(src)
        st = t.time(lambda: dst.copy_(src), flush=False)
        nbytes = n * 2
        gbps = nbytes / (st["median_ms"] * 1e-3) / 1e9
        ok = bool(torch.equal(dst, src))
        self.result["ceilings"] = dict(copy_bytes=nbytes, copy_ms=st, copy_gb_s=gbps,
                                       copy_read_plus_write_gb_s=2 * gbps, copy_ok=ok)
        self._layer_row("ref_copy_d2d", "-", 1, "-", 1, 0, 0, 0, f"{nbytes}B", st)
        del src, dst
        m = self.spec["mm"]
        a = randn((m, m), self.dtype, dev)
        b = randn((m, m), self.dtype, dev)
        st = t.time(lambda: a @ b, flush=False)
        tflops = 2 * m ** 3 / (st["median_ms"] * 1e-3) / 1e12
        c = (a[:64].float() @ b.float())
        err = rel_err((a @ b)[:64], c)
        self.result["ceilings"].update(matmul_mnk=m, matmul_ms=st, matmul_tflops=tflops, matmul_rel_err=err)
        self._layer_row("ref_matmul_bf16", "-", 1, "-", 1, 0, 0, m, f"{m}x{m}x{m}", st)
        log(f"ceilings: copy {gbps:.0f} GB/s copied ({2 * gbps:.0f} read+write), ok={ok}; "
            f"matmul {m}^3 {tflops:.0f} TFLOP/s (rel err {err:.1e})")
        del a, b, c
        self._free()

    # -- correctness of every variant, small shapes
    def check(self):
        dev, dt = self.device, self.dtype
        hq, hkv, d = 8, 2, HEAD_DIM
        results = {}

        def rec(name, out, ref):
            e = rel_err(out, ref)
            ok = e == e and e < 2e-2
            self.result["checks"].append(dict(variant=name, rel_err=e, ok=ok))
            results[name] = ok
            log(f"  check {name:28s} rel_err={e:.2e} {'ok' if ok else 'FAIL'}")

        for bk in self.backends:
            # prefill causal
            q, k, v = (randn((2, h, 200, d), dt, dev) for h in (hq, hkv, hkv))
            ref = ref_attention(q, k, v, lower_right_mask(200, 200, dev))
            for method in ("gqa", "expand"):
                try:
                    with self._ctx(bk):
                        out = sdpa_gqa_fn(q, k, v, hq, hkv, is_causal=True, method=method)()
                    rec(f"prefill/{bk}/{method}", out, ref)
                except Exception as e:  # noqa: BLE001
                    results[f"prefill/{bk}/{method}"] = False
                    self.result["checks"].append(dict(variant=f"prefill/{bk}/{method}", error=str(e)[:200]))
            # chunk (lower-right causal)
            q = randn((1, hq, 96, d), dt, dev)
            k, v = (randn((1, hkv, 96 + 300, d), dt, dev) for _ in range(2))
            ref = ref_attention(q, k, v, lower_right_mask(96, 396, dev))
            for method in ("lowerright", "expand", "densemask"):
                try:
                    with self._ctx(bk):
                        out = self._chunk_fn(q, k, v, hq, hkv, method)()
                    rec(f"chunk/{bk}/{method}", out, ref)
                except Exception as e:  # noqa: BLE001
                    results[f"chunk/{bk}/{method}"] = False
                    self.result["checks"].append(dict(variant=f"chunk/{bk}/{method}", error=str(e)[:200]))
            # chunk, MHA shape (efficient runs lower-right natively only without GQA)
            qm = randn((1, 4, 96, d), dt, dev)
            km, vm = (randn((1, 4, 396, d), dt, dev) for _ in range(2))
            refm = ref_attention(qm, km, vm, lower_right_mask(96, 396, dev))
            for method in ("lowerright", "densemask"):
                try:
                    with self._ctx(bk):
                        out = self._chunk_fn(qm, km, vm, 4, 4, method)()
                    rec(f"chunkmha/{bk}/{method}", out, refm)
                except Exception as e:  # noqa: BLE001
                    results[f"chunkmha/{bk}/{method}"] = False
                    self.result["checks"].append(dict(variant=f"chunkmha/{bk}/{method}", error=str(e)[:200]))
            # decode
            q = randn((4, hq, 1, d), dt, dev)
            k, v = (randn((4, hkv, 333, d), dt, dev) for _ in range(2))
            ref = ref_attention(q, k, v)
            for method in ("gqa", "qpack", "expand"):
                try:
                    with self._ctx(bk):
                        out = sdpa_gqa_fn(q, k, v, hq, hkv, method=method)()
                    rec(f"decode/{bk}/{method}", out, ref)
                except Exception as e:  # noqa: BLE001
                    results[f"decode/{bk}/{method}"] = False
                    self.result["checks"].append(dict(variant=f"decode/{bk}/{method}", error=str(e)[:200]))
        # paged gather
        q = randn((3, hq, 1, d), dt, dev)
        kp, vp, table = make_paged(3, 200, hkv, d, 16, dt, dev, self.gen)
        ref = paged_reference(q, kp, vp, table, 200)
        bk0 = next(iter(self.backends))
        for bk in self.backends:
            try:
                with self._ctx(bk):
                    out = paged_gather_fn(q, kp, vp, table, 200, hq, hkv)()
                rec(f"paged_gather/{bk}", out, ref)
            except Exception as e:  # noqa: BLE001
                results[f"paged_gather/{bk}"] = False
                self.result["checks"].append(dict(variant=f"paged_gather/{bk}", error=str(e)[:200]))
        self.check_results = results
        log("check: " + ", ".join(f"{k}={'ok' if v else 'no'}" for k, v in results.items()))
        del bk0
        self._free()

    def _chunk_fn(self, q, k, v, hq, hkv, method):
        c, l = q.shape[2], k.shape[2]
        gqa = dict(enable_gqa=True) if hq != hkv else {}
        if method == "lowerright":
            from torch.nn.attention.bias import causal_lower_right
            bias = causal_lower_right(c, l)
            if c == l:
                return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **gqa)
        if method == "expand":  # K/V repeated to Hq heads beforehand, then native lower-right
            from torch.nn.attention.bias import causal_lower_right
            bias = causal_lower_right(c, l)
            g = hq // hkv
            ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            if c == l:
                return lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
            return lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=bias)
        if method == "densemask":  # explicit boolean mask, built beforehand
            m = lower_right_mask(c, l, q.device)
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **gqa)
        raise ValueError(method)

    def _methods_ok(self, kind, bk, methods):
        return [m for m in methods if self.check_results.get(f"{kind}/{bk}/{m}")]

    # -- decode
    def decode(self, alive):
        dev, dt, sp = self.device, self.dtype, self.spec
        for (hq, hkv) in self.configs:
            for b in sp["decode_b"]:
                for l in sp["decode_l"]:
                    kv_bytes = 2 * b * hkv * l * HEAD_DIM * 2
                    if kv_bytes > sp["kv_cap_bytes"]:
                        self.result["skipped"].append(f"decode {hq}/{hkv} b{b} l{l}: KV {kv_bytes/1e9:.0f} GB > cap")
                        continue
                    if not alive():
                        self.result["skipped"].append(f"decode {hq}/{hkv} b{b} l{l}: time")
                        continue
                    q = randn((b, hq, 1, HEAD_DIM), dt, dev)
                    k = randn((b, hkv, l, HEAD_DIM), dt, dev)
                    v = randn((b, hkv, l, HEAD_DIM), dt, dev)
                    self.result["default_choice"][f"decode {hq}/{hkv} b{b} l{l}"] = default_choice(
                        q, k, v, enable_gqa=hq != hkv)
                    for bk in self.backends:
                        methods = self._methods_ok("decode", bk, ["gqa", "qpack"] if hq != hkv else ["gqa"])
                        if not methods:
                            continue
                        m = methods[0]
                        try:
                            with self._ctx(bk):
                                st = self.timer.time(sdpa_gqa_fn(q, k, v, hq, hkv, method=m))
                            name = bk if (m == "gqa" or hq == hkv) else f"{bk}+{m}"
                            self._att_row("decode", hq, hkv, b, 1, l, name, st)
                        except Exception as e:  # noqa: BLE001
                            self._err(f"decode {hq}/{hkv} b{b} l{l} {bk}", e)
                    del q, k, v
                    if kv_bytes > 4e9:
                        self._free()
            log(f"decode {hq}/{hkv} done ({len(self.att_rows)} rows, {self.deadline.left():.0f}s left)")

    # -- prefill
    def prefill(self, alive):
        dev, dt, sp = self.device, self.dtype, self.spec
        for (hq, hkv) in self.configs:
            for s in sp["prefill_len"]:
                for b in sp["prefill_batch"]:
                    if not alive():
                        self.result["skipped"].append(f"prefill {hq}/{hkv} b{b} s{s}: time")
                        continue
                    q = randn((b, hq, s, HEAD_DIM), dt, dev)
                    k = randn((b, hkv, s, HEAD_DIM), dt, dev)
                    v = randn((b, hkv, s, HEAD_DIM), dt, dev)
                    self.result["default_choice"][f"prefill {hq}/{hkv} b{b} s{s}"] = default_choice(
                        q, k, v, is_causal=True, enable_gqa=hq != hkv)
                    for bk in self.backends:
                        methods = self._methods_ok("prefill", bk, ["gqa", "expand"])
                        if not methods:
                            continue
                        m = methods[0]
                        try:
                            with self._ctx(bk):
                                st = self.timer.time(sdpa_gqa_fn(q, k, v, hq, hkv, is_causal=True, method=m))
                            name = bk if (m == "gqa" or hq == hkv) else f"{bk}+{m}"
                            self._att_row("prefill", hq, hkv, b, s, s, name, st)
                        except Exception as e:  # noqa: BLE001
                            self._err(f"prefill {hq}/{hkv} b{b} s{s} {bk}", e)
                    del q, k, v
            log(f"prefill {hq}/{hkv} done ({len(self.att_rows)} rows, {self.deadline.left():.0f}s left)")
        self._free()

    # -- chunked prefill
    def chunk(self, alive):
        dev, dt, sp = self.device, self.dtype, self.spec
        for (hq, hkv) in self.configs:
            for p in sp["chunk_p"]:
                for c in sp["chunk_c"]:
                    if not alive():
                        self.result["skipped"].append(f"chunk {hq}/{hkv} c{c} p{p}: time")
                        continue
                    l = p + c
                    q = randn((1, hq, c, HEAD_DIM), dt, dev)
                    k = randn((1, hkv, l, HEAD_DIM), dt, dev)
                    v = randn((1, hkv, l, HEAD_DIM), dt, dev)
                    for bk in self.backends:
                        # causal_lower_right runs natively only in flash and efficient; under any
                        # other backend it would materialise a mask inside every call, so those
                        # get the explicit mask built beforehand instead.
                        if bk == "flash":
                            cand = ["lowerright"]
                        elif bk in ("efficient", "math"):
                            cand = ["lowerright"] if hq == hkv else ["expand"]
                        else:
                            cand = ["densemask"]
                        methods = self._methods_ok("chunkmha" if hq == hkv else "chunk", bk, cand)
                        if not methods:
                            continue
                        m = methods[0]
                        try:
                            with self._ctx(bk):
                                st = self.timer.time(self._chunk_fn(q, k, v, hq, hkv, m))
                            name = bk if m == "lowerright" or (m == "expand" and hq == hkv) else f"{bk}+{m}"
                            self._att_row("prefill_chunk", hq, hkv, 1, c, l, name, st)
                        except Exception as e:  # noqa: BLE001
                            self._err(f"chunk {hq}/{hkv} c{c} p{p} {bk}", e)
                    del q, k, v
            log(f"chunk {hq}/{hkv} done ({len(self.att_rows)} rows, {self.deadline.left():.0f}s left)")
        self._free()

    # -- paged decode by block gather + SDPA
    def paged(self, alive):
        dev, dt, sp = self.device, self.dtype, self.spec
        bks = [bk for bk in self.backends if self.check_results.get(f"paged_gather/{bk}")]
        bk = "flash" if "flash" in bks else (bks[0] if bks else None)
        if bk is None:
            self.result["skipped"].append("paged: no backend passed the check")
            return
        for (hq, hkv) in self.configs:
            for b in sp["decode_b"]:
                for l in sp["decode_l"]:
                    kv_bytes = 2 * b * hkv * l * HEAD_DIM * 2
                    if 2 * kv_bytes > sp["kv_cap_bytes"]:  # pool + gathered copy
                        continue
                    if not alive():
                        self.result["skipped"].append(f"paged {hq}/{hkv} b{b} l{l}: time")
                        continue
                    q = randn((b, hq, 1, HEAD_DIM), dt, dev)
                    kp, vp, table = make_paged(b, l, hkv, HEAD_DIM, 16, dt, dev, self.gen)
                    try:
                        with self._ctx(bk):
                            st = self.timer.time(paged_gather_fn(q, kp, vp, table, l, hq, hkv))
                        self._att_row("decode_paged", hq, hkv, b, 1, l, f"gather16+{bk}", st)
                    except Exception as e:  # noqa: BLE001
                        self._err(f"paged {hq}/{hkv} b{b} l{l}", e)
                    del q, kp, vp, table
                    if kv_bytes > 2e9:
                        self._free()
            log(f"paged {hq}/{hkv} done ({len(self.att_rows)} rows, {self.deadline.left():.0f}s left)")
        self._free()

    # -- paged decode through flex_attention (pages read in place), a subset
    def flex(self, alive):
        dev, dt = self.device, self.dtype
        fps = {}
        checked = False
        for (hq, hkv), b, l, page in self.spec["flex_subset"]:
            if not alive() or (self.device.type == "cuda" and self.deadline.left() < 35):
                self.result["skipped"].append(f"flex {hq}/{hkv} b{b} l{l}: time")
                continue
            try:
                if page not in fps:
                    fps[page] = FlexPaged(dev, page=page)
                fp = fps[page]
                t0 = time.perf_counter()
                fn, reference = fp.setup(b, l, hq, hkv, HEAD_DIM, dt, self.gen)
                out = fn()
                self.timer.sync()
                compile_s = time.perf_counter() - t0
                if not checked or b * l <= 64 * 4096:
                    e = rel_err(out, reference())
                    ok = e == e and e < 2e-2
                    self.result["checks"].append(dict(variant=f"flex_paged{page} {hq}/{hkv} b{b} l{l}",
                                                      rel_err=e, ok=ok))
                    log(f"  check flex_paged {hq}/{hkv} b{b} l{l} rel_err={e:.2e} {'ok' if ok else 'FAIL'}")
                    checked = True
                    if not ok:
                        continue
                st = self.timer.time(fn)
                self._att_row("decode_paged", hq, hkv, b, 1, l, f"flex_paged{fp.page}", st)
                self.result.setdefault("flex_compile_s", {})[f"{hq}/{hkv} b{b} l{l} page{page}"] = round(compile_s, 1)
                log(f"  flex {hq}/{hkv} b{b} l{l}: {st['median_ms']*1e3:.1f} us (first call {compile_s:.1f}s)")
            except Exception as e:  # noqa: BLE001
                self._err(f"flex page{page} {hq}/{hkv} b{b} l{l}", e)
            self._free()

    # -- layer stack
    def layer(self, alive):
        """A stack of decoder layers of one TP rank's shard (per --layer-model, --layer-tp,
        --layer-count; the default: 4 x Llama-2-7B at TP 1), for each TP degree in turn."""
        a = self.args
        if a.quick or not a.layer_model:
            L = dict(self.spec["layer"])
            model = "Llama-2-7B" if not a.quick else "tiny"
        else:
            hq, hkv, hid, inter = MODELS[a.layer_model]
            L = dict(hidden=hid, heads=hq, kv_heads=hkv, inter=inter, layers=4)
            model = a.layer_model
        if a.layer_count:
            L["layers"] = a.layer_count
        # a TP shard keeps the head size (heads / TP of them); the quick sizes have their own
        L["head_dim"] = HEAD_DIM if not a.quick else L["hidden"] // L["heads"]
        self.result["layer_config"] = dict(model=model, **L, tps=a.layer_tp, dtype="bf16",
                                           note="random weights; eager torch ops (F.rms_norm, F.linear, "
                                                "rotate-half RoPE, SDPA default backend, silu*mul); "
                                                "one TP rank's shard: heads, KV heads (at least 1) and "
                                                "the MLP width divided by TP, no all-reduce"
                                                + ("; layer_stack_compiled: norm/QKV/RoPE and "
                                                   "out-proj/norm/MLP torch.compile'd (dynamic), "
                                                   "attention eager, one CUDA graph"
                                                   if a.layer_compile else ""))
        for tp in (int(x) for x in str(a.layer_tp).split(",")):
            shard = dict(L, heads=L["heads"] // tp, kv_heads=max(1, L["kv_heads"] // tp),
                         inter=L["inter"] // tp)
            self._layer_stack(alive, model, tp, shard)

    def _layer_stack(self, alive, model, tp, L):
        dev, dt, sp = self.device, self.dtype, self.spec
        hid, hq, hkv, inter, nl = L["hidden"], L["heads"], L["kv_heads"], L["inter"], L["layers"]
        d = L["head_dim"]
        torch.manual_seed(0)
        layers = [LlamaLayer(hid, hq, hkv, inter, dt, dev, head_dim=d) for _ in range(nl)]
        max_pos = max([s for _, s in sp["layer_prefill"]] + [c + 1 for _, c in sp["layer_decode"]])
        cos_all, sin_all = rope_tables(max_pos, d, dev, dt)
        cases = [("prefill", b, s, None) for b, s in sp["layer_prefill"]] + \
                [("decode", b, 1, c) for b, c in sp["layer_decode"]]
        for phase, b, s, ctx in cases:
            if not alive():
                self.result["skipped"].append(f"layer {phase} b{b} s{s} ctx{ctx}: time")
                continue
            try:
                x = randn((b * s, hid), dt, dev)
                if phase == "prefill":
                    cos, sin = cos_all[:s], sin_all[:s]
                    caches = [None] * nl
                else:
                    cos, sin = cos_all[ctx:ctx + 1], sin_all[ctx:ctx + 1]
                    caches = [(randn((b, hkv, ctx + 1, d), dt, dev), randn((b, hkv, ctx + 1, d), dt, dev))
                              for _ in range(nl)]

                def fwd():
                    y = x
                    for lay, cch in zip(layers, caches):
                        y = lay.forward(y, b, s, cos, sin, cch, ctx)
                    return y
                tokens = b * s
                shape = f"{nl}x[h{hid},q{hq},kv{hkv},i{inter}]"
                st = self.timer.time(fwd)
                case = f"tp{tp} {phase} b{b} s{s} ctx{ctx}"  # key of this case's extra figures
                self._layer_row("layer_stack_eager", model, tp, phase, b, s, ctx or s, tokens, shape, st)
                msg = f"layer {model} {case}: eager {st['median_ms']:.3f} ms"
                if self.device.type == "cuda":
                    # host time of one eager forward (launch-bound or not)
                    t0 = time.perf_counter()
                    for _ in range(5):
                        fwd()
                    self.timer.sync()
                    host_ms = (time.perf_counter() - t0) / 5 * 1e3
                    self.result.setdefault("layer_eager_wall_ms", {})[case] = host_ms
                    try:
                        g, out_static = capture_graph(fwd)
                        g.replay()
                        self.timer.sync()
                        ref = fwd()
                        self.timer.sync()
                        gerr = rel_err(out_static, ref.float())
                        stg = self.timer.time(g.replay)
                        self._layer_row("layer_stack_graph", model, tp, phase, b, s, ctx or s, tokens, shape, stg)
                        self.result.setdefault("layer_graph_check", {})[case] = gerr
                        msg += f", graph {stg['median_ms']:.3f} ms (graph vs eager rel err {gerr:.1e})"
                        del g, out_static
                    except Exception as e:  # noqa: BLE001
                        self._err(f"layer graph {phase} b{b} s{s}", e)
                    # per-layer attention alone at this shape, same backend choice
                    if phase == "prefill":
                        qq = randn((b, hq, s, d), dt, dev)
                        kk, vv = randn((b, hkv, s, d), dt, dev), randn((b, hkv, s, d), dt, dev)
                        sta = self.timer.time(lambda: F.scaled_dot_product_attention(
                            qq, kk, vv, is_causal=True, enable_gqa=hq != hkv))
                        self.result["default_choice"][f"layer {case}"] = default_choice(
                            qq, kk, vv, True, enable_gqa=hq != hkv)
                    else:
                        qq = randn((b, hq, 1, d), dt, dev)
                        kk, vv = caches[0]
                        sta = self.timer.time(lambda: F.scaled_dot_product_attention(
                            qq, kk, vv, enable_gqa=hq != hkv))
                        self.result["default_choice"][f"layer {case}"] = default_choice(
                            qq, kk, vv, enable_gqa=hq != hkv)
                    self._layer_row("layer_attention_default", model, tp, phase, b, s, (ctx + 1) if ctx else s,
                                    tokens, f"q{hq},kv{hkv},d{d}", sta)
                    msg += f"; attention alone {sta['median_ms']:.3f} ms/layer; eager host {host_ms:.3f} ms"
                if self.args.layer_compile:
                    msg += self._compiled_stack(model, tp, phase, b, s, ctx, tokens, shape, case,
                                                layers, caches, x, cos, sin, fwd)
                log(msg)
                del x, caches
            except Exception as e:  # noqa: BLE001
                self._err(f"layer {phase} b{b} s{s}", e)
            self._free()
        del layers
        self._free()

    def _compiled_stack(self, model, tp, phase, b, s, ctx, tokens, shape, case, layers, caches, x,
                        cos, sin, fwd):
        """--layer-compile: the same stack with the parts before and after attention compiled by
        torch.compile (inductor: norm + residual, RoPE and SiLU x mul fused into Triton kernels;
        GEMMs stay cuBLAS), attention and the KV write eager between them (vLLM's piecewise
        compilation splits there too), the whole stack then captured in one CUDA graph. A proxy
        for vLLM's fused kernels; not vLLM. Row ``layer_stack_compiled``."""
        if self._compiled is None:
            import torch._dynamo as dynamo  # binds `dynamo` only (a bare import would shadow torch)
            dynamo.config.cache_size_limit = max(64, dynamo.config.cache_size_limit)
            self._compiled = (torch.compile(layer_pre, dynamic=True), torch.compile(layer_post, dynamic=True))
        cpre, cpost = self._compiled

        def cfwd():
            y = x
            for lay, cch in zip(layers, caches):
                y = lay.forward(y, b, s, cos, sin, cch, ctx, pre=cpre, post=cpost)
            return y
        try:
            t0 = time.perf_counter()
            out = cfwd()  # compiles (once per shape family), outside any capture
            self.timer.sync()
            compile_s = time.perf_counter() - t0
            ref = fwd()
            self.timer.sync()
            err = rel_err(out, ref.float())
            if self.device.type == "cuda":
                g, _ = capture_graph(cfwd)
                st = self.timer.time(g.replay)
                del g
            else:
                st = self.timer.time(cfwd)
            self._layer_row("layer_stack_compiled", model, tp, phase, b, s, ctx or s, tokens, shape, st)
            self.result.setdefault("layer_compiled_check", {})[case] = dict(
                rel_err_vs_eager=err, first_call_s=round(compile_s, 3))
            return f"; compiled {st['median_ms']:.3f} ms (vs eager rel err {err:.1e}, first call {compile_s:.1f} s)"
        except Exception as e:  # noqa: BLE001
            self._err(f"layer compiled {phase} b{b} s{s}", e)
            return "; compiled: failed"

    # -- operators alone (Vidur's names), TP shards
    def ops(self, alive):
        dev, dt, sp = self.device, self.dtype, self.spec
        for model, (hq, hkv, hid, inter) in sp["ops_models"].items():
            d = hid // hq
            full = model in ("Llama-2-7B", "tiny")
            for tp in TPS:
                if hq % tp or hid % tp:
                    continue
                qh, kvh, it = hq // tp, max(1, hkv // tp), inter // tp
                w_qkv = randn(((qh + 2 * kvh) * d, hid), dt, dev, 0.02)
                w_o = randn((hid, qh * d), dt, dev, 0.02)
                w_gu = randn((2 * it, hid), dt, dev, 0.02)
                w_dn = randn((hid, it), dt, dev, 0.02)
                nw = torch.ones(hid, dtype=dt, device=dev)
                for n in sp["ops_tokens"]:
                    if not alive():
                        self.result["skipped"].append(f"ops {model} tp{tp} n{n}: time")
                        continue
                    x = randn((n, hid), dt, dev)
                    xo = randn((n, qh * d), dt, dev)
                    xd = randn((n, it), dt, dev)
                    cases = [("attn_pre_proj", lambda: F.linear(x, w_qkv), f"{n}x{hid}->{w_qkv.shape[0]}"),
                             ("attn_post_proj", lambda: F.linear(xo, w_o), f"{n}x{qh * d}->{hid}"),
                             ("mlp_up_proj", lambda: F.linear(x, w_gu), f"{n}x{hid}->{2 * it}"),
                             ("mlp_down_proj", lambda: F.linear(xd, w_dn), f"{n}x{it}->{hid}")]
                    if full:
                        gu = randn((n, 2 * it), dt, dev)
                        qk = randn((n, qh + kvh, d), dt, dev)
                        cos, sin = rope_tables(n, d, dev, dt)
                        r = randn((n, hid), dt, dev)

                        def act(gu=gu):
                            g, u = gu.chunk(2, dim=-1)
                            return F.silu(g) * u
                        cases += [("input_layernorm", lambda: rms_norm(x, nw), f"{n}x{hid}"),
                                  ("attn_rope", lambda: apply_rope(qk, cos, sin), f"{n}x{qh + kvh}x{d}"),
                                  ("mlp_act", act, f"{n}x{it}"),
                                  ("add", lambda: x + r, f"{n}x{hid}")]
                    for name, fn, shape in cases:
                        try:
                            st = self.timer.time(fn)
                            self._layer_row(f"op:{name}", model, tp, "-", 1, n, 0, n, shape, st)
                        except Exception as e:  # noqa: BLE001
                            self._err(f"ops {model} tp{tp} {name} n{n}", e)
                del w_qkv, w_o, w_gu, w_dn
                self._free()
            log(f"ops {model} done ({len(self.layer_rows)} rows, {self.deadline.left():.0f}s left)")

    # -- driver
    def run(self):
        a = self.args
        self.env()
        caps = dict(ceilings=30, check=40, layer=a.cap_layer, ops=a.cap_ops, decode=a.cap_decode,
                    prefill=a.cap_prefill, chunk=a.cap_chunk, paged=a.cap_paged, flex=a.cap_flex)
        order = [s for s in ["ceilings", "check", "layer", "ops", "decode", "prefill", "chunk", "paged", "flex"]
                 if s in a.sections.split(",") or a.sections == "all"]
        if "check" not in order:
            order.insert(0, "check")
        for sec in order:
            t0 = time.perf_counter()
            log(f"== {sec} ({self.deadline.left():.0f}s left)")
            try:
                fn = getattr(self, sec)
                if sec in ("ceilings", "check"):
                    fn()
                else:
                    fn(self.deadline.section(caps[sec]))
            except Exception as e:  # noqa: BLE001
                self._err(f"section {sec}", e)
                traceback.print_exc()
            self.result["sections"][sec] = round(time.perf_counter() - t0, 1)
            self.write()  # partial results survive a kill
        if self.device.type == "cuda":
            self.result["env"]["nvidia_smi_end"] = _smi(SMI_FIELDS)
        self.write()
        return self.result

    # -- outputs
    def write(self):
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = self.args.tag or ("cpu" if self.device.type != "cuda" else
                                ("h100" if "H100" in torch.cuda.get_device_name() else "h200"))
        self.result["attention"] = self.att_rows
        self.result["layer_stack"] = self.layer_rows
        self.result["command"] = " ".join(sys.argv)
        (out / f"attention_{tag}.json").write_text(json.dumps(self.result, indent=1))
        with open(out / "attention.csv", "w", newline="") as f:
            w = csv.DictWriter(f, CSV_ATT_COLS)
            w.writeheader()
            w.writerows(self.att_rows)
        with open(out / "layer_stack.csv", "w", newline="") as f:
            w = csv.DictWriter(f, CSV_LAYER_COLS)
            w.writeheader()
            w.writerows(self.layer_rows)
        (out / f"attention_{tag}.md").write_text(summary_md(self.result))


# ----------------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------------

def summary_md(r):
    env = r.get("env", {})
    lines = [f"# Attention and layer timings on {env.get('gpu', '?')} ({env.get('date_utc', '?')})", ""]
    lines.append(f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}; "
                 f"nvidia-smi at start: `{env.get('nvidia_smi_start', '-')}` "
                 f"(fields: {env.get('nvidia_smi_fields', '-')}).")
    lines.append(f"Command: `{r.get('command', '')}`. Section times (s): {r.get('sections')}.")
    c = r.get("ceilings")
    if c:
        lines += ["", f"Ceilings: device copy {c['copy_gb_s']:.0f} GB/s copied "
                      f"({c['copy_read_plus_write_gb_s']:.0f} GB/s read+write, 1 GiB); bf16 matmul "
                      f"{c['matmul_mnk']}^3 {c['matmul_tflops']:.0f} TFLOP/s on random data."]
    bad = [x for x in r.get("checks", []) if not x.get("ok")]
    lines += ["", f"Checks vs float32 reference: {sum(1 for x in r.get('checks', []) if x.get('ok'))} ok; "
                  f"not usable: {', '.join(x['variant'] for x in bad) or 'none'}."]
    rows = r.get("attention", [])

    def pick(kind, hq, hkv, b, ql, kl):
        return {x["backend"]: x["median_ms"] for x in rows if x["kind"] == kind and x["q_heads"] == hq
                and x["kv_heads"] == hkv and x["batch"] == b and x["q_len"] == ql and x["kv_len"] == kl}

    configs = sorted({(x["q_heads"], x["kv_heads"]) for x in rows}, key=lambda t: (-t[0], -t[1]))
    backends = sorted({x["backend"] for x in rows if x["kind"] in ("decode", "prefill")})
    # headline decode table
    for kind, b, ql, kl, title in [("decode", 64, 1, 4096, "decode, batch 64 x context 4096"),
                                   ("decode", 64, 1, 2048, "decode, batch 64 x context 2048"),
                                   ("decode", 16, 1, 8192, "decode, batch 16 x context 8192"),
                                   ("prefill", 1, 2048, 2048, "prefill, 1 x 2048 tokens (causal)"),
                                   ("prefill", 4, 512, 512, "prefill, 4 x 512 tokens (causal)"),
                                   ("prefill_chunk", 1, 512, 512 + 8192, "chunk of 512 over 8192 cached")]:
        bks = sorted({x["backend"] for x in rows if x["kind"] == kind})
        data = [(cfg, pick(kind, cfg[0], cfg[1], b, ql, kl)) for cfg in configs]
        data = [(cfg, d) for cfg, d in data if d]
        if not data:
            continue
        lines += ["", f"## {title}: µs per layer per rank (median)", "",
                  "| q heads / kv heads | " + " | ".join(bks) + " | used by |",
                  "| --- | " + " | ".join("---:" for _ in bks) + " | --- |"]
        cmap = r.get("config_map", {})
        for cfg, d in data:
            used = ", ".join(cmap.get(f"{cfg[0]}/{cfg[1]}", []))
            lines.append(f"| {cfg[0]}/{cfg[1]} | " + " | ".join(
                f"{d[bk] * 1e3:.1f}" if bk in d else "-" for bk in bks) + f" | {used} |")
    paged = [x for x in rows if x["kind"] == "decode_paged" and x["backend"].startswith("flex")]
    if paged:
        lines += ["", "## decode over a paged KV pool, flex_attention (pages read in place)", "",
                  "| q/kv heads | batch | context | variant | flex µs | contiguous (best backend) µs |",
                  "| --- | ---: | ---: | --- | ---: | ---: |"]
        for x in paged:
            d = pick("decode", x["q_heads"], x["kv_heads"], x["batch"], 1, x["kv_len"])
            best = min(d.values()) if d else float("nan")
            lines.append(f"| {x['q_heads']}/{x['kv_heads']} | {x['batch']} | {x['kv_len']} | {x['backend']} | "
                         f"{x['median_ms'] * 1e3:.1f} | {best * 1e3:.1f} |")
    lrows = [x for x in r.get("layer_stack", []) if x["what"].startswith("layer_")]
    if lrows:
        lines += ["", f"## Layer stack ({r.get('layer_config', {})})", "",
                  "| what | tp | phase | batch | q_len | context | tokens | median ms | p10 | p90 |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in lrows:
            lines.append(f"| {x['what']} | {x['tp']} | {x['phase']} | {x['batch']} | {x['q_len']} | {x['context']} | "
                         f"{x['tokens']} | {x['median_ms']:.3f} | {x['p10_ms']:.3f} | {x['p90_ms']:.3f} |")
    orows = [x for x in r.get("layer_stack", []) if x["what"].startswith("op:")]
    if orows:
        names = []
        for x in orows:
            if x["what"] not in names:
                names.append(x["what"])
        toks = sorted({x["tokens"] for x in orows})
        for model in sorted({x["model"] for x in orows}):
            for tp in sorted({x["tp"] for x in orows if x["model"] == model}):
                sel = {(x["what"], x["tokens"]): x["median_ms"] for x in orows
                       if x["model"] == model and x["tp"] == tp}
                nm = [n for n in names if any((n, t) in sel for t in toks)]
                lines += ["", f"## Operators alone, {model} TP{tp} shard: µs (median)", "",
                          "| op | " + " | ".join(str(t) for t in toks) + " |",
                          "| --- | " + " | ".join("---:" for _ in toks) + " |"]
                for n in nm:
                    lines.append(f"| {n[3:]} | " + " | ".join(
                        f"{sel[(n, t)] * 1e3:.1f}" if (n, t) in sel else "-" for t in toks) + " |")
    if r.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in r["errors"][:40]]
    if r.get("skipped"):
        lines += ["", f"Skipped ({len(r['skipped'])}): " + "; ".join(r["skipped"][:60])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (logic check)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--sections", default="all",
                    help="comma list of ceilings,check,layer,ops,decode,prefill,chunk,paged,flex")
    ap.add_argument("--layer-model", default="", choices=["", *MODELS],
                    help="the layer stack's model shape (default: the Llama-2-7B stack)")
    ap.add_argument("--layer-tp", default="1", help="comma list of TP degrees: one rank's shard each")
    ap.add_argument("--layer-count", type=int, default=0, help="layers in the stack (default 4)")
    ap.add_argument("--tag", default="", help="output name tag (default: h100 / h200 from the GPU, cpu)")
    ap.add_argument("--layer-compile", action="store_true",
                    help="also time each stack with the parts around attention compiled "
                         "(torch.compile, fused kernels as vLLM runs them; row layer_stack_compiled)")
    for name, default in [("layer", 60), ("ops", 45), ("decode", 130), ("prefill", 80), ("chunk", 50),
                          ("paged", 60), ("flex", 150)]:
        ap.add_argument(f"--cap-{name}", type=float, default=default, help=f"seconds for {name}")
    args = ap.parse_args()
    if args.reps < 20 and not args.quick:
        ap.error("--reps must be >= 20")
    if args.device == "cpu":
        torch.set_num_threads(min(8, os.cpu_count() or 1))
    b = Bench(args)
    b.result["config_map"] = b.config_map
    b.result["sweep"] = {k: v for k, v in b.spec.items() if k not in ("ops_models",)}
    b.result["method"] = dict(
        timing="CUDA events per call; 256 MiB memset (L2 eviction) + ~20 us device sleep before each "
               "timed call; warm-up then median/p10/p90 of reps calls (20 if a call exceeds 0.2 s)",
        layout="q [B, Hq, S, D], k/v [B, Hkv, L, D] contiguous bf16, head_dim 128",
        gqa="enable_gqa=True where the backend accepts it; else for decode q-packing "
            "(q [B,Hq,1,D] viewed as [B,Hkv,Hq/Hkv,D], exact for q_len 1); else K/V expanded beforehand",
        chunk="causal_lower_right(C, P+C) bias: query i sees keys 0..P+i; flash runs it natively (GQA "
              "too); efficient natively for MHA, with K/V expanded beforehand for GQA (+expand); cuDNN "
              "gets an explicit boolean [C, P+C] mask built beforehand (+densemask)",
        paged="gather16+<bk>: vLLM flash layout pool [blocks,16,Hkv,D], random block table, blocks gathered "
              "into a contiguous copy then SDPA (an upper bound: KV read twice, written once); "
              "flex_paged<page>: flex_attention reads the pool in place through a BlockMask built from "
              "the block table (torch PagedAttention layout), page = BlockMask KV block size",
    )
    r = b.run()
    print(summary_md(r))
    n_err = len(r["errors"])
    log(f"done: {len(r['attention'])} attention rows, {len(r['layer_stack'])} layer rows, {n_err} errors")


if __name__ == "__main__":
    main()
