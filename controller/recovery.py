"""Request recovery across hosts (issue 7): drain a node, or recover a lost node's requests.

* Drain (``DrainNode``): the node stops accepting new requests (its OpenAI API answers 503 with
  Retry-After) and every running request moves to another serving node through the source
  agent's ``MigrateRequest`` — the agent decides MIGRATE / RECOMPUTE / ABORT with
  :func:`remp.recovery.decide` from what it measured; the decision is recorded here.
* Loss (lease expiry, e.g. the agent was SIGKILLed): its KV is gone, so each request in the
  node's last heartbeat journal is recomputed on another node (its prompt + the tokens generated
  so far, prefilled again) unless its SLO budget makes even that infeasible.

Every decision is an event (``EVENT_TYPE_REQUEST_RECOVERY``) and a recovery record (Redis,
``ListRecoveries``); each continuation's tokens and text land in the record when it finishes
(``EVENT_TYPE_REQUEST_RECOVERED``). The controller drives the continuations in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from tenacity import (AsyncRetrying, retry_if_exception_type, stop_after_delay,
                      wait_exponential)

from remp import logs
from remp.errors import FailedPrecondition, RempError, Unavailable

from controller.convert import from_json, to_json
from controller.model import (Continuation, EventType, Heartbeat, ImportOrder, MigrateOrder,
                              Recovery, RecoveryAction, RecoveryDecision, RequestInfo)
from controller.store import decode_reg

log = logs.get_logger("remp.controller.recovery")


class RecoveryCoordinator:
    def __init__(self, core):
        self.core = core
        self.store = core.store
        self.agents = core.agents
        self._handed: dict[str, set[str]] = {}  # lost node → request ids already handed out

    # ------------------------------------------------------------------ targets
    async def _targets(self, source: str, wanted: str = "") -> list[tuple[str, str]]:
        """(name, agent address) of the serving nodes other than ``source``, by name."""
        out = []
        for name, h in (await self.store.nodes()).items():
            if name == source or h.get("health") == "lost" or h.get("draining") == "1":
                continue
            if wanted and name != wanted:
                continue
            out.append((name, decode_reg(h).agent_address))
        if wanted and not out:
            raise FailedPrecondition(f"target node {wanted!r} is not a serving node")
        if not out:
            raise FailedPrecondition(f"no other serving node to move {source!r}'s requests to")
        return sorted(out)

    async def _record(self, rec: Recovery, etype: EventType, detail: str) -> None:
        ev = replace(self.core._event(etype, rec.source_node, detail=detail),
                     decision=rec.decision)
        await self.store.put_recovery(rec.request_id, to_json(rec), self.core.clock(), ev)

    # ------------------------------------------------------------------ drain
    async def drain(self, node: str, target: str, slo_s: float, reason: str
                    ) -> list[RecoveryDecision]:
        h, reg = await self.core._node(node)
        if h.get("current"):
            raise FailedPrecondition(f"switch {h['current']} is running on {node}; wait for it")
        targets = await self._targets(node, target)
        try:
            await self.agents.set_draining(reg.agent_address, True)
            reqs = await self.agents.list_requests(reg.agent_address)
        except RempError as err:
            raise Unavailable(f"agent of {node} unreachable: {err.details or err}") from None
        await self.store.set_draining(node, True, self.core._event(
            EventType.NODE_DRAINING, node, detail=reason or "drain"))
        decisions = []
        running = [r for r in reqs if r.status == "RUNNING"]
        log.info("controller.drain", node=node, running=len(running),
                 targets=[t for t, _ in targets])
        for i, r in enumerate(running):
            name, address = targets[i % len(targets)]
            decision = await self._migrate_one(node, reg.agent_address, name, address,
                                               r, slo_s)
            if decision is not None:
                decisions.append(decision)
        return decisions

    async def _migrate_one(self, node: str, src_addr: str, dst: str, dst_addr: str,
                           info: RequestInfo, slo_s: float) -> RecoveryDecision | None:
        events = self.agents.migrate_request(src_addr, MigrateOrder(
            request_id=info.request_id, target_address=dst_addr, target_node=dst,
            slo_budget_seconds=slo_s))
        rec = Recovery(request_id=info.request_id, source_node=node, target_node=dst,
                       cause="drain", status="running", tokens_before=info.output_tokens,
                       at=int(self.core.clock() * 1e9))
        try:
            first = await anext(events, None)
        except RempError as err:
            # finished meanwhile (NOT_FOUND / FAILED_PRECONDITION): nothing to recover
            log.info("controller.drain_skip", request_id=info.request_id, code=err.code.name,
                     detail=err.details or str(err))
            return None
        if first is None or first.decision is None:
            return None
        d = first.decision
        rec.decision = d
        # generated on the source up to the moment it was taken out (exact: engine paused)
        rec.tokens_before = max(0, d.tokens - info.prompt_tokens)
        if d.action == RecoveryAction.ABORT:
            rec.status = "aborted"
        await self._record(rec, EventType.REQUEST_RECOVERY,
                           f"{info.request_id}: RECOVERY_ACTION_{RecoveryAction(d.action).name}"
                           f" → {dst} ({d.reason})")
        if rec.status == "running":
            self.core.spawn(self._follow(rec, _continuation(events)))
        return d

    # ------------------------------------------------------------------ loss
    async def recover_lost_retrying(self, node: str, give_up_s: float = 120.0) -> int:
        """:meth:`recover_lost`, retried while Redis is unreachable (a lost node's requests are
        not dropped because Redis hiccupped at that moment); a request already handed to a
        target is never handed out twice."""
        try:
            async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(Unavailable), reraise=True,
                    wait=wait_exponential(multiplier=0.2, max=5.0),
                    stop=stop_after_delay(give_up_s)):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        log.info("controller.lost_node_recovery_retry", node=node,
                                 attempt=attempt.retry_state.attempt_number)
                    return await self.recover_lost(node)
        except Unavailable as exc:
            log.error("controller.lost_node_recovery_failed", node=node, error=str(exc),
                      detail=f"Redis unreachable for {give_up_s:.0f} s; its journal is kept")
        finally:
            self._handed.pop(node, None)
        return 0

    async def recover_lost(self, node: str) -> int:
        """Recompute the requests in ``node``'s last journal on other nodes."""
        journal = await self.store.inflight(node)
        if not journal:
            return 0
        h = await self.store.node(node) or {}
        if h:  # a late heartbeat is not a dead host: never run a live node's requests twice
            for _ in range(2):
                try:
                    await self.agents.check_serving(decode_reg(h).agent_address, timeout=5.0)
                    log.warning("controller.lease_expired_but_alive", node=node,
                                detail="the agent answers: its requests are not recovered")
                    return 0
                except Unavailable:
                    pass
            if (await self.store.node(node) or {}).get("health") != "lost":
                log.warning("controller.lease_renewed", node=node)  # it heartbeated meanwhile
                return 0
        reqs = from_json(journal, Heartbeat).inflight
        try:
            targets = await self._targets(node)
        except FailedPrecondition as exc:
            log.error("controller.recovery_impossible", node=node, requests=len(reqs),
                      error=str(exc))
            return 0
        handed = self._handed.setdefault(node, set())
        for i, r in enumerate(reqs):
            if r.request_id in handed:
                continue  # handed out by an earlier attempt
            name, address = targets[i % len(targets)]
            tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
            decision = RecoveryDecision(
                request_id=r.request_id, action=RecoveryAction.RECOMPUTE,
                reason="source_lost", tokens=tokens, source_node=node, target_node=name,
                detail="its KV went with the node: re-prefill prompt + generated tokens")
            rec = Recovery(request_id=r.request_id, source_node=node, target_node=name,
                           cause="lost", status="running", tokens_before=len(r.output_token_ids),
                           decision=decision, at=int(self.core.clock() * 1e9))
            await self._record(rec, EventType.REQUEST_RECOVERY,
                               f"{r.request_id}: RECOMPUTE → {name} (source lost)")
            events = self.agents.import_request(address, ImportOrder(
                request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids, max_tokens=r.max_tokens,
                temperature=r.temperature, ignore_eos=r.ignore_eos))
            self.core.spawn(self._follow(rec, _continuation(events)))
            handed.add(r.request_id)
        await self.store.clear_inflight(node)
        log.warning("controller.lost_node_recovering", node=node, requests=len(reqs))
        return len(reqs)

    # ------------------------------------------------------------------ continuations
    async def _follow(self, rec: Recovery, events: AsyncIterator[Continuation]) -> None:
        try:
            async for ev in events:
                rec.token_ids += tuple(ev.token_ids)
                rec.text += ev.text
                if ev.finished:
                    rec.finish_reason = ev.finish_reason
            rec.status = "finished"
        except RempError as err:  # the stream failed: the agent's status, typed
            rec.status, rec.error = "failed", f"{err.code.name}: {err.details or err}"
        except Exception as exc:  # noqa: BLE001 - recorded, never lost silently
            rec.status, rec.error = "failed", f"{type(exc).__name__}: {exc}"
        log.info("controller.request_recovered", request_id=rec.request_id,
                 target=rec.target_node, status=rec.status, tokens=len(rec.token_ids))
        for _ in range(30):
            try:
                await self._record(rec, EventType.REQUEST_RECOVERED,
                                   f"{rec.request_id}: {rec.status} on {rec.target_node} "
                                   f"(+{len(rec.token_ids)} tokens)")
                return
            except Unavailable:
                await asyncio.sleep(1)

    async def list(self, node: str) -> list[Recovery]:
        out = [from_json(t, Recovery) for t in await self.core.reads.recoveries()]
        return [r for r in out if not node or r.source_node == node]


async def _continuation(events: AsyncIterator[Continuation]) -> AsyncIterator[Continuation]:
    """A MigrateRequest / ImportRequest stream's continuation events (the decision dropped)."""
    async for ev in events:
        if ev.decision is None:
            yield ev
