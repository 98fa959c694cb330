"""The switch steps across the engine boundary: what each returns to the front end (frozen
dataclasses) and how a failure travels with its phase.

A worker step that fails reports ``{"rank", "error", "phase"}`` in its reply (``worker_side``
never raises: vLLM's executor would pair the other ranks' replies with the next call); the engine
core joins the ranks' reports into :class:`StepError` with the earliest phase any rank reported
(``core_side``), and answers the front end with :func:`failure` — a reply, not an exception,
because vLLM turns a utility's exception into text. :func:`unwrap` makes it
:class:`EngineStepFailed` again on the front end. Plain Python (no vLLM, no torch): every process
imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from remp.transaction import Phase


class StepError(RuntimeError):
    """Raised inside the engine's processes: a switch step failed in ``phase`` (``None``: the phase
    of the step that ran it)."""

    def __init__(self, phase: Phase | None, message: str):
        super().__init__(message)
        self.phase = phase


class EngineStepFailed(RuntimeError):
    """A switch step failed in the engine, in ``phase`` (for the data path: MIGRATE_KV or
    RELOAD_SHARDS, as the worker that failed reported it). The engine rolls back."""

    def __init__(self, phase: Phase, message: str):
        super().__init__(message)
        self.phase = phase


def phase_name(exc: BaseException) -> str | None:
    """The phase ``exc`` carries, as it crosses a process boundary (``None``: none)."""
    phase = getattr(exc, "phase", None)
    return phase.name if isinstance(phase, Phase) else None


def earliest(names: list[str | None]) -> Phase | None:
    """The earliest phase of the transaction among reported ones (ranks that failed at once in
    MIGRATE_KV and RELOAD_SHARDS: the KV migration)."""
    phases = [Phase[n] for n in names if n]
    return min(phases) if phases else None


def failure(exc: BaseException) -> dict:
    """An engine-core utility's reply for a failed step."""
    return {"failed": {"phase": phase_name(exc), "message": f"{type(exc).__name__}: {exc}"
                       if not isinstance(exc, StepError) else str(exc)}}


def success(result) -> dict:
    return {"result": result}


def unwrap(reply: dict, phase: Phase):
    """The result of a step's reply, or :class:`EngineStepFailed` — in the phase the engine
    reported, else ``phase`` (the step's own)."""
    failed = reply.get("failed")
    if failed is not None:
        raise EngineStepFailed(Phase[failed["phase"]] if failed["phase"] else phase, failed["message"])
    return reply["result"]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BeginResult:
    """PREPARING_WORKERS: the engine is quiescent; what was in it when the switch began."""

    running: int
    waiting: int
    workers: tuple[dict, ...]


@dataclass(frozen=True)
class DataPathResult:
    """MIGRATE_KV ‖ RELOAD_SHARDS: the block pool before / after and every worker's report
    (``kv``: its migration stats; ``kv_window`` / ``reload_window``: when each ran; ``seconds``)."""

    live_blocks: int
    num_blocks: int
    new_num_blocks: int
    displaced: int
    workers: tuple[dict, ...]


@dataclass(frozen=True)
class RebindResult:
    """REBINDING: the engine serves on the new topology."""

    preempted: int
    held: int
    first_held_arrival: float | None
    in_flight: int
    displaced: tuple[str, ...]
    renumbered: int
    num_blocks: int
    workers: tuple[dict, ...]


@dataclass(frozen=True)
class RollbackResult:
    """ROLLING_BACK: the old topology is back, with the layers restored that had moved."""

    restored_layers: tuple[int, ...]
    held: int
    workers: tuple[dict, ...]
