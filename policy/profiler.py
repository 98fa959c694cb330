"""``remp policy profile``: measure a per-topology profile on a live node agent.

For each candidate topology (same world size as the agent's current one, or ``--topologies``)
the agent is switched in place (NodeAgent.ExecuteSwitch) and driven over its OpenAI HTTP API:

1. capacity: ``concurrency`` closed-loop clients send greedy completions for ``capacity_s``;
   completions per second after the warm-up are the capacity (req/s);
2. a sweep of offered load at fractions of that capacity: Poisson arrivals for ``point_s``
   each; requests that *started* in the first ``warmup_s`` of a point are not counted.
   Per point: TTFT p50/p90 as the client sees it (first streamed token), TPOT from the engine's
   own ``vllm:request_time_per_output_token_seconds`` histogram over the point (p50 = its mean,
   p90 interpolated in its buckets, never below the mean) because a client on a loaded 2-core
   host receives the token stream in bursts, which makes client-side inter-token times
   meaningless; the client-side TPOT is the fallback when /metrics is not served. And the
   completions per second.

The switch records give the measured downtime per pair. The result is a ``Profile`` (kind
``measured``) in the JSON shape ``policy.profiles.load_profile`` reads. The request shape is the
reference request of the profile. The original topology is restored at the end.

The measuring is I/O; the arithmetic (``percentile``, ``point_from``, ``curve_from``,
``derive_slo``) is pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import grpc
import httpx

from policy.profiles import SLO, Profile, TopologyCurve
from remp import logs
from remp.common.v1 import types_pb2
from remp.errors import FailedPrecondition, Unavailable
from remp.grpc_util import channel_options
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc
from remp.topology import Topology

log = logs.get_logger("remp.policy.profile")


@dataclass(frozen=True)
class SweepConfig:
    fractions: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.85)
    point_s: float = 8.0
    warmup_s: float = 1.5
    capacity_s: float = 6.0
    concurrency: int = 8
    input_words: int = 24
    output_tokens: int = 16
    seed: int = 0
    model: str = "tiny"

    def __post_init__(self) -> None:
        if not self.fractions or any(not 0 < f < 1 for f in self.fractions):
            raise ValueError("load fractions must be in (0, 1)")
        if self.output_tokens < 2:
            raise ValueError("output_tokens must be >= 2 (TPOT needs two tokens)")
        if self.point_s <= 0 or self.capacity_s <= 0 or self.warmup_s < 0:
            raise ValueError("point_s and capacity_s must be positive, warmup_s >= 0")


@dataclass(frozen=True)
class Timing:
    """One request: when it was sent (monotonic), TTFT and TPOT in seconds."""

    sent: float
    ttft_s: float
    tpot_s: float
    done: float


@dataclass
class PointResult:
    offered_rps: float
    achieved_rps: float
    n: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    errors: int = 0
    client_tpot_p50_s: float = math.nan  # set when TPOT came from the engine's histogram


@dataclass
class TopologyResult:
    topology: Topology
    capacity_rps: float
    points: list[PointResult] = field(default_factory=list)


# ---------------------------------------------------------------------------- pure arithmetic

def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def point_from(offered: float, timings: list[Timing], t0: float, warmup_s: float, end: float,
               errors: int = 0) -> PointResult:
    """Statistics of one load point: requests sent at or after ``t0 + warmup_s`` count."""
    kept = [t for t in timings if t.sent >= t0 + warmup_s]
    span = max(end - (t0 + warmup_s), 1e-9)
    ttft = [t.ttft_s for t in kept]
    tpot = [t.tpot_s for t in kept]
    return PointResult(offered, len(kept) / span, len(kept), percentile(ttft, 0.5),
                       percentile(ttft, 0.9), percentile(tpot, 0.5), percentile(tpot, 0.9), errors)


def curve_from(r: TopologyResult) -> TopologyCurve:
    pts = sorted((p for p in r.points if p.n > 0 and p.offered_rps < r.capacity_rps),
                 key=lambda p: p.offered_rps)
    if len(pts) < 2:
        raise ValueError(f"{r.topology}: fewer than 2 load points with completed requests")
    return TopologyCurve(
        topology=r.topology, capacity_rps=r.capacity_rps,
        load_rps=tuple(p.offered_rps for p in pts),
        ttft_p50_s=tuple(p.ttft_p50_s for p in pts),
        ttft_p90_s=tuple(max(p.ttft_p90_s, p.ttft_p50_s) for p in pts),
        tpot_p50_s=tuple(p.tpot_p50_s for p in pts),
        tpot_p90_s=tuple(max(p.tpot_p90_s, p.tpot_p50_s) for p in pts))


def derive_slo(curves: list[TopologyCurve], factor: float = 3.0) -> SLO:
    """Default SLO of a measured profile: ``factor`` × the best lowest-load p90 of each metric."""
    return SLO(factor * min(c.ttft_p90_s[0] for c in curves),
               factor * min(c.tpot_p90_s[0] for c in curves))


def build_profile(name: str, results: list[TopologyResult], cfg: SweepConfig,
                  downtimes: dict[tuple[str, str], float], slo: SLO | None,
                  notes: str = "", params: dict | None = None) -> Profile:
    curves = [curve_from(r) for r in results]
    dt = statistics.median(downtimes.values()) if downtimes else 0.0
    return Profile(name=name, kind="measured", curves=tuple(curves),
                   input_tokens=cfg.input_words, output_tokens=cfg.output_tokens,
                   switch_downtime_s=dt, default_slo=slo or derive_slo(curves), notes=notes,
                   pair_downtime_s=dict(downtimes), params=dict(params or {}))


TPOT_METRIC = "vllm:request_time_per_output_token_seconds"


def parse_histogram(text: str, name: str) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, [(le, cumulative count)]) of a Prometheus histogram, summed over labels."""
    tot_sum = tot_cnt = 0.0
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        key, _, val = line.rpartition(" ")
        try:
            v = float(val)
        except ValueError:
            continue
        if key.startswith(f"{name}_sum"):
            tot_sum += v
        elif key.startswith(f"{name}_count"):
            tot_cnt += v
        elif key.startswith(f"{name}_bucket"):
            le = key.split('le="', 1)[1].split('"', 1)[0] if 'le="' in key else "+Inf"
            b = math.inf if le == "+Inf" else float(le)
            buckets[b] = buckets.get(b, 0.0) + v
    return tot_sum, tot_cnt, sorted(buckets.items())


def histogram_delta(before: tuple, after: tuple) -> tuple[float, float, list[tuple[float, float]]]:
    b0 = dict(before[2])
    return (after[0] - before[0], after[1] - before[1],
            [(le, c - b0.get(le, 0.0)) for le, c in after[2]])


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style: linear inside the bucket holding the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1)
        prev_le, prev_c = le, c
    return prev_le


def engine_tpot(delta: tuple[float, float, list[tuple[float, float]]]) -> tuple[float, float]:
    """(p50, p90) TPOT of one point from the engine histogram delta: mean and bucket p90."""
    s, n, buckets = delta
    if n <= 0:
        return math.nan, math.nan
    mean = s / n
    return mean, max(mean, histogram_quantile(0.9, buckets))


# ---------------------------------------------------------------------------- measuring (I/O)

async def scrape(client: httpx.AsyncClient, http: str) -> tuple | None:
    try:
        r = await client.get(f"{http}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or TPOT_METRIC not in r.text:
        return None
    return parse_histogram(r.text, TPOT_METRIC)

class Prompts:
    """Distinct prompts (no prefix-cache hits) of ``words`` short words each."""

    def __init__(self, words: int, seed: int):
        self.words, self.rng, self.i = words, random.Random(seed), 0

    def next(self) -> str:
        self.i += 1
        return f"r{self.i} " + " ".join(f"w{self.rng.randrange(3, 1900)}"
                                        for _ in range(self.words - 1))


async def timed_completion(client: httpx.AsyncClient, http: str, cfg: SweepConfig,
                           text: str) -> Timing:
    sent = time.monotonic()
    first = last = None
    async with client.stream("POST", f"{http}/v1/completions", json={
            "model": cfg.model, "prompt": text, "max_tokens": cfg.output_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.monotonic()
                first = now if first is None else first
                last = now
    if first is None:
        raise RuntimeError("no tokens streamed")
    return Timing(sent, first - sent, (last - first) / (cfg.output_tokens - 1), last)


async def measure_capacity(client: httpx.AsyncClient, http: str, cfg: SweepConfig,
                           prompts: Prompts) -> float:
    t0 = time.monotonic()
    end = t0 + cfg.warmup_s + cfg.capacity_s
    done: list[float] = []

    async def worker():
        while time.monotonic() < end:
            t = await timed_completion(client, http, cfg, prompts.next())
            done.append(t.done)

    await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    start = t0 + cfg.warmup_s
    n = sum(1 for d in done if start <= d <= end)
    return n / cfg.capacity_s


async def measure_point(client: httpx.AsyncClient, http: str, cfg: SweepConfig, rate: float,
                        prompts: Prompts, rng: random.Random) -> PointResult:
    t0 = time.monotonic()
    end = t0 + cfg.warmup_s + cfg.point_s
    tasks: list[asyncio.Task] = []
    nxt = t0
    before = None
    scraped = False
    while True:
        nxt += rng.expovariate(rate)
        if nxt >= end:
            break
        if not scraped and nxt >= t0 + cfg.warmup_s:
            scraped, before = True, await scrape(client, http)  # engine TPOT after warm-up
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        tasks.append(asyncio.create_task(timed_completion(client, http, cfg, prompts.next())))
    res = await asyncio.gather(*tasks, return_exceptions=True)
    after = await scrape(client, http) if before is not None else None
    timings = [t for t in res if isinstance(t, Timing)]
    errors = len(res) - len(timings)
    p = point_from(rate, timings, t0, cfg.warmup_s, end, errors)
    if before is not None and after is not None:
        p50, p90 = engine_tpot(histogram_delta(before, after))
        if not math.isnan(p50):
            p.client_tpot_p50_s, p.tpot_p50_s, p.tpot_p90_s = p.tpot_p50_s, p50, p90
    return p


async def _describe(stub) -> node_agent_pb2.DescribeResponse:
    try:
        return await stub.Describe(node_agent_pb2.DescribeRequest(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        raise Unavailable(f"agent unreachable: {exc.code().name} {exc.details() or ''}") from None


async def _switch(stub, target: Topology) -> types_pb2.SwitchRecord:
    req = node_agent_pb2.ExecuteSwitchRequest(
        target=types_pb2.Topology(tp=target.tp, pp=target.pp),
        reason="remp policy profile", switch_id=f"profile-{time.time_ns()}")
    record = None
    try:
        async for ev in stub.ExecuteSwitch(req, timeout=600):
            if ev.HasField("record"):
                record = ev.record
    except grpc.aio.AioRpcError as exc:
        raise FailedPrecondition(f"switch to {target} refused: {exc.code().name} "
                                 f"{exc.details() or ''}") from None
    if record is None or record.outcome != types_pb2.SWITCH_OUTCOME_SUCCEEDED:
        raise FailedPrecondition(f"switch to {target} did not succeed: "
                                 f"{record.error.message if record else 'no record'}")
    return record


async def profile_agent(agent: str, http: str | None, cfg: SweepConfig, name: str,
                        topologies: list[Topology] | None = None, slo: SLO | None = None
                        ) -> Profile:
    from remp.auth import Credentials, aio_channel

    # ExecuteSwitch takes the controller's credential (remp.auth): profiling is maintenance
    async with aio_channel(agent, Credentials.load(), options=channel_options()) as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        d = await _describe(stub)
        http = http or d.http_address
        start = Topology(d.topology.tp, d.topology.pp)
        cands = [Topology(c.tp, c.pp) for c in d.candidates]
        topos = topologies or [t for t in cands if t.world_size == start.world_size]
        order = [start] + [t for t in topos if t != start] if start in topos else list(topos)
        prompts, rng = Prompts(cfg.input_words, cfg.seed), random.Random(cfg.seed)
        results: list[TopologyResult] = []
        downtimes: dict[tuple[str, str], float] = {}
        cur = start
        async with httpx.AsyncClient(timeout=300) as client:
            for t in order:
                if t != cur:
                    rec = await _switch(stub, t)
                    downtimes[(str(cur), str(t))] = rec.downtime_seconds
                    log.info("profile.switched", source=str(cur), target=str(t),
                             downtime_s=round(rec.downtime_seconds, 3))
                    cur = t
                await timed_completion(client, http, cfg, prompts.next())  # warm the path
                cap = await measure_capacity(client, http, cfg, prompts)
                r = TopologyResult(t, cap)
                log.info("profile.capacity", topology=str(t), capacity_rps=round(cap, 3))
                for f in cfg.fractions:
                    p = await measure_point(client, http, cfg, f * cap, prompts, rng)
                    log.info("profile.point", topology=str(t), offered_rps=round(p.offered_rps, 3),
                             achieved_rps=round(p.achieved_rps, 3), n=p.n,
                             ttft_p50_ms=round(p.ttft_p50_s * 1e3, 1),
                             tpot_p50_ms=round(p.tpot_p50_s * 1e3, 2), errors=p.errors)
                    r.points.append(p)
                results.append(r)
            if cur != start:
                rec = await _switch(stub, start)
                downtimes[(str(cur), str(start))] = rec.downtime_seconds
    host = d.host
    notes = (f"measured by remp policy profile on {host.hostname} ({host.device_type}, "
             f"{host.cpu_cores} cores, {host.device_count} devices), model {d.model.path} "
             f"({d.model.num_layers} layers, hidden {d.model.hidden_size}, {d.model.dtype}); "
             f"reference request {cfg.input_words} words in, {cfg.output_tokens} tokens out; "
             f"capacity = closed loop of {cfg.concurrency} for {cfg.capacity_s:g} s; "
             f"Poisson points of {cfg.point_s:g} s, first {cfg.warmup_s:g} s excluded")
    params = {"sweep": {"fractions": list(cfg.fractions), "point_s": cfg.point_s,
                        "warmup_s": cfg.warmup_s, "capacity_s": cfg.capacity_s,
                        "concurrency": cfg.concurrency, "seed": cfg.seed},
              "achieved_rps": {str(r.topology): [round(p.achieved_rps, 4) for p in r.points]
                               for r in results},
              "samples": {str(r.topology): [p.n for p in r.points] for r in results},
              "tpot_source": ("engine histogram " + TPOT_METRIC
                              if all(not math.isnan(p.client_tpot_p50_s) for r in results
                                     for p in r.points) else "client (some or all points)"),
              "client_tpot_p50_ms": {str(r.topology): [round(p.client_tpot_p50_s * 1e3, 3)
                                                       for p in r.points] for r in results},
              "errors": sum(p.errors for r in results for p in r.points),
              "vllm_version": d.vllm_version}
    return build_profile(name, results, cfg, downtimes, slo, notes, params)


def dumps(profile: Profile) -> str:
    return json.dumps(profile.to_json(), indent=1) + "\n"
