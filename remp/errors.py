"""Typed errors shared by the services, and their one mapping to and from gRPC status codes.

Domain code raises these; servicers translate with :func:`status_for` (the ``rpc_errors``
decorator), never by catching everything into INTERNAL. Clients turn a failed call back into a
typed error with :func:`error_from_rpc` (status and details kept) instead of reading
``exc.code()`` by hand. Each class's ``code`` is the table, read in both directions.
"""

from __future__ import annotations

import grpc


class RempError(Exception):
    """Root of every error remp raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable: bool = False
    details: str = ""  # the peer's status details, when made by error_from_rpc


class InvalidArgument(RempError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RempError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RempError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(RempError):
    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class NotLeader(Unavailable):
    """A write sent to a controller that does not lead (controller HA): retry at the leader,
    whose address the message and the ``remp-leader`` trailing metadata carry."""

    def __init__(self, leader: str = ""):
        super().__init__(f"not the leader; leader at {leader}" if leader else
                         "not the leader; no leader elected yet, retry shortly")
        self.leader = leader


class Unauthenticated(RempError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RempError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(RempError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class DeadlineExceeded(RempError):
    """The call ran out of time: whether the peer acted on it is unknown (ask, don't resend)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RempError):
    code = grpc.StatusCode.CANCELLED


class AlreadyExists(RempError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(RempError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(RempError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(RempError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(RempError):
    code = grpc.StatusCode.INTERNAL


class DataLoss(RempError):
    code = grpc.StatusCode.DATA_LOSS


class ConfigError(RempError):
    """A start-up setting is wrong; the process exits with a one-line message."""

    code = grpc.StatusCode.INVALID_ARGUMENT


# status → the typed error a client raises for it (ConfigError is local-only: not listed)
_FROM_STATUS: dict[grpc.StatusCode, type[RempError]] = {
    cls.code: cls for cls in (
        RempError, InvalidArgument, NotFound, FailedPrecondition, Unavailable, Unauthenticated,
        PermissionDenied, ResourceExhausted, DeadlineExceeded, Cancelled, AlreadyExists, Aborted,
        OutOfRange, Unimplemented, Internal, DataLoss)
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status a servicer returns for ``exc``; unknown exception types are INTERNAL."""
    if isinstance(exc, RempError):
        return exc.code
    return grpc.StatusCode.INTERNAL


grpc_status_for = status_for  # the older name


# an UNAVAILABLE whose details say one of these never reached the server (no connection made)
NOT_SENT = ("failed to connect", "dns resolution failed", "name resolution")


def not_sent(err: "RempError") -> bool:
    """Whether a failed call (typed by :func:`error_from_rpc`) never left this process: no
    connection to the server could be made, so the server did nothing."""
    d = (getattr(err, "details", "") or str(err)).lower()
    return err.code == grpc.StatusCode.UNAVAILABLE and any(t in d for t in NOT_SENT)


def error_from_rpc(exc: grpc.RpcError) -> RempError:
    """The typed error for a failed call: its class is the status (RempError itself for
    UNKNOWN or a status this table lacks), its message the status details (or the status name
    when there are none). Raise it ``from None``; ``.code`` and ``.details`` stay readable."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else None) or ""
    err = _FROM_STATUS.get(code, RempError)(details or code.name)
    if type(err).code != code:  # only where the table lacks the status (e.g. OK)
        err.code = code
    err.details = details
    return err
