"""The port through which the controller's core reaches node agents: the calls it makes, over
:mod:`controller.model` dataclasses. :class:`controller.agents.AgentClients` implements it over
gRPC; ``tests/unit/test_controller_core.py`` drives the core with an in-memory one.

Errors are typed (:mod:`remp.errors`): an agent that does not answer in time is
:class:`~remp.errors.Unavailable`; any other failed call is the agent's own answer as the typed
error of its status (``details`` kept), never a transport exception.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from controller.model import (AbortResult, AgentDescription, Continuation, ImportOrder,
                              MigrateOrder, RequestInfo, SwitchOrder, SwitchProgress,
                              SwitchRecord)


class AgentPort(Protocol):
    async def check_serving(self, address: str, timeout: float = 2.0) -> None:
        """Returns when the agent answers SERVING in time; otherwise Unavailable."""

    def connected(self, address: str) -> bool:
        """Whether a live connection to the agent is held (no health check needed first)."""

    async def describe(self, address: str) -> AgentDescription: ...

    def execute_switch(self, address: str, order: SwitchOrder) -> AsyncIterator[SwitchProgress]:
        """The switch's phases as the agent runs them; the last carries the record. A failed
        stream raises the typed error of its status while iterating."""

    async def get_switch(self, address: str, switch_id: str) -> SwitchRecord | None:
        """The agent's record of the switch, or None when it has never seen that id."""

    async def abort_switch(self, address: str, switch_id: str, reason: str) -> AbortResult: ...

    async def set_draining(self, address: str, draining: bool) -> None: ...

    async def list_requests(self, address: str) -> list[RequestInfo]: ...

    def migrate_request(self, address: str, order: MigrateOrder) -> AsyncIterator[Continuation]:
        """The source agent's decision (first event), then the continuation's tokens."""

    def import_request(self, address: str, order: ImportOrder) -> AsyncIterator[Continuation]:
        """Recompute a request on this agent; the continuation's tokens."""
