"""Per-topology performance profiles (pure, plus one JSON file reader).

A profile says, for every candidate topology of a host, how the host serves a *reference request*
(``input_tokens`` in, ``output_tokens`` out) as offered load grows:

- ``capacity_rps``: the largest sustainable offered load (req/s); above it the queue grows without
  bound.
- a sweep of load points below capacity, each with the median and 90th percentile of TTFT and TPOT.

That is exactly what ``remp profile`` records on the real engine (warm-up excluded), so a measured
profile is a JSON file in this shape (``Profile.from_json`` / ``load_profile``). The one built-in
profile, ``h200x8-analytic``, is *modelled*, not measured: ``analytic_h200x8()`` derives the same
points from per-layer compute, memory-bandwidth and communication costs (the seed's equations
14–15) and is calibrated to two facts the ReMP paper reports; see its docstring and docs/policy.md.

From a profile the policy needs one thing: the **SLO goodput curve** g_T(λ), requests per second
that meet both the TTFT and the TPOT target when λ req/s are offered to topology T.
Per request, TTFT and TPOT are taken as independent log-normals through the measured (p50, p90) at
that load, so the SLO attainment is A(λ) = Φ(ln(S_ttft/ttft50)/σ_ttft) · Φ(ln(S_tpot/tpot50)/σ_tpot)
with σ = ln(p90/p50)/1.2816. Above capacity a front end sheds the excess:
g(λ) = max_{λ' ≤ min(λ, capacity)} λ'·A(λ') (monotone in λ; what ideal admission control achieves).
"""


from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from remp.topology import Topology

_Z90 = 1.2815515655446004  # standard normal 90th percentile
_GRID = 400  # points of the precomputed goodput curve per topology


def _phi(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF, vectorised (numpy has no erf)."""
    flat = np.asarray(x, dtype=float).ravel()
    out = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in flat])
    return out.reshape(np.shape(x))


def _lognormal_cdf(limit: float, p50: np.ndarray, p90: np.ndarray) -> np.ndarray:
    """P(X <= limit) for log-normal X through (p50, p90); p90 == p50 means no spread."""
    p50 = np.maximum(np.asarray(p50, dtype=float), 1e-12)
    sigma = np.log(np.maximum(np.asarray(p90, dtype=float), p50) / p50) / _Z90
    z = np.log(limit / p50) / np.maximum(sigma, 1e-9)
    return _phi(np.clip(z, -40.0, 40.0))


@dataclass(frozen=True)
class SLO:
    """Per-request targets: a request counts toward goodput when it meets both."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (0 < self.ttft_s < math.inf and 0 < self.tpot_s < math.inf):
            raise ValueError(f"SLO targets must be positive, got ttft={self.ttft_s} tpot={self.tpot_s}")


@dataclass(frozen=True)
class TopologyCurve:
    """One topology's latency-vs-load sweep (times in seconds, load in req/s)."""

    topology: Topology
    capacity_rps: float
    load_rps: tuple[float, ...]
    ttft_p50_s: tuple[float, ...]
    ttft_p90_s: tuple[float, ...]
    tpot_p50_s: tuple[float, ...]
    tpot_p90_s: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.load_rps)
        if n < 2:
            raise ValueError(f"{self.topology}: a curve needs at least 2 load points")
        for name in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{self.topology}: {name} has {len(getattr(self, name))} points, load has {n}")
        loads = np.asarray(self.load_rps)
        if np.any(np.diff(loads) <= 0) or loads[0] < 0:
            raise ValueError(f"{self.topology}: load points must be >= 0 and strictly increasing")
        if not 0 < self.capacity_rps < math.inf:
            raise ValueError(f"{self.topology}: capacity must be a positive number")
        lat = np.asarray((self.ttft_p50_s, self.ttft_p90_s, self.tpot_p50_s, self.tpot_p90_s), dtype=float)
        if not (np.all(np.isfinite(lat)) and np.all(lat > 0)):
            raise ValueError(f"{self.topology}: TTFT and TPOT must be positive numbers at every load point")
        if loads[-1] > self.capacity_rps * (1 + 1e-9):
            raise ValueError(f"{self.topology}: load point {loads[-1]} above capacity {self.capacity_rps}")

    def at(self, rate: float) -> tuple[float, float, float, float]:
        """(ttft50, ttft90, tpot50, tpot90) at ``rate`` (clamped into the measured range)."""
        x = self.load_rps
        return tuple(float(np.interp(rate, x, y)) for y in  # type: ignore[return-value]
                     (self.ttft_p50_s, self.ttft_p90_s, self.tpot_p50_s, self.tpot_p90_s))

    def attainment(self, rates: np.ndarray, slo: SLO, ttft_extra_s: float = 0.0,
                   tpot_extra_s: float = 0.0) -> np.ndarray:
        """SLO attainment at each offered rate below capacity (0 at or above it)."""
        rates = np.asarray(rates, dtype=float)
        x = np.asarray(self.load_rps)
        t50 = np.interp(rates, x, self.ttft_p50_s) + ttft_extra_s
        t90 = np.interp(rates, x, self.ttft_p90_s) + ttft_extra_s
        d50 = np.interp(rates, x, self.tpot_p50_s) + tpot_extra_s
        d90 = np.interp(rates, x, self.tpot_p90_s) + tpot_extra_s
        a = _lognormal_cdf(slo.ttft_s, t50, t90) * _lognormal_cdf(slo.tpot_s, d50, d90)
        return np.where(rates < self.capacity_rps, a, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity_rps": self.capacity_rps,
            "points": [
                {"load_rps": l, "ttft_p50_ms": a * 1e3, "ttft_p90_ms": b * 1e3,
                 "tpot_p50_ms": c * 1e3, "tpot_p90_ms": d * 1e3}
                for l, a, b, c, d in zip(self.load_rps, self.ttft_p50_s, self.ttft_p90_s,
                                         self.tpot_p50_s, self.tpot_p90_s)
            ],
        }


@dataclass(frozen=True)
class GoodputCurve:
    """g_T(λ) for one topology and one SLO, precomputed on a grid; evaluation is one np.interp."""

    topology: Topology
    capacity_rps: float
    grid_rps: np.ndarray
    goodput_rps: np.ndarray
    attainment: np.ndarray

    def __call__(self, rates: np.ndarray | float) -> np.ndarray:
        r = np.asarray(rates, dtype=float)
        return np.interp(r, self.grid_rps, self.goodput_rps, right=self.goodput_rps[-1])


@dataclass(frozen=True)
class Profile:
    """All candidate topologies of one host, the reference request, and the switch downtime."""

    name: str
    kind: str  # "measured" | "analytic"
    curves: tuple[TopologyCurve, ...]
    input_tokens: int
    output_tokens: int
    switch_downtime_s: float
    default_slo: SLO
    notes: str = ""
    # optional per-pair downtime overrides: {("TP1PP8", "TP4PP2"): 1.2}
    pair_downtime_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.curves:
            raise ValueError(f"profile {self.name!r} has no topologies")
        names = [str(c.topology) for c in self.curves]
        if len(set(names)) != len(names):
            raise ValueError(f"profile {self.name!r} lists a topology twice: {names}")
        if not 0 <= self.switch_downtime_s < math.inf or not all(
                0 <= v < math.inf for v in self.pair_downtime_s.values()):
            raise ValueError("switch downtimes must be numbers >= 0")
        if not (self.input_tokens >= 1 and self.output_tokens >= 1):
            raise ValueError("the reference request needs at least 1 input and 1 output token")

    @property
    def topologies(self) -> tuple[Topology, ...]:
        return tuple(c.topology for c in self.curves)

    def curve(self, topo: Topology) -> TopologyCurve:
        for c in self.curves:
            if c.topology == topo:
                return c
        raise KeyError(f"{topo} is not in profile {self.name!r} ({', '.join(map(str, self.topologies))})")

    def capacity(self, topo: Topology) -> float:
        return self.curve(topo).capacity_rps

    @property
    def best_capacity_rps(self) -> float:
        return max(c.capacity_rps for c in self.curves)

    def downtime_s(self, src: Topology, dst: Topology) -> float:
        if src == dst:
            return 0.0
        return float(self.pair_downtime_s.get((str(src), str(dst)), self.switch_downtime_s))

    def goodput_curves(self, slo: SLO) -> dict[Topology, GoodputCurve]:
        """g_T(λ) for every topology (monotone: the excess over the best admitted load is shed)."""
        out = {}
        for c in self.curves:
            grid = np.linspace(0.0, c.capacity_rps, _GRID)
            a = c.attainment(grid, slo)
            served = np.maximum.accumulate(grid * a)
            out[c.topology] = GoodputCurve(c.topology, c.capacity_rps, grid, served, a)
        return out

    def slowed(self, factor: float) -> "Profile":
        """The same host taken as ``factor`` x slower (``factor`` < 1: faster): every engine time
        scales by it, so each curve's loads and capacity divide by it and its latencies multiply
        (a queue whose service times all scale by s holds at load λ what it held at λ·s, each
        wait s times longer). For a profile that a measurement found optimistic by ~(s − 1)
        (docs/policy.md, "Model error"). Switch downtimes are kept (a shard reload, not the
        engine's iteration time)."""
        if not (math.isfinite(factor) and 0.25 <= factor <= 4.0):
            raise ValueError(f"profile slowdown must be within [0.25, 4], got {factor}")
        if factor == 1.0:
            return self
        curves = tuple(TopologyCurve(
            c.topology, c.capacity_rps / factor, tuple(x / factor for x in c.load_rps),
            tuple(x * factor for x in c.ttft_p50_s), tuple(x * factor for x in c.ttft_p90_s),
            tuple(x * factor for x in c.tpot_p50_s), tuple(x * factor for x in c.tpot_p90_s))
            for c in self.curves)
        return replace(self, name=f"{self.name}-slowed{factor:g}", curves=curves,
                       notes=f"{self.notes}; taken as {factor:g}x slower (profile slowdown)",
                       params={**self.params, "slowdown": factor})

    def in_flight(self, topo: Topology, rate: float) -> float:
        """Requests in the engine at ``rate`` (Little's law on the median latencies)."""
        c = self.curve(topo)
        r = min(rate, c.capacity_rps)
        t50, _, d50, _ = c.at(r)
        return r * (t50 + self.output_tokens * d50)

    # ---- JSON (measured profiles are files) ----
    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "notes": self.notes,
            "request": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens},
            "switch_downtime_s": self.switch_downtime_s,
            "pair_downtime_s": {f"{a}->{b}": v for (a, b), v in self.pair_downtime_s.items()},
            "default_slo": {"ttft_ms": self.default_slo.ttft_s * 1e3,
                            "tpot_ms": self.default_slo.tpot_s * 1e3},
            "params": dict(self.params),
            "topologies": {str(c.topology): c.to_json() for c in self.curves},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Profile":
        try:
            curves = []
            for name, t in doc["topologies"].items():
                pts = sorted(t["points"], key=lambda p: p["load_rps"])
                curves.append(TopologyCurve(
                    topology=Topology.parse(name),
                    capacity_rps=float(t["capacity_rps"]),
                    load_rps=tuple(float(p["load_rps"]) for p in pts),
                    ttft_p50_s=tuple(float(p["ttft_p50_ms"]) / 1e3 for p in pts),
                    ttft_p90_s=tuple(float(p.get("ttft_p90_ms", p["ttft_p50_ms"])) / 1e3 for p in pts),
                    tpot_p50_s=tuple(float(p["tpot_p50_ms"]) / 1e3 for p in pts),
                    tpot_p90_s=tuple(float(p.get("tpot_p90_ms", p["tpot_p50_ms"])) / 1e3 for p in pts),
                ))
            pairs = {}
            for key, v in doc.get("pair_downtime_s", {}).items():
                a, b = key.split("->")
                pairs[(str(Topology.parse(a)), str(Topology.parse(b)))] = float(v)
            slo = doc["default_slo"]
            return cls(
                name=str(doc["name"]),
                kind=str(doc.get("kind", "measured")),
                curves=tuple(curves),
                input_tokens=int(doc["request"]["input_tokens"]),
                output_tokens=int(doc["request"]["output_tokens"]),
                switch_downtime_s=float(doc["switch_downtime_s"]),
                default_slo=SLO(float(slo["ttft_ms"]) / 1e3, float(slo["tpot_ms"]) / 1e3),
                notes=str(doc.get("notes", "")),
                pair_downtime_s=pairs,
                params=dict(doc.get("params", {})),
            )
        except (KeyError, TypeError, AttributeError, OverflowError) as e:
            raise ValueError(f"not a remp profile document: missing or malformed {e}") from e
