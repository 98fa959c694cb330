"""The policy service's logic (gRPC-free): one tick reads every node's traffic from the
controller, aggregates it into fixed windows, forecasts, decides, and acts by mode.

- AUTO: a switch decision calls ``Controller.Reconfigure`` with the decision id as request id
  (idempotent at the controller); the switch id and the answer go into the decision. A call that
  got no answer (UNAVAILABLE) is not re-sent blindly: it is asked again, with the *same* request
  id, after ``retry_backoff_s`` and only while the policy still wants the same target.
- ADVISORY: a switch decision is recorded with ``Controller.RecordRecommendation`` (once per
  target; withdrawn by recording the current topology when the policy no longer wants it);
  Reconfigure is never called.
- OFF: forecasts and decides (GetRecommendation answers) but calls nothing.

The controller is behind :class:`ControllerPort` (adapter: ``policy.controller_client``) and the
decision log behind :class:`DecisionStorePort` (adapter: ``policy.store``), so this module is
tested against fakes or the real thing alike. Time is an argument (``tick(now)``) or the
injected clock. Errors are the typed ``remp.errors`` ones.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from policy.decide import AutoPolicy, CandidateScore, Decision, PolicyConfig, PolicyState, Scorer
from policy.forecast import Chooser
from policy.profiles import SLO, Profile
from remp import logs
from remp import metrics
from remp.errors import (FailedPrecondition, InvalidArgument, NotFound, RempError, Unauthenticated,
                         Unavailable)
from remp.topology import Topology

log = logs.get_logger("remp.policy")

MODES = ("auto", "advisory", "off")
DEFAULT_PAGE, MAX_PAGE = 50, 1000
MAX_FORECAST_WINDOWS = 20_000
OBSERVED_KEEP = 500  # samples kept per node for GetForecast.observed


# ------------------------------------------------------------------------------ ports

@dataclass(frozen=True)
class Sample:
    """One heartbeat's traffic (``TrafficSample``): it covers (at_s - window_s, at_s]."""

    at_s: float
    window_s: float
    requests: int
    input_tokens: int = 0
    output_tokens: int = 0
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class NodeView:
    """What the controller says about a node (``NodeState``)."""

    name: str
    observed: Topology | None
    candidates: tuple[Topology, ...]
    health: str  # ready | switching | lost | unknown
    recommendation: str = ""


@dataclass(frozen=True)
class ReconfigureResult:
    switch_id: str
    noop: bool = False
    duplicate: bool = False


class ControllerPort(Protocol):
    async def list_nodes(self) -> list[NodeView]: ...

    async def traffic(self, node: str, since_s: float | None, limit: int) -> list[Sample]: ...

    async def reconfigure(self, node: str, target: Topology, request_id: str,
                          reason: str) -> ReconfigureResult: ...

    async def record_recommendation(self, node: str, recommended: Topology, reason: str,
                                    decision_id: str) -> None: ...


class DecisionStorePort(Protocol):
    async def load(self, limit: int) -> tuple[list[dict[str, Any]], dict[str, str]]: ...

    async def append(self, doc: dict[str, Any], keep: int) -> None: ...

    async def save_modes(self, modes: dict[str, str]) -> None: ...


# ------------------------------------------------------------------------------ windows

class WindowAggregator:
    """Heartbeat samples → one rate per fixed window [k·W, (k+1)·W) (pure).

    A sample's requests are spread over the windows it overlaps, in proportion to the overlap.
    A window is emitted once a sample reaches its end, or ``stale_s`` after its end without one
    (the node stopped reporting); its rate is requests / covered seconds, NaN when less than
    ``min_coverage`` of the window was covered. Samples older than the last emitted window or
    not newer than the last sample are ignored."""

    def __init__(self, window_s: float, min_coverage: float = 0.5, stale_s: float | None = None):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.W = window_s
        self.min_coverage = min_coverage
        self.stale_s = stale_s
        self.acc: dict[int, list[float]] = {}
        self.next_k: int | None = None
        self.latest_at = -math.inf
        self.interval = window_s  # last heartbeat interval seen

    def add(self, s: Sample) -> None:
        if s.at_s <= self.latest_at or s.window_s <= 0:
            return
        start = s.at_s - s.window_s
        if self.next_k is None:
            self.next_k = int(math.floor(start / self.W))
        k = int(math.floor(start / self.W))
        while k * self.W < s.at_s:
            lo, hi = max(start, k * self.W), min(s.at_s, (k + 1) * self.W)
            if hi > lo and k >= self.next_k:
                a = self.acc.setdefault(k, [0.0, 0.0])
                a[0] += s.requests * (hi - lo) / s.window_s
                a[1] += hi - lo
            k += 1
        self.latest_at, self.interval = s.at_s, s.window_s

    def complete(self, now_s: float) -> list[tuple[float, float]]:
        """(window start, rate req/s) of every window finished by ``now_s``, oldest first."""
        out: list[tuple[float, float]] = []
        if self.next_k is None:
            return out
        stale = self.stale_s if self.stale_s is not None else max(3 * self.interval, self.W)
        while True:
            end = (self.next_k + 1) * self.W
            if not (end <= self.latest_at or end + stale <= now_s):
                return out
            req, cov = self.acc.pop(self.next_k, (0.0, 0.0))
            rate = req / cov if cov >= self.min_coverage * self.W else math.nan
            out.append((self.next_k * self.W, rate))
            self.next_k += 1


# ------------------------------------------------------------------------------ decisions

@dataclass
class DecisionRecord:
    """One decision of the log (``remp.policy.v1.Decision``)."""

    id: str
    seq: int
    node: str
    mode: str
    decision: Decision
    switch_id: str = ""
    outcome: str = ""

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {
            "id": self.id, "seq": self.seq, "node": self.node, "mode": self.mode,
            "switch_id": self.switch_id, "outcome": self.outcome,
            "decision": {
                "t_s": d.t_s, "current": str(d.current), "recommended": str(d.recommended),
                "switch": d.switch, "reason": d.reason, "text": d.text,
                "scores": [[str(c.topology), c.expected_goodput, c.switch_cost, c.score]
                           for c in d.scores],
                "gain": d.gain, "threshold": d.threshold, "dwell_left_s": d.dwell_left_s,
                "switches_last_day": d.switches_last_day, "forecaster": d.forecaster,
                "forecast_rps": d.forecast_rps,
            },
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "DecisionRecord":
        d = doc["decision"]
        dec = Decision(
            t_s=float(d["t_s"]), current=Topology.parse(d["current"]),
            recommended=Topology.parse(d["recommended"]), switch=bool(d["switch"]),
            reason=d["reason"], text=d["text"],
            scores=tuple(CandidateScore(Topology.parse(t), g, c, s) for t, g, c, s in d["scores"]),
            gain=float(d["gain"]), threshold=float(d["threshold"]),
            dwell_left_s=float(d["dwell_left_s"]), switches_last_day=int(d["switches_last_day"]),
            forecaster=d["forecaster"], forecast_rps=float(d["forecast_rps"]))
        return cls(doc["id"], int(doc["seq"]), doc["node"], doc["mode"], dec,
                   doc.get("switch_id", ""), doc.get("outcome", ""))

    def reason_line(self) -> str:
        """Numbers and the short text, as the controller shows a recommendation."""
        d = self.decision
        return (f"{d.text} (gain {d.gain:.3g} req vs threshold {d.threshold:.3g}; forecast "
                f"{d.forecast_rps:.3g} req/s by {d.forecaster}; policy decision {self.id})")


@dataclass(frozen=True)
class ForecastView:
    node: str
    forecaster: str
    window_s: float
    starts_s: tuple[float, ...]
    mean: tuple[float, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    observed: tuple[Sample, ...]
    backtest_error: float  # chosen forecaster's rolling MAE / mean; NaN until known


@dataclass
class _Pending:
    """A Reconfigure that got no answer: asked again with the same id, not re-sent blindly."""

    target: Topology
    request_id: str
    retry_at_s: float


@dataclass
class _Node:
    name: str
    view: NodeView
    agg: WindowAggregator
    chooser: Chooser
    policy: AutoPolicy | None = None
    topo_key: tuple[Topology, ...] = ()
    since_s: float | None = None  # newest sample fetched (GetTraffic since)
    observed: deque = field(default_factory=lambda: deque(maxlen=OBSERVED_KEEP))
    last_window_s: float | None = None
    last: DecisionRecord | None = None
    logged_key: tuple | None = None
    recommended: Topology | None = None  # last recommendation recorded at the controller
    pending: _Pending | None = None
    problem: str = ""


class PolicyService:
    """Forecasts and decisions for every node the controller knows; see the module docstring."""

    def __init__(self, profile: Profile, controller: ControllerPort, *, slo: SLO | None = None,
                 config: PolicyConfig = PolicyConfig(), window_s: float = 60.0,
                 default_mode: str = "advisory", store: DecisionStorePort | None = None,
                 retry_backoff_s: float = 30.0, max_decisions: int = 50_000, clock=time.time):
        if default_mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)}, got {default_mode!r}")
        self.profile, self.controller, self.store = profile, controller, store
        self.slo = slo or profile.default_slo
        self.config, self.window_s, self.clock = config, window_s, clock
        self.retry_backoff_s, self.max_decisions = retry_backoff_s, max_decisions
        self.default_mode = default_mode
        self.modes: dict[str, str] = {}  # per-node overrides
        self.nodes: dict[str, _Node] = {}
        self.decisions: deque[DecisionRecord] = deque(maxlen=max_decisions)
        self.seq = 0
        self.instance = uuid.uuid4().hex[:8]  # decision ids stay unique across restarts
        self.ticks = 0
        self.controller_ok = True
        self._scorers: dict[tuple[Topology, ...], Scorer] = {}
        self._lock = asyncio.Lock()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load the decision log and the modes from the store (if any)."""
        if self.store is None:
            return
        try:
            docs, modes = await self.store.load(self.max_decisions)
        except Unavailable as exc:
            log.warning("policy.store_unreachable", error=str(exc), note="starting empty")
            return
        for doc in docs:
            try:
                self.decisions.append(DecisionRecord.from_json(doc))
            except (KeyError, ValueError, TypeError):
                log.warning("policy.store_bad_decision", doc=str(doc)[:200])
        self.seq = max((d.seq for d in self.decisions), default=0)
        if modes.get("*") in MODES:
            self.default_mode = modes["*"]
        self.modes = {k: v for k, v in modes.items() if k != "*" and v in MODES}
        log.info("policy.loaded", decisions=len(self.decisions), default_mode=self.default_mode,
                 overrides=len(self.modes))

    async def run(self, tick_s: float, stop: asyncio.Event) -> None:
        """Tick every ``tick_s`` until ``stop`` is set; a failing tick never ends the loop."""
        while not stop.is_set():
            try:
                await self.tick()
            except RempError as exc:
                log.warning("policy.tick_failed", error=str(exc), code=exc.code.name)
            except Exception as exc:  # noqa: BLE001 - a bug in one tick must not stop the loop
                log.error("policy.tick_crashed", error=repr(exc), exc_info=True)
            try:
                await asyncio.wait_for(stop.wait(), timeout=tick_s)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- modes
    def mode_of(self, node: str) -> str:
        return self.modes.get(node, self.default_mode)

    async def set_mode(self, mode: str, node: str = "") -> str:
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
        if node:
            await self._known(node)
            self.modes[node] = mode
        else:
            self.default_mode, self.modes = mode, {}
        log.info("policy.mode_set", node=node or "*", mode=mode)
        if self.store is not None:
            try:
                await self.store.save_modes({"*": self.default_mode, **self.modes})
            except Unavailable as exc:
                log.warning("policy.store_unreachable", error=str(exc), what="modes")
        return mode

    # ---------------------------------------------------------------- the tick
    async def tick(self, now: float | None = None) -> list[DecisionRecord]:
        """One pass over every node; returns the decisions made (logged or not)."""
        async with self._lock:
            now = self.clock() if now is None else now
            self.ticks += 1
            try:
                views = await self.controller.list_nodes()
            except Unavailable as exc:
                if self.controller_ok:
                    log.warning("policy.controller_unreachable", error=str(exc))
                self.controller_ok = False
                return []
            if not self.controller_ok:
                log.info("policy.controller_back")
            self.controller_ok = True
            out = []
            for v in views:
                n = self._upsert(v)
                try:
                    await self._fetch(n, now)
                except Unavailable as exc:
                    log.warning("policy.traffic_unavailable", node=n.name, error=str(exc))
                    continue
                except NotFound:
                    continue
                rec = await self._tick_node(n, now)
                if rec is not None:
                    out.append(rec)
            return out

    def _upsert(self, v: NodeView) -> _Node:
        n = self.nodes.get(v.name)
        if n is None:
            H = self.config.horizon_windows(self.window_s)
            n = _Node(v.name, v, WindowAggregator(self.window_s), Chooser(self.window_s, H))
            self.nodes[v.name] = n
        n.view = v
        return n

    async def _fetch(self, n: _Node, now: float) -> None:
        samples = await self.controller.traffic(n.name, n.since_s, 0 if n.since_s is None else 5000)
        for s in samples:
            n.agg.add(s)
            n.observed.append(s)
            n.since_s = max(n.since_s or -math.inf, s.at_s)
        for t0, rate in n.agg.complete(now):
            n.chooser.update(t0, rate)
            n.last_window_s = t0

    def _scorer(self, topos: tuple[Topology, ...]) -> Scorer:
        sc = self._scorers.get(topos)
        if sc is None:
            sub = replace(self.profile, curves=tuple(c for c in self.profile.curves
                                                     if c.topology in topos))
            sc = self._scorers[topos] = Scorer(sub, self.slo)
        return sc

    def _ensure_policy(self, n: _Node) -> AutoPolicy | None:
        """The node's AutoPolicy over the candidates it can switch to that the profile knows
        (same world size as now); None, with ``problem`` set, when there is nothing to decide."""
        cur = n.view.observed
        if cur is None:
            n.problem = "the controller knows no observed topology for this node yet"
            return None
        prof = set(self.profile.topologies)
        if cur not in prof:
            n.problem = (f"{cur} is not in profile {self.profile.name!r} "
                         f"({', '.join(map(str, self.profile.topologies))})")
            return None
        cands = set(n.view.candidates) | {cur}
        topos = tuple(t for t in self.profile.topologies
                      if t in cands and t.world_size == cur.world_size)
        n.problem = ""
        if n.policy is None or n.topo_key != topos:
            state = n.policy.state if n.policy is not None else PolicyState(cur)
            n.policy = AutoPolicy(self._scorer(topos), self.window_s, replace(state, current=cur),
                                  self.config, chooser=n.chooser)
            n.topo_key = topos
        elif n.policy.state.current != cur:
            # a switch finished (ours or someone's) or rolled back: the controller is the truth
            n.policy.state = replace(n.policy.state, current=cur)
        return n.policy

    def _decide(self, n: _Node, now: float) -> DecisionRecord | None:
        pol = self._ensure_policy(n)
        if pol is None:
            return None
        d = pol.tick(now, commit=False)
        self.seq += 1  # every decision gets its own id; only some are logged (gaps are fine)
        return DecisionRecord(f"pd-{self.instance}-{self.seq}", self.seq, n.name,
                              self.mode_of(n.name), d)

    async def _tick_node(self, n: _Node, now: float) -> DecisionRecord | None:
        if n.view.health in ("switching", "lost"):
            return None  # decide again once the switch is over / the node is back
        rec = self._decide(n, now)
        if rec is None:
            return None
        acted = False
        if rec.mode == "advisory":
            acted = await self._advise(n, rec)
        elif rec.mode == "auto":
            acted = await self._act(n, rec, now)
        else:
            rec.outcome = "off: no action"
        n.last = rec
        metrics.policy().decided(n, rec, self.window_s, now)
        d = rec.decision
        key = (rec.mode, d.reason, d.current, d.recommended)
        if acted or key != n.logged_key:
            n.logged_key = key
            await self._log(rec)
        return rec

    async def _advise(self, n: _Node, rec: DecisionRecord) -> bool:
        d = rec.decision
        if d.switch and n.recommended != d.recommended:
            target, reason = d.recommended, rec.reason_line()
        elif not d.switch and n.recommended is not None and n.recommended != d.current:
            target, reason = d.current, f"stay: {rec.reason_line()}"  # withdraw the advice
        else:
            rec.outcome = "recommended earlier" if d.switch else ""
            return False
        try:
            await self.controller.record_recommendation(n.name, target, reason, rec.id)
        except (Unavailable, NotFound, InvalidArgument, Unauthenticated) as exc:
            rec.outcome = f"recommendation not recorded ({exc.code.name}): {exc}"
            log.warning("policy.recommend_failed", node=n.name, decision_id=rec.id,
                        error=str(exc))
            return True
        n.recommended = target
        rec.outcome = f"recommended {target}"
        log.info("policy.recommended", node=n.name, decision_id=rec.id, current=str(d.current),
                 recommended=str(target), reason=d.reason)
        return True

    async def _act(self, n: _Node, rec: DecisionRecord, now: float) -> bool:
        d = rec.decision
        if not d.switch:
            return False
        p = n.pending if n.pending is not None and n.pending.target == d.recommended else None
        if p is not None and now < p.retry_at_s:
            rec.outcome = (f"waiting: Reconfigure {p.request_id} got no answer; asking again "
                           f"in {p.retry_at_s - now:.0f} s")
            return False
        rid = p.request_id if p is not None else rec.id
        try:
            r = await self.controller.reconfigure(n.name, d.recommended, rid,
                                                  rec.reason_line())
        except Unavailable as exc:
            n.pending = _Pending(d.recommended, rid, now + self.retry_backoff_s)
            rec.outcome = f"unavailable: {exc} (request {rid}; asked again, same id, after " \
                          f"{self.retry_backoff_s:g} s if still wanted)"
            log.warning("policy.reconfigure_unavailable", node=n.name, decision_id=rec.id,
                        request_id=rid, error=str(exc))
            return True
        except (FailedPrecondition, InvalidArgument, NotFound, Unauthenticated) as exc:
            n.pending = None
            rec.outcome = f"refused ({exc.code.name}): {exc}"
            log.warning("policy.reconfigure_refused", node=n.name, decision_id=rec.id,
                        code=exc.code.name, error=str(exc))
            return True
        n.pending = None
        rec.switch_id = r.switch_id
        rec.outcome = ("noop: already on the target" if r.noop else
                       f"duplicate: request {rid} was accepted earlier" if r.duplicate else
                       "accepted")
        if not r.noop and n.policy is not None:
            n.policy.state = n.policy.state.after(d)  # dwell and budget start now
        log.info("policy.reconfigured", node=n.name, decision_id=rec.id, switch_id=r.switch_id,
                 request_id=rid, target=str(d.recommended), outcome=rec.outcome)
        return True

    async def _log(self, rec: DecisionRecord) -> None:
        self.decisions.append(rec)
        if self.store is not None:
            try:
                await self.store.append(rec.to_json(), self.max_decisions)
            except Unavailable as exc:
                log.warning("policy.store_unreachable", error=str(exc), decision_id=rec.id)

    # ---------------------------------------------------------------- queries
    async def _known(self, node: str) -> _Node:
        if not node:
            raise InvalidArgument("node is required")
        n = self.nodes.get(node)
        if n is None:
            for v in await self.controller.list_nodes():  # Unavailable propagates
                if v.name not in self.nodes:
                    self._upsert(v)
            n = self.nodes.get(node)
        if n is None:
            raise NotFound(f"unknown node {node!r} (the controller's ListNodes shows the "
                           "registered ones)")
        return n

    async def get_recommendation(self, node: str) -> DecisionRecord:
        n = await self._known(node)
        if n.last is not None:
            return n.last
        rec = self._decide(n, self.clock())  # no side effects: not logged, nothing called
        if rec is None:
            raise FailedPrecondition(f"no recommendation for {node}: {n.problem}")
        rec.outcome = "not acted on: computed on request before the first tick"
        return rec

    async def get_forecast(self, node: str, horizon_s: float = 0.0) -> ForecastView:
        if not (horizon_s >= 0 and math.isfinite(horizon_s)):
            raise InvalidArgument("horizon_seconds must be >= 0 (0: the decision horizon)")
        n = await self._known(node)
        H = (self.config.horizon_windows(self.window_s) if horizon_s == 0
             else max(1, int(math.ceil(horizon_s / self.window_s - 1e-9))))
        if H > MAX_FORECAST_WINDOWS:
            raise InvalidArgument(f"horizon_seconds covers {H} windows of {self.window_s:g} s; "
                                  f"at most {MAX_FORECAST_WINDOWS}")
        fc = n.chooser.forecast(H)
        base = n.last_window_s if n.last_window_s is not None else \
            math.floor(self.clock() / self.window_s) * self.window_s - self.window_s
        starts = tuple(base + self.window_s * (h + 1) for h in range(H))
        return ForecastView(node, fc.forecaster, self.window_s, starts,
                            tuple(float(x) for x in fc.mean), tuple(float(x) for x in fc.lower),
                            tuple(float(x) for x in fc.upper), tuple(n.observed),
                            float(fc.backtest_error))

    async def list_decisions(self, node: str, page_size: int, page_token: str
                             ) -> tuple[list[DecisionRecord], str]:
        size = page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise InvalidArgument(f"page_size must be at most {MAX_PAGE}")
        try:
            before = int(page_token) if page_token else math.inf
            if before < 0:
                raise ValueError
        except ValueError:
            raise InvalidArgument("page_token is not one this server returned") from None
        if node and not any(d.node == node for d in self.decisions):
            await self._known(node)  # NOT_FOUND for a node nobody knows
        items: list[DecisionRecord] = []
        for d in reversed(self.decisions):
            if d.seq < before and (not node or d.node == node):
                items.append(d)
                if len(items) > size:
                    break
        nxt = str(items[size - 1].seq) if len(items) > size else ""
        return items[:size], nxt

