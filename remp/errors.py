"""Typed errors shared by the services, and their one mapping to gRPC status codes.

Domain code raises these; servicers translate with :func:`grpc_status_for` (one table), never by
catching everything into INTERNAL.
"""

from __future__ import annotations

import grpc


class RempError(Exception):
    """Root of every error remp raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable: bool = False


class InvalidArgument(RempError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RempError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RempError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(RempError):
    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class Unauthenticated(RempError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ConfigError(RempError):
    """A start-up setting is wrong; the process exits with a one-line message."""

    code = grpc.StatusCode.INVALID_ARGUMENT


def grpc_status_for(exc: BaseException) -> grpc.StatusCode:
    """The status a servicer returns for ``exc``; unknown exception types are INTERNAL."""
    if isinstance(exc, RempError):
        return exc.code
    return grpc.StatusCode.INTERNAL
