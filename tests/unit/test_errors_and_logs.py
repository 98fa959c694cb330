import json
import subprocess
import sys

import grpc
import pytest

from remp import errors


@pytest.mark.parametrize("exc,code", [
    (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
    (errors.ConfigError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_mapping(exc, code):
    assert errors.grpc_status_for(exc) == code
    assert errors.status_for(exc) == code


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK],
                         ids=lambda c: c.name)
def test_every_status_round_trips_through_a_typed_error(code):
    err = errors.error_from_rpc(_rpc_error(code, f"why: {code.name}"))
    assert isinstance(err, errors.RempError)
    assert errors.status_for(err) == code
    assert str(err) == err.details == f"why: {code.name}"
    if code is not grpc.StatusCode.UNKNOWN:
        assert type(err) is not errors.RempError  # a typed subclass for every real status
    # and back: the class alone maps to the same status
    assert errors.status_for(type(err)("x")) == code


def test_error_from_rpc_keeps_the_typed_classes_callers_catch():
    assert isinstance(errors.error_from_rpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, "down")),
                      errors.Unavailable)
    nf = errors.error_from_rpc(_rpc_error(grpc.StatusCode.NOT_FOUND, ""))
    assert isinstance(nf, errors.NotFound) and str(nf) == "NOT_FOUND" and nf.details == ""
    assert errors.error_from_rpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, "x")).retryable


def _log_line(fmt: str) -> str:
    code = ("from remp import logs; logs.configure(node='n7'); "
            "logs.get_logger().info('hello', switch_id='s1')")
    env = {"REMP_LOG_FORMAT": fmt, "PATH": ""}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stderr.strip()


def test_json_logs_carry_node():
    rec = json.loads(_log_line("json"))
    assert rec["node"] == "n7" and rec["event"] == "hello" and rec["switch_id"] == "s1"
    assert rec["level"] == "info" and "timestamp" in rec


def test_console_logs_carry_node():
    line = _log_line("console")
    assert "hello" in line and "node=n7" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)
