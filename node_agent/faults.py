"""Test-only controls, armed through the agent's ``FaultInjection`` gRPC service (which exists only
when the agent runs with its fault-injection setting) and taken by the switch or migration they
match. Kept out of the production messages: ``ExecuteSwitch`` and ``MigrateRequest`` carry no
test fields. Pure: no I/O, no engine.

A control is one-shot. It is armed for an id (a switch id, a request id) or, with an empty id,
for the next switch / migration this agent starts that has no control of its own. Arming the same
id again replaces the earlier control. At most :data:`MAX_ARMED` controls wait at once
(RESOURCE_EXHAUSTED beyond it) so a caller cannot grow the agent's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from remp.errors import InvalidArgument, ResourceExhausted
from remp.transaction import Phase, fault_injectable_phases

MAX_ARMED = 64
MAX_WAIT_RUNNING = 1024  # requests the start gate may wait for
MAX_WAIT_TOKENS = 100_000  # output tokens the migration gate may wait for


@dataclass(frozen=True)
class SwitchFault:
    fail_at: Phase = Phase.UNSPECIFIED
    skip_kv: bool = False
    start_when_running: int = 0

    def check(self) -> SwitchFault:
        if self.fail_at != Phase.UNSPECIFIED and self.fail_at not in fault_injectable_phases():
            raise InvalidArgument(f"cannot inject a fault in {self.fail_at.name} (injectable: "
                                  + ", ".join(p.name for p in fault_injectable_phases()) + ")")
        if not 0 <= self.start_when_running <= MAX_WAIT_RUNNING:
            raise InvalidArgument(f"start_when_running: at most {MAX_WAIT_RUNNING}")
        return self


@dataclass(frozen=True)
class MigrationFault:
    poison_kv: bool = False
    wait_output_tokens: int = 0

    def check(self) -> MigrationFault:
        if not 0 <= self.wait_output_tokens <= MAX_WAIT_TOKENS:
            raise InvalidArgument(f"wait_output_tokens: at most {MAX_WAIT_TOKENS}")
        return self


NO_SWITCH_FAULT = SwitchFault()
NO_MIGRATION_FAULT = MigrationFault()


class ArmedFaults:
    """What is armed and not yet taken, by kind and id ("" = the next one)."""

    def __init__(self, max_armed: int = MAX_ARMED):
        self.max_armed = max_armed
        self._switch: dict[str, SwitchFault] = {}
        self._migration: dict[str, MigrationFault] = {}

    def __len__(self) -> int:
        return len(self._switch) + len(self._migration)

    def _room(self, table: dict, key: str) -> None:
        if key not in table and len(self) >= self.max_armed:
            raise ResourceExhausted(f"{self.max_armed} controls are armed and not taken; "
                                    "Disarm first")

    def arm_switch(self, switch_id: str, fault: SwitchFault) -> int:
        fault.check()
        self._room(self._switch, switch_id)
        self._switch[switch_id] = fault
        return len(self)

    def arm_migration(self, request_id: str, fault: MigrationFault) -> int:
        fault.check()
        self._room(self._migration, request_id)
        self._migration[request_id] = fault
        return len(self)

    def take_switch(self, switch_id: str) -> SwitchFault:
        """The control for this switch: its own, else the 'next switch' one, else none."""
        if switch_id and switch_id in self._switch:
            return self._switch.pop(switch_id)
        return self._switch.pop("", NO_SWITCH_FAULT)

    def take_migration(self, request_id: str) -> MigrationFault:
        if request_id and request_id in self._migration:
            return self._migration.pop(request_id)
        return self._migration.pop("", NO_MIGRATION_FAULT)

    def disarm(self) -> int:
        n = len(self)
        self._switch.clear()
        self._migration.clear()
        return n
