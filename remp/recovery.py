"""Per-request recovery: migrate a displaced request's KV or recompute it (pure core, no I/O).

A request is *displaced* when its KV cannot stay where it is: a world-size shrink whose new block
pool cannot hold every running request, a drained or lost host. For each one the controller (or
the agent) decides, RecomputeOrMigrate style (../shared/DESIGN.md, ../shared/seeds/004_*):

- ``C_mig = kv_bytes / bandwidth`` with the bandwidth an EWMA of measured transfers between the two
  hosts (:class:`BandwidthEstimator`), capped by an optional throttle setting;
- ``C_recomp = prefill seconds`` for the tokens to recompute (prompt + generated so far) from a
  measured table (:class:`PrefillTable`, written by ``remp profile``);
- the cheaper path wins, a tie migrates; at most ``max_concurrent_migrations`` migrations run at
  once; a request neither path can recover within its SLO budget is aborted with a retryable
  error and a Retry-After (:func:`decide`).

:func:`plan_pool_resize` is the block-pool arithmetic of a switch that changes the per-rank bytes
per block: the new pool size and the fewest running requests that must be displaced.

Everything here is arithmetic over dataclasses: no clock, no sockets, no vLLM. Nothing runs on the
healthy path; the costs are only computed for displaced requests. docs/recovery.md has the rules
with examples.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterable, Mapping, NamedTuple, Sequence

# ----------------------------------------------------------------------------- bandwidth


@dataclass
class BandwidthEstimator:
    """EWMA of measured transfer bandwidth (bytes/s) per (source host, destination host).

    ``observe(src, dst, nbytes, seconds)`` folds one measured transfer in:
    ``est = alpha * nbytes / seconds + (1 - alpha) * est``. The first observation of a pair
    replaces ``default_bps`` outright (the default is only a stand-in until something is
    measured, it carries no weight). Transfers smaller than ``min_bytes`` are ignored: they
    measure latency, not bandwidth. Directions are separate pairs (A→B is not B→A).
    """

    alpha: float = 0.3
    default_bps: float = 1e9
    min_bytes: int = 0
    _est: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    _n: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not (self.default_bps > 0 and math.isfinite(self.default_bps)):
            raise ValueError(f"default bandwidth must be positive and finite, "
                             f"got {self.default_bps}")
        if self.min_bytes < 0:
            raise ValueError("min_bytes must be >= 0")

    def observe(self, src: str, dst: str, nbytes: int, seconds: float) -> float:
        """Fold one transfer in; returns the pair's estimate afterwards."""
        if nbytes < 0 or not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"a transfer needs bytes >= 0 and seconds > 0, "
                             f"got {nbytes}, {seconds}")
        key = (src, dst)
        if nbytes < self.min_bytes or nbytes == 0:
            return self.estimate(src, dst)
        sample = nbytes / seconds
        prev = self._est.get(key)
        self._est[key] = sample if prev is None else self.alpha * sample + (1 - self.alpha) * prev
        self._n[key] = self._n.get(key, 0) + 1
        return self._est[key]

    def estimate(self, src: str, dst: str) -> float:
        """The pair's EWMA, or ``default_bps`` before its first (large enough) transfer."""
        return self._est.get((src, dst), self.default_bps)

    def samples(self, src: str, dst: str) -> int:
        return self._n.get((src, dst), 0)

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "default_bps": self.default_bps, "min_bytes": self.min_bytes,
                "pairs": [{"src": s, "dst": d, "bps": v, "samples": self._n.get((s, d), 0)}
                          for (s, d), v in sorted(self._est.items())]}

    @classmethod
    def from_json(cls, doc: Mapping) -> "BandwidthEstimator":
        est = cls(alpha=float(doc.get("alpha", 0.3)),
                  default_bps=float(doc.get("default_bps", 1e9)),
                  min_bytes=int(doc.get("min_bytes", 0)))
        for p in doc.get("pairs", ()):
            bps = float(p["bps"])
            if not (bps > 0 and math.isfinite(bps)):
                raise ValueError(f"pair {p['src']}->{p['dst']}: bandwidth must be positive")
            est._est[(str(p["src"]), str(p["dst"]))] = bps
            est._n[(str(p["src"]), str(p["dst"]))] = int(p.get("samples", 1))
        return est


def effective_bandwidth(estimate_bps: float, cap_bps: float | None) -> float:
    """The bandwidth the decision uses: the estimate, capped by the throttle setting if any."""
    return estimate_bps if cap_bps is None else min(estimate_bps, cap_bps)


# ----------------------------------------------------------------------------- prefill table

TABLE_KIND = "remp.prefill_table"


@dataclass(frozen=True)
class PrefillTable:
    """Measured prefill seconds by number of tokens, interpolated piecewise linearly.

    ``points``: (tokens, seconds) with strictly increasing tokens and non-decreasing seconds
    (at least two). Between points: linear. Beyond the last point: the last segment's slope;
    below the first: the first segment's slope, never below 0 s. So ``seconds`` is monotone
    non-decreasing in the token count everywhere. Raw, noisy measurements go through
    :meth:`fit`, which makes them monotone. ``meta`` keeps where the numbers came from (model,
    topology, host, method) and round-trips through JSON untouched.
    """

    points: tuple[tuple[int, float], ...]
    meta: Mapping = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        pts = tuple((int(n), float(s)) for n, s in self.points)
        object.__setattr__(self, "points", pts)
        if len(pts) < 2:
            raise ValueError("a prefill table needs at least two prompt lengths")
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n1 <= n0:
                raise ValueError(f"prompt lengths must increase strictly ({n0} then {n1})")
            if s1 < s0:
                raise ValueError(f"prefill seconds must not decrease with length ({n0}: {s0}, "
                                 f"{n1}: {s1}); use PrefillTable.fit for raw measurements")
        if pts[0][0] < 0 or any(not (s >= 0 and math.isfinite(s)) for _, s in pts):
            raise ValueError("token counts and seconds must be >= 0 and finite")

    def seconds(self, tokens: int) -> float:
        """Predicted prefill time for ``tokens`` tokens."""
        pts = self.points
        if tokens >= pts[-1][0]:  # from the last point along the last segment's slope
            (n0, s0), (n1, s1) = pts[-2], pts[-1]
            return s1 + (s1 - s0) * (tokens - n1) / (n1 - n0)
        if tokens <= pts[0][0]:  # back from the first point along the first slope, >= 0
            (n0, s0), (n1, s1) = pts[0], pts[1]
            return max(0.0, s0 - (s1 - s0) * (n0 - tokens) / (n1 - n0))
        lo, hi = 0, len(pts) - 1  # pts[lo][0] <= tokens < pts[hi][0]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if pts[mid][0] <= tokens:
                lo = mid
            else:
                hi = mid
        (n0, s0), (n1, s1) = pts[lo], pts[hi]
        return min(s1, s0 + (s1 - s0) * (tokens - n0) / (n1 - n0))

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]], meta: Mapping | None = None
            ) -> "PrefillTable":
        """A monotone table from raw (tokens, seconds) samples: the median per length, then the
        pool-adjacent-violators fit (weighted by samples per length) so seconds never decrease
        with length — the least-squares monotone fit of the medians."""
        by_len: dict[int, list[float]] = {}
        for n, s in samples:
            if not (s >= 0 and math.isfinite(s)) or n < 0:
                raise ValueError(f"bad sample ({n}, {s})")
            by_len.setdefault(int(n), []).append(float(s))
        lens = sorted(by_len)
        medians = [_median(by_len[n]) for n in lens]
        fitted = isotonic(medians, [len(by_len[n]) for n in lens])
        return cls(tuple(zip(lens, fitted)), dict(meta or {}))

    def to_json(self) -> dict:
        return {"kind": TABLE_KIND, "version": 1, **{k: v for k, v in self.meta.items()
                                                    if k not in ("kind", "version", "points")},
                "points": [{"tokens": n, "seconds": s} for n, s in self.points]}

    @classmethod
    def from_json(cls, doc: Mapping) -> "PrefillTable":
        if doc.get("kind", TABLE_KIND) != TABLE_KIND:
            raise ValueError(f"not a prefill table (kind {doc.get('kind')!r})")
        if int(doc.get("version", 1)) != 1:
            raise ValueError(f"unsupported prefill table version {doc.get('version')}")
        try:
            pts = tuple((int(p["tokens"]), float(p["seconds"])) for p in doc["points"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"prefill table points need tokens and seconds ({exc})") from None
        meta = {k: v for k, v in doc.items() if k not in ("kind", "version", "points")}
        return cls(pts, meta)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def loads(cls, text: str) -> "PrefillTable":
        return cls.from_json(json.loads(text))


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def isotonic(ys: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    w = list(weights) if weights is not None else [1.0] * len(ys)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for y, wi in zip(ys, w):
        blocks.append([float(y), float(wi), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m1, w1, c1 = blocks.pop()
            m0, w0, c0 = blocks.pop()
            blocks.append([(m0 * w0 + m1 * w1) / (w0 + w1), w0 + w1, c0 + c1])
    out: list[float] = []
    for m, _, c in blocks:
        out.extend([m] * c)
    # rounding in the pooled means must not reintroduce a decrease
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return out


# ----------------------------------------------------------------------------- crossover


def crossover_bandwidth(kv_bytes: int, prefill_s: float) -> float:
    """The bandwidth (bytes/s) at which migrating ``kv_bytes`` costs the same as a prefill of
    ``prefill_s`` seconds. :func:`decide` migrates iff bandwidth >= this value (exactly, with no
    rounding slack): a tie migrates. 0 when there is nothing to move; inf when recompute is free."""
    if kv_bytes <= 0:
        return 0.0
    if prefill_s <= 0:
        return math.inf
    return kv_bytes / prefill_s


def prefers_migration(kv_bytes: int, bandwidth_bps: float, prefill_s: float) -> bool:
    """C_mig <= C_recomp, decided as bandwidth >= :func:`crossover_bandwidth` (tie → True)."""
    return bandwidth_bps >= crossover_bandwidth(kv_bytes, prefill_s)


def crossover_kv_bytes(bandwidth_bps: float, prefill_s: float) -> int:
    """The largest KV size (bytes) that still migrates at ``bandwidth_bps`` against a prefill of
    ``prefill_s``: ``prefers_migration(k, bw, p)`` holds for k <= this and fails for k + 1
    (exact for the comparison :func:`decide` makes, about ``bw * p``)."""
    if prefill_s <= 0:
        return 0
    k = max(0, math.floor(bandwidth_bps * prefill_s))
    while k > 0 and not prefers_migration(k, bandwidth_bps, prefill_s):
        k -= 1
    while prefers_migration(k + 1, bandwidth_bps, prefill_s):
        k += 1
    return k


def slo_budget(deadline_s: float, now_s: float, remaining_tokens: int, tpot_s: float) -> float:
    """Seconds left for recovery if the request is to meet its deadline: the time to the
    deadline less the time its remaining tokens need to decode (may be negative: already late)."""
    return deadline_s - now_s - remaining_tokens * tpot_s


# ----------------------------------------------------------------------------- the decision


class Action(str, Enum):
    MIGRATE = "MIGRATE"
    RECOMPUTE = "RECOMPUTE"
    ABORT = "ABORT"


class KvFormat(str, Enum):
    """How a MIGRATE sends the KV: at the engine's width, or INT8 with per-(layer, block, KV head)
    scales (dequantised on the target: not token-exact; ``node_agent.kv.int8``)."""

    FULL = "full"
    INT8 = "int8"


def int8_payload_bytes(kv_bytes: int, dtype_bytes: int, group_elements: int) -> int:
    """The INT8 payload of ``kv_bytes`` of KV stored at ``dtype_bytes`` per element: one byte per
    element plus one float32 scale per ``group_elements`` elements (a block × KV head: block size
    × 2 (K and V) × head size). bf16: 2 / (1 + 4 / group) ≈ 1.99× smaller at 1,024 elements."""
    if dtype_bytes <= 0 or group_elements <= 0:
        raise ValueError("dtype_bytes and group_elements must be positive")
    elements = kv_bytes // dtype_bytes
    return elements + 4 * -(-elements // group_elements)


class Reason(str, Enum):
    """Why a request got its action (stable codes for events and metrics)."""

    MIGRATE_CHEAPER = "migrate_cheaper"        # C_mig < C_recomp
    TIE_MIGRATE = "tie_migrate"                # C_mig == C_recomp
    RECOMPUTE_CHEAPER = "recompute_cheaper"    # C_recomp < C_mig
    SLOTS_FULL_RECOMPUTE = "slots_full_recompute"  # no migration slot now; recompute meets budget
    SLOTS_FULL_QUEUED = "slots_full_queued"        # waits for a slot; wait + C_mig meets budget
    SLO_INFEASIBLE = "slo_infeasible"              # both paths miss the budget
    SLOTS_FULL_SLO_INFEASIBLE = "slots_full_slo_infeasible"  # recompute misses it, so does waiting


@dataclass(frozen=True)
class RecoveryConfig:
    """Settings of the decision. ``bandwidth_cap_bps``: the throttle — the decision uses
    min(measured, cap) (tests and operators use it to force the recompute side)."""

    max_concurrent_migrations: int = 32
    bandwidth_cap_bps: float | None = None
    min_retry_after_s: int = 1
    # INT8 KV for a MIGRATE: "off" (full width), "on" (INT8 whenever the request has an INT8
    # size), "auto" (INT8 when it is predicted faster, codec time included; a tie sends full)
    kv_int8: str = "off"
    # quantise + dequantise seconds per byte of full-width KV (measured on the hosts)
    int8_codec_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_int8 not in ("off", "on", "auto"):
            raise ValueError(f"kv_int8 must be off, on or auto, got {self.kv_int8!r}")
        if not self.int8_codec_s_per_byte >= 0:
            raise ValueError("int8_codec_s_per_byte must be >= 0")
        if self.max_concurrent_migrations < 0:
            raise ValueError("max_concurrent_migrations must be >= 0")
        if self.bandwidth_cap_bps is not None and not self.bandwidth_cap_bps > 0:
            raise ValueError("bandwidth cap must be positive (unset: no cap)")
        if self.min_retry_after_s < 0:
            raise ValueError("min_retry_after_s must be >= 0")


@dataclass(frozen=True)
class DisplacedRequest:
    """A request whose KV must leave its place. ``tokens``: what a recompute prefills (prompt +
    generated so far); ``budget_s``: seconds its recovery may take and still meet its SLO (None:
    no SLO; see :func:`slo_budget`); ``remaining_tokens``: decode work left; ``src``/``dst``:
    the hosts the KV would move between (selects the bandwidth estimate); ``int8_bytes``: its
    INT8 payload (:func:`int8_payload_bytes`), None when it cannot be sent as INT8."""

    request_id: str
    kv_bytes: int
    tokens: int
    budget_s: float | None = None
    remaining_tokens: int = 0
    src: str = ""
    dst: str = ""
    int8_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kv_bytes < 0 or self.tokens < 0 or self.remaining_tokens < 0:
            raise ValueError(f"{self.request_id}: bytes and token counts must be >= 0")
        if self.int8_bytes is not None and self.int8_bytes < 0:
            raise ValueError(f"{self.request_id}: int8_bytes must be >= 0")
        if self.budget_s is not None and math.isnan(self.budget_s):
            raise ValueError(f"{self.request_id}: budget is NaN")


@dataclass(frozen=True)
class Decision:
    """One request's recovery decision, as recorded in the event stream (:meth:`to_event`).

    ``wait_s``: for a MIGRATE, how long it waits for a migration slot (0: starts now).
    ``retry_after_s``: for an ABORT, the Retry-After to send (whole seconds).
    ``kv_format`` / ``payload_bytes``: how a MIGRATE would send the KV and how many bytes
    (``migrate_s`` is that format's cost)."""

    request_id: str
    action: Action
    reason: Reason
    migrate_s: float
    recompute_s: float
    bandwidth_bps: float
    kv_bytes: int
    tokens: int
    budget_s: float | None
    wait_s: float = 0.0
    retry_after_s: int | None = None
    detail: str = ""
    kv_format: KvFormat = KvFormat.FULL
    payload_bytes: int = 0

    @property
    def retryable(self) -> bool:
        return self.action is Action.ABORT

    @property
    def finish_s(self) -> float:
        """When its recovery is predicted to be done (from the decision), 0 for an abort."""
        if self.action is Action.MIGRATE:
            return self.wait_s + self.migrate_s
        if self.action is Action.RECOMPUTE:
            return self.recompute_s
        return 0.0

    def to_event(self) -> dict:
        return {"request_id": self.request_id, "action": self.action.value,
                "reason": self.reason.value, "migrate_s": _finite(self.migrate_s),
                "recompute_s": self.recompute_s, "bandwidth_bps": _finite(self.bandwidth_bps),
                "kv_bytes": self.kv_bytes, "tokens": self.tokens, "budget_s": self.budget_s,
                "wait_s": self.wait_s, "retry_after_s": self.retry_after_s,
                "retryable": self.retryable, "detail": self.detail,
                "kv_format": self.kv_format.value, "payload_bytes": self.payload_bytes}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _fits(cost: float, budget: float | None) -> bool:
    return budget is None or cost <= budget


class _Costs(NamedTuple):
    """One request's costs in :func:`decide`: the migration in its chosen format, the recompute."""

    request: DisplacedRequest
    bw: float
    c_mig: float
    c_rec: float
    fmt: KvFormat
    payload: int

    def base(self) -> dict:
        """The fields every :class:`Decision` of this request shares."""
        r = self.request
        return dict(request_id=r.request_id, migrate_s=self.c_mig, recompute_s=self.c_rec,
                    bandwidth_bps=self.bw, kv_bytes=r.kv_bytes, tokens=r.tokens,
                    budget_s=r.budget_s, kv_format=self.fmt, payload_bytes=self.payload)


def decide(requests: Sequence[DisplacedRequest], prefill: PrefillTable,
           bandwidth: BandwidthEstimator | float, cfg: RecoveryConfig = RecoveryConfig(),
           busy_slots: Sequence[float] = ()) -> list[Decision]:
    """Decide migrate / recompute / abort for each displaced request (returned in input order).

    Costs: ``C_mig = kv_bytes / bw`` with ``bw = min(estimate(src, dst), cfg.bandwidth_cap_bps)``,
    ``C_recomp = prefill.seconds(tokens)``. With ``cfg.kv_int8`` "on" (or "auto" and cheaper) a
    request with an ``int8_bytes`` migrates as INT8: ``C_mig = int8_bytes / bw + kv_bytes ×
    cfg.int8_codec_s_per_byte`` (the decision's ``kv_format``, ``payload_bytes``). A path *meets
    the budget* when its cost (plus any wait for a slot) is <= ``budget_s``; ``budget_s=None``
    always meets it.

    1. The cheaper path is wanted; a tie wants MIGRATE (the crossover: :func:`prefers_migration`).
       If the cheaper path misses the budget, so does the other (it costs more) → ABORT
       (``slo_infeasible``).
    2. Migration slots: at most ``cfg.max_concurrent_migrations`` migrations run at once.
       ``busy_slots`` are the remaining seconds of migrations already running. Requests that want
       MIGRATE take the slots in this order: those whose recompute would miss the budget first
       (they have no other way), then the largest saving ``C_recomp - C_mig``, then input order.
       A request that finds a slot free now migrates now. One that finds none (the rule beyond N):
       RECOMPUTE if recompute meets its budget (``slots_full_recompute``); otherwise it waits for
       the earliest slot and migrates then, if that wait + C_mig meets its budget
       (``slots_full_queued``, ``wait_s`` > 0); otherwise ABORT (``slots_full_slo_infeasible``).
       So at no instant of the predicted schedule do more than N migrations run.
    3. Every ABORT is retryable and carries ``retry_after_s``: when this batch's recovery is
       predicted to be done (the latest finish of the migrations, running ones included, and the
       recomputes decided here), rounded up to whole seconds, at least ``cfg.min_retry_after_s``.
    """
    n_slots = cfg.max_concurrent_migrations
    rows: list[_Costs] = []
    for r in requests:
        est = bandwidth.estimate(r.src, r.dst) if isinstance(bandwidth, BandwidthEstimator) \
            else float(bandwidth)
        if not est > 0:
            raise ValueError(f"bandwidth must be positive, got {est}")
        bw = effective_bandwidth(est, cfg.bandwidth_cap_bps)
        c_mig, fmt, payload = r.kv_bytes / bw, KvFormat.FULL, r.kv_bytes
        if cfg.kv_int8 != "off" and r.int8_bytes is not None:
            c_int8 = r.int8_bytes / bw + r.kv_bytes * cfg.int8_codec_s_per_byte
            if cfg.kv_int8 == "on" or c_int8 < c_mig:
                c_mig, fmt, payload = c_int8, KvFormat.INT8, r.int8_bytes
        rows.append(_Costs(r, bw, c_mig, prefill.seconds(r.tokens), fmt, payload))

    out: list[Decision | None] = [None] * len(rows)
    wants_slot = []  # (needs a migration: recompute misses the budget, index)
    for i, row in enumerate(rows):
        r, bw, c_mig, c_rec = row.request, row.bw, row.c_mig, row.c_rec
        base = row.base()
        mig_ok, rec_ok = _fits(c_mig, r.budget_s), _fits(c_rec, r.budget_s)
        # full width: the exact crossover (:func:`prefers_migration`); INT8: its own cost
        prefer_mig = (prefers_migration(r.kv_bytes, bw, c_rec) if row.fmt is KvFormat.FULL
                      else c_mig <= c_rec)
        if prefer_mig and mig_ok:
            wants_slot.append((not rec_ok, i))
        elif rec_ok:
            out[i] = Decision(action=Action.RECOMPUTE, reason=Reason.RECOMPUTE_CHEAPER,
                              detail=f"recompute {c_rec:.4g} s < migrate {c_mig:.4g} s", **base)
        elif mig_ok:  # the costlier path meets the budget the cheaper one misses: rounding only
            wants_slot.append((True, i))
        else:
            out[i] = Decision(action=Action.ABORT, reason=Reason.SLO_INFEASIBLE,
                              detail=f"migrate {c_mig:.4g} s and recompute {c_rec:.4g} s both "
                                     f"exceed budget {r.budget_s:.4g} s", **base)

    # Occupied slots are a heap of finish times: the N latest-finishing running migrations bound
    # when a new one may start. A slot taken in this batch stays taken for its whole migration,
    # even a zero-byte one.
    running = sorted(float(b) for b in busy_slots if b > 0)
    occupied = running[max(0, len(running) - n_slots):] if n_slots else []
    free_now = n_slots - len(occupied)
    heapq.heapify(occupied)
    horizon = max([0.0] + running)

    def slot_order(item):
        needs, i = item
        return (not needs, -(rows[i].c_rec - rows[i].c_mig), i)

    for needs, i in sorted(wants_slot, key=slot_order):
        r, c_mig, c_rec = rows[i].request, rows[i].c_mig, rows[i].c_rec
        base = rows[i].base()
        start = occupied[0] if occupied else math.inf  # when the earliest slot frees
        if free_now > 0:
            free_now -= 1
            heapq.heappush(occupied, c_mig)
            horizon = max(horizon, c_mig)
            if c_mig == c_rec:
                reason, detail = Reason.TIE_MIGRATE, f"migrate = recompute = {c_mig:.4g} s"
            else:
                reason, detail = (Reason.MIGRATE_CHEAPER,
                                  f"migrate {c_mig:.4g} s < recompute {c_rec:.4g} s")
            out[i] = Decision(action=Action.MIGRATE, reason=reason, detail=detail, **base)
        elif not needs:  # recompute meets the budget: take it rather than wait for a slot
            out[i] = Decision(action=Action.RECOMPUTE, reason=Reason.SLOTS_FULL_RECOMPUTE,
                              detail=f"all {n_slots} migration slots busy", **base)
        elif math.isfinite(start) and _fits(start + c_mig, r.budget_s):
            heapq.heapreplace(occupied, start + c_mig)
            horizon = max(horizon, start + c_mig)
            out[i] = Decision(action=Action.MIGRATE, reason=Reason.SLOTS_FULL_QUEUED, wait_s=start,
                              detail=f"waits {start:.4g} s for a migration slot", **base)
        else:
            out[i] = Decision(action=Action.ABORT, reason=Reason.SLOTS_FULL_SLO_INFEASIBLE,
                              detail=f"no migration slot within budget {r.budget_s:.4g} s and "
                                     f"recompute {c_rec:.4g} s exceeds it", **base)

    horizon = max([horizon] + [d.recompute_s for d in out if d.action is Action.RECOMPUTE])
    retry_after = max(cfg.min_retry_after_s, math.ceil(horizon))
    return [replace(d, retry_after_s=retry_after) if d.action is Action.ABORT else d
            for d in out]


def summarize(decisions: Iterable[Decision]) -> dict[str, int]:
    """Counts per action (for a switch record or a closing note)."""
    counts = {a.value: 0 for a in Action}
    for d in decisions:
        counts[d.action.value] += 1
    return counts


# ----------------------------------------------------------------------------- block pool resize


@dataclass(frozen=True)
class RunningRequest:
    """A running request at a pool resize: blocks it holds now, blocks it needs to continue
    (the caller's horizon: at least its next step; to completion for a stronger guarantee) and
    its remaining work (tokens to decode). Blocks shared through the prefix cache count once per
    request holding them (conservative)."""

    request_id: str
    blocks_held: int
    blocks_needed: int
    remaining_tokens: int = 0

    def __post_init__(self) -> None:
        if self.blocks_held < 0 or self.blocks_needed < 0 or self.remaining_tokens < 0:
            raise ValueError(f"{self.request_id}: block and token counts must be >= 0")

    @property
    def demand(self) -> int:
        """Blocks it occupies in the new pool: max(held, needed)."""
        return max(self.blocks_held, self.blocks_needed)


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int       # blocks in the new pool (vLLM's num_gpu_blocks)
    usable_blocks: int    # num_blocks less the reserved ones (vLLM's null block)
    kept: tuple[str, ...]
    displaced: tuple[str, ...]   # in displacement order
    kept_blocks: int             # sum of the kept requests' demand (<= usable_blocks)

    @property
    def free_blocks(self) -> int:
        return self.usable_blocks - self.kept_blocks


def pool_blocks(kv_budget_bytes: int, bytes_per_block: int,
                num_blocks_override: int | None = None) -> int:
    """vLLM's pool size: ``kv_budget_bytes // bytes_per_block`` per rank (``bytes_per_block``:
    one block across every layer the rank holds), or the override when set. With per-rank
    values, pass the smallest result: vLLM takes the minimum over ranks."""
    if bytes_per_block <= 0:
        raise ValueError("bytes per block must be positive")
    if kv_budget_bytes < 0:
        raise ValueError("KV byte budget must be >= 0")
    return num_blocks_override if num_blocks_override is not None \
        else kv_budget_bytes // bytes_per_block


def plan_pool_resize(kv_budget_bytes: int, bytes_per_block: int,
                     running: Sequence[RunningRequest], reserved_blocks: int = 1,
                     num_blocks_override: int | None = None) -> PoolPlan:
    """The new pool size and the fewest running requests to displace so the rest fit.

    ``num_blocks = kv_budget_bytes // bytes_per_block`` (see :func:`pool_blocks`);
    ``usable = num_blocks - reserved_blocks`` (vLLM's BlockPool keeps block 0 as its null block).
    The kept requests fit when the sum of their :attr:`RunningRequest.demand` is <= usable.

    Rule: displace in order of demand, largest first; among equal demand, the least remaining
    work first (the largest remaining work is displaced last); then input order. Stop as soon
    as the rest fit. Taking the largest first makes the count minimal: if removing the k
    largest demands does not make the rest fit, no set of k removals does. Nothing is displaced
    when everything fits.
    """
    if reserved_blocks < 0:
        raise ValueError("reserved_blocks must be >= 0")
    ids = [r.request_id for r in running]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    num_blocks = pool_blocks(kv_budget_bytes, bytes_per_block, num_blocks_override)
    usable = max(0, num_blocks - reserved_blocks)
    order = sorted(range(len(running)),
                   key=lambda i: (-running[i].demand, running[i].remaining_tokens, i))
    total = sum(r.demand for r in running)
    displaced: list[int] = []
    for i in order:
        if total <= usable:
            break
        displaced.append(i)
        total -= running[i].demand
    gone = set(displaced)
    return PoolPlan(num_blocks=num_blocks, usable_blocks=usable,
                    kept=tuple(running[i].request_id for i in range(len(running)) if i not in gone),
                    displaced=tuple(running[i].request_id for i in displaced), kept_blocks=total)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a request of ``tokens`` tokens holds: ceil(tokens / block_size)."""
    if block_size <= 0:
        raise ValueError("block size must be positive")
    return -(-tokens // block_size)
