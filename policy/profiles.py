"""Where profiles come from: ``load_profile`` (a built-in by name, or a measured JSON file that
``remp profile`` wrote), ``save_profile``, the hand-calibrated ``h200x8-analytic`` model, and the
registry of modelled profiles (``<gpu>x8-<model>``, built by policy/perfmodel.py from measured
operator times). What a profile is and how the policy reads it (the SLO goodput curve):
policy/profile_types.py."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from remp.topology import Topology

# the profile data types live in policy.profile_types (the performance model builds them too);
# re-exported here, where callers have always found them
from policy.profile_types import _Z90, SLO, GoodputCurve, Profile, TopologyCurve  # noqa: F401


def load_profile(spec: str) -> Profile:
    """A built-in profile by name (``h200x8-analytic``) or a measured profile JSON file."""
    if spec in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[spec]()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown profile {spec!r}: not a built-in ({', '.join(BUILTIN_PROFILES)}) "
                         "and not a file")
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except ValueError as exc:  # JSON, encoding or document errors, named by the file
        raise ValueError(f"{path}: not a remp profile ({str(exc)[:200]})") from None


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")


# ============================================================================================
# The analytic H200 x8 profile
# ============================================================================================


@dataclass(frozen=True)
class H200Params:
    """Inputs of the analytic model. Hardware and model numbers are public; ``ar_latency_s`` and
    ``ar_bus_gbps`` are not inputs but the result of calibration (``calibrate_h200x8``)."""

    # model: a Llama-2-70B-shaped dense model in BF16 (fits 8 GPUs in every candidate topology)
    layers: int = 80
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 28672
    dtype_bytes: int = 2
    # hardware: NVIDIA H200 SXM (dense BF16 989 TFLOP/s, HBM3e 4.8 TB/s, 141 GB), NVLink 4
    peak_flops: float = 989e12
    mfu: float = 0.55  # achieved fraction of peak in serving GEMMs
    hbm_bytes_s: float = 4.8e12
    hbm_eff: float = 0.80
    gpu_mem_bytes: float = 141e9
    mem_util: float = 0.90  # vLLM gpu_memory_utilization
    activation_reserve_bytes: float = 6e9
    p2p_bytes_s: float = 300e9  # PP activation hand-off, one direction, achieved
    p2p_latency_s: float = 12e-6
    # engine
    max_num_seqs: int = 4096  # large: the batch is KV-limited
    step_overhead_s: float = 1.0e-3  # scheduler + sampling per engine step
    prefill_interference: float = 0.5  # TTFT stretch at full load from sharing steps with decode
    # reference request and spreads (Azure-2023-conversation-like)
    input_tokens: int = 1024
    output_tokens: int = 256
    prompt_sigma: float = 0.8  # log-normal spread of prompt lengths -> TTFT p90/p50
    tpot_sigma: float = 0.15  # per-request TPOT spread (context length, batch mix)
    # all-reduce alpha-beta model: per ring step latency (fixed, NVLink/NVSwitch hop) and
    # achieved bus bandwidth (calibrated to the TTFT fact)
    ar_latency_s: float = 5e-6
    ar_bus_bytes_s: float = 0.0
    # decode GEMM efficiency at TP r: mfu / (1 + decode_tp_penalty * (r - 1)) (calibrated to the
    # throughput fact): split decode GEMMs are narrower and wait on the all-reduce between them
    decode_tp_penalty: float = 0.0
    # the facts the calibration matches (ReMP paper, INFINIGENCE AI service)
    target_tp4pp2_throughput_ratio: float = 0.60  # fixed TP4PP2 loses ~40 % of peak vs TP1PP8
    target_trough_ttft_ratio: float = 3.1  # TP1PP8 trough TTFT / TP4PP2 trough TTFT
    peak_to_trough: float = 3.8  # 20:00 vs 04:00 traffic in that service
    peak_utilization: float = 0.9  # trough load = peak_utilization * capacity(TP1PP8) / peak_to_trough
    switch_downtime_s: float = 0.0  # filled by the model (eq. 10) when 0

    @property
    def layer_params(self) -> float:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.ffn

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


class _H200Model:
    """Per-layer roofline + alpha-beta all-reduce + pipeline stages (seed eqs. 14–15)."""

    def __init__(self, p: H200Params) -> None:
        self.p = p

    # --- per layer ---
    def allreduce(self, r: int, nbytes: float) -> float:
        if r == 1:
            return 0.0
        p = self.p
        return 2 * (r - 1) * p.ar_latency_s + 2 * (r - 1) / r * nbytes / p.ar_bus_bytes_s

    def layer_time(self, r: int, tokens: float, ctx_tokens: float, attn_flops: float,
                   decode: bool = False) -> float:
        """One layer on one TP rank: roofline of GEMM FLOPs vs weight + KV reads, plus two
        all-reduces (attention out, MLP out) of the tokens' hidden states (eq. 14); decode
        GEMMs run at the lower TP efficiency mfu / (1 + decode_tp_penalty * (r - 1))."""
        p = self.p
        flops = (2 * p.layer_params * tokens + attn_flops) / r
        mfu = p.mfu / (1 + p.decode_tp_penalty * (r - 1)) if decode else p.mfu
        t_compute = flops / (p.peak_flops * mfu)
        bytes_ = (p.layer_params * p.dtype_bytes + ctx_tokens * p.kv_bytes_per_token_layer) / r
        t_mem = bytes_ / (p.hbm_bytes_s * p.hbm_eff)
        return max(t_compute, t_mem) + 2 * self.allreduce(r, tokens * p.hidden * p.dtype_bytes)

    def hop(self, tokens: float) -> float:
        p = self.p
        return p.p2p_latency_s + tokens * p.hidden * p.dtype_bytes / p.p2p_bytes_s

    # --- prefill and decode ---
    def prefill_stage(self, r: int, pp: int, n: float) -> float:
        """One pipeline stage's time to prefill an n-token prompt (causal attention ~2 n^2 d)."""
        p = self.p
        attn = 2 * n * n * p.heads * p.head_dim
        return (p.layers / pp) * self.layer_time(r, n, n / 2, attn) + (self.hop(n) if pp > 1 else 0.0)

    def prefill_latency(self, r: int, pp: int, n: float) -> float:
        return pp * self.prefill_stage(r, pp, n) + self.p.step_overhead_s

    def decode_round(self, r: int, pp: int, batch: float) -> float:
        """TPOT with ``batch`` running sequences: vLLM splits them into pp micro-batches
        (one per virtual engine); a token needs one pass through all pp stages, so
        TPOT = pp * stage time of a micro-batch. With batch < pp only ``batch`` stages hold work:
        that idle share is the pipeline bubble of eq. 15 ((p-1)/(p+m-1) for m=1)."""
        p = self.p
        b = max(1.0, math.ceil(batch / pp))
        ctx = b * (p.input_tokens + p.output_tokens / 2)
        stage = (p.layers / pp) * self.layer_time(r, b, ctx, 4 * ctx * p.heads * p.head_dim, decode=True)
        if pp > 1:
            stage += self.hop(b)
        return pp * stage + p.step_overhead_s

    def max_batch(self, r: int, pp: int) -> float:
        p = self.p
        weights = p.layers * p.layer_params * p.dtype_bytes / (r * pp)
        kv_room = (p.gpu_mem_bytes * p.mem_util - weights - p.activation_reserve_bytes) * r * pp
        kv_per_seq = p.layers * p.kv_bytes_per_token_layer * (p.input_tokens + p.output_tokens)
        return float(min(p.max_num_seqs, kv_room / kv_per_seq))

    def capacity(self, r: int, pp: int) -> float:
        """Req/s at saturation: each request costs its prefill's stage time on the bottleneck
        stage plus output_tokens decode steps shared by the largest batch."""
        p = self.p
        bmax = self.max_batch(r, pp)
        per_req = self.prefill_stage(r, pp, p.input_tokens) + p.output_tokens * self.decode_round(r, pp, bmax) / bmax
        return 1.0 / per_req

    def point(self, r: int, pp: int, rate: float) -> tuple[float, float, float, float]:
        """(ttft50, ttft90, tpot50, tpot90) at offered ``rate`` below capacity."""
        p = self.p
        mu = self.capacity(r, pp)
        rho = min(rate / mu, 0.999)
        n50 = p.input_tokens
        n90 = p.input_tokens * math.exp(_Z90 * p.prompt_sigma)
        stretch = 1.0 + p.prefill_interference * rho
        # M/M/1 waiting time at service rate mu: P(W > t) = rho * exp(-(mu - lambda) t)
        gap = mu * (1 - rho)

        def wait_q(q: float) -> float:
            return math.log(rho / (1 - q)) / gap if rho > 1 - q else 0.0

        bmax = self.max_batch(r, pp)
        tpot = self.decode_round(r, pp, 1)
        ttft50 = self.prefill_latency(r, pp, n50) * stretch + wait_q(0.5)
        for _ in range(30):  # Little's law fixed point for the running batch
            batch = min(bmax, rate * (ttft50 + p.output_tokens * tpot))
            prefill_share = min(0.9, rate * self.prefill_stage(r, pp, p.input_tokens))
            tpot = self.decode_round(r, pp, batch) / (1 - prefill_share)
        # a new request joins the next micro-batch step: one stage time (TPOT / pp) away at most
        ttft50 = self.prefill_latency(r, pp, n50) * stretch + wait_q(0.5) + tpot / pp / 2
        ttft90 = self.prefill_latency(r, pp, n90) * stretch + wait_q(0.9) + tpot / pp * 0.9
        tpot90 = tpot * math.exp(_Z90 * p.tpot_sigma)
        return ttft50, ttft90, tpot, tpot90

    def switch_downtime(self) -> float:
        """Eq. 10 for a same-world-size switch: T_worker + T_mpu + max(T_kv, T_model) + T_sched,
        shard reload from host shared memory over PCIe Gen5 (~50 GB/s achieved per GPU), KV at a
        half-full cache over NVLink."""
        p = self.p
        shard = p.layers * p.layer_params * p.dtype_bytes / 8
        t_model = shard / 50e9
        kv_bytes = 0.5 * self.max_batch(1, 8) * p.layers * p.kv_bytes_per_token_layer * (
            p.input_tokens + p.output_tokens) / 8
        t_kv = kv_bytes / p.p2p_bytes_s
        return 0.2 + 0.05 + max(t_model, t_kv) + 0.15

    # --- the two calibration facts ---
    def facts(self) -> tuple[float, float]:
        tput = self.capacity(4, 2) / self.capacity(1, 8)
        trough = self.p.peak_utilization * self.capacity(1, 8) / self.p.peak_to_trough
        ttft = self.point(1, 8, trough)[0] / self.point(4, 2, trough)[0]
        return tput, ttft


H200_TOPOLOGIES = (Topology(1, 8), Topology(2, 4), Topology(4, 2), Topology(8, 1))


def _bisect(f, lo: float, hi: float, iters: int = 60) -> float:
    """Root of a monotone f on [lo, hi] in log space."""
    flo = f(lo)
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        fm = f(mid)
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
    return math.sqrt(lo * hi)


def calibrate_h200x8(base: H200Params | None = None) -> H200Params:
    """Solve for the two free communication parameters so that the model reproduces the paper's
    two facts: capacity(TP4PP2) / capacity(TP1PP8) = 0.60 and TTFT50(TP1PP8) / TTFT50(TP4PP2)
    = 3.1 at the trough load. Prefill all-reduces are large (bandwidth-bound), so the TTFT fact
    pins the bus bandwidth; decode all-reduces are small (latency-bound), so the throughput fact
    pins the decode TP efficiency penalty. Nested bisection: outer on the penalty (throughput),
    inner on the bandwidth (TTFT). Without the penalty the model gives TP4PP2 ~88 % of TP1PP8's
    capacity (both compute-bound at the KV-limited batch); a shared all-reduce latency large
    enough for 60 % would make TP4PP2's prefill too slow for the 3.1x TTFT fact."""
    from dataclasses import replace

    base = base or H200Params()

    def with_bw(pen: float) -> H200Params:
        def g(bw: float) -> float:
            m = _H200Model(replace(base, decode_tp_penalty=pen, ar_bus_bytes_s=bw))
            return m.facts()[1] - base.target_trough_ttft_ratio  # falls as bw rises

        return replace(base, decode_tp_penalty=pen, ar_bus_bytes_s=_bisect(g, 1e9, 1e14, 40))

    def f(pen: float) -> float:
        return _H200Model(with_bw(pen)).facts()[0] - base.target_tp4pp2_throughput_ratio

    params = with_bw(_bisect(f, 1e-4, 100.0, 40))
    if params.switch_downtime_s == 0.0:
        params = replace(params, switch_downtime_s=_H200Model(params).switch_downtime())
    return params


@functools.lru_cache(maxsize=4)
def analytic_h200x8(params: H200Params | None = None) -> Profile:
    """``h200x8-analytic``: a *modelled* (not measured) profile of one 8x H200 host serving a
    Llama-2-70B-shaped BF16 model in TP1PP8, TP2PP4, TP4PP2 and TP8PP1.

    Model (per layer, per TP rank r, per pipeline stage of L/PP layers; seed eqs. 14–15):
    - layer time = max(GEMM+attention FLOPs / (r * 989 TFLOP/s * MFU 0.55),
      (layer weights + KV read) / (r * 4.8 TB/s * 0.8)) + 2 all-reduces of the hidden states,
      all-reduce(r, bytes) = 2(r-1) * alpha + 2(r-1)/r * bytes / B_bus  (eq. 14's comm term);
    - PP: stage = L/PP layers + one activation hand-off (12 us + bytes / 300 GB/s); a decode token
      passes all PP stages, running sequences split into PP micro-batches (bubble, eq. 15);
    - capacity = 1 / (prefill stage time + output_tokens * decode round / max batch), max batch =
      min(max_num_seqs 1024, KV room at gpu_memory_utilization 0.9);
    - TTFT = prefill latency (stretched by up to 1.5x at full load by decode interference)
      + M/M/1 queue wait at the capacity; TTFT p90 uses the p90 prompt (log-normal sigma 0.8);
      TPOT from the Little's-law batch; p90 = p50 * exp(1.28 * 0.15).
    - reference request 1024 tokens in, 256 out.

    Calibrated (``calibrate_h200x8``): alpha and B_bus are solved so that fixed TP4PP2 has 60 % of
    TP1PP8's capacity (the paper: ~40 % lower peak throughput) and TP1PP8's median TTFT is 3.1x
    TP4PP2's at the trough load (0.9 * capacity(TP1PP8) / 3.8; the paper's service has a 3.8x
    peak/trough). Switch downtime: eq. 10 (worker 0.2 s + MPU 0.05 s + max(shard reload at
    50 GB/s, KV move) + rebind 0.15 s). Default SLO: TTFT 1 s, TPOT 200 ms (with it TP4PP2 is
    best at the trough, TP2PP4 at mid load and TP1PP8 at the peak).
    """
    p = calibrate_h200x8(params)
    m = _H200Model(p)
    curves = []
    for topo in H200_TOPOLOGIES:
        cap = m.capacity(topo.tp, topo.pp)
        loads = cap * np.concatenate([np.linspace(0.0, 0.9, 46), np.linspace(0.91, 0.995, 18)])
        pts = [m.point(topo.tp, topo.pp, float(x)) for x in loads]
        curves.append(TopologyCurve(
            topology=topo,
            capacity_rps=cap,
            load_rps=tuple(float(x) for x in loads),
            ttft_p50_s=tuple(q[0] for q in pts),
            ttft_p90_s=tuple(q[1] for q in pts),
            tpot_p50_s=tuple(q[2] for q in pts),
            tpot_p90_s=tuple(q[3] for q in pts),
        ))
    tput, ttft = m.facts()
    return Profile(
        name="h200x8-analytic",
        kind="analytic",
        curves=tuple(curves),
        input_tokens=p.input_tokens,
        output_tokens=p.output_tokens,
        switch_downtime_s=p.switch_downtime_s,
        default_slo=SLO(ttft_s=1.0, tpot_s=0.200),
        notes=("modelled, not measured: per-layer roofline + alpha-beta all-reduce + pipeline "
               "stages (seed eqs. 14-15) for a Llama-2-70B-shaped model on 8x H200, calibrated to "
               f"capacity(TP4PP2)/capacity(TP1PP8)={tput:.3f} and trough TTFT "
               f"TP1PP8/TP4PP2={ttft:.3f}"),
        params={
            "ar_latency_us": p.ar_latency_s * 1e6,
            "decode_tp_penalty": p.decode_tp_penalty,
            "ar_bus_gbps": p.ar_bus_bytes_s / 1e9,
            "capacity_ratio_tp4pp2_tp1pp8": tput,
            "trough_ttft_ratio_tp1pp8_tp4pp2": ttft,
            "mfu": p.mfu,
            "hbm_eff": p.hbm_eff,
            "max_num_seqs": p.max_num_seqs,
        },
    )


@functools.lru_cache(maxsize=16)
def _modelled(name: str) -> Profile:
    from policy.perfmodel import build_profile

    gpu, model = name.split("x8-", 1)
    return build_profile(model, gpu)


def _builtins() -> dict:
    from policy.perfmodel import BUILTIN

    out = {n: functools.partial(_modelled, n) for n in BUILTIN}
    out["h200x8-analytic"] = analytic_h200x8
    return out


# name -> () -> Profile. The modelled ones (policy/perfmodel.py, from Vidur's measured operator
# times) are "<gpu>x8-<model>"; h200x8-analytic is the older hand-calibrated formula.
BUILTIN_PROFILES = _builtins()
