"""Hypothesis strategies for any protobuf request message (from its descriptor), and a driver that
calls any RPC of a service with them: what a hostile or broken client can send.

The property every service keeps: bad input answers a deliberate status — never UNKNOWN or
INTERNAL (an unhandled exception), never a hang — and the service stays healthy."""

from __future__ import annotations

import time

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

NASTY_STRINGS = ["", "../../../../etc/passwd", "a" * 100_000, "\x00", "TP1PP2", "local", "x\ny",
                 "\u202e\u0000", "' OR 1=1 --", "%s%n", "node/../../x", "t5 t6 t7", "*", "0"]
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

_INTS = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1),
    F.TYPE_SFIXED32: (-2**31, 2**31 - 1), F.TYPE_INT64: (-2**63, 2**63 - 1),
    F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _int(lo: int, hi: int):
    edge = [v for v in (lo, hi, 0, 1, -1, 2, 4, 8, 1024, 2**31 - 1, 2**32 - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edge), st.integers(lo, hi), st.integers(max(lo, -8),
                                                                             min(hi, 4096)))


def scalar(f):
    t = f.type
    if t in _INTS:
        return _int(*_INTS[t])
    if t == F.TYPE_STRING:
        return st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=24))
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=512), st.sampled_from([b"", b"\x00" * 4096,
                                                                   b"\xff" * 70_000]))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == F.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == F.TYPE_ENUM:
        nums = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(nums), st.integers(-5, 1000))
    raise NotImplementedError(t)


def message(desc, depth: int = 0):
    """Random instances of the message type ``desc`` (nested messages to depth 3)."""
    cls = message_factory.GetMessageClass(desc)
    fields = {}
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            if depth >= 3 or f.message_type.GetOptions().map_entry:
                continue
            inner = message(f.message_type, depth + 1)
        else:
            inner = scalar(f)
        is_repeated = getattr(f, "is_repeated", None)
        repeated = is_repeated if isinstance(is_repeated, bool) else f.label == F.LABEL_REPEATED
        fields[f.name] = (st.lists(inner, max_size=6 if depth == 0 else 2) if repeated else inner)

    def build(values: dict):
        m = cls()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            attr = getattr(m, name)
            if isinstance(v, list):
                if f.type == F.TYPE_MESSAGE:
                    for item in v:
                        attr.add().CopyFrom(item)
                else:
                    attr.extend(v)
            elif f.type == F.TYPE_MESSAGE:
                attr.CopyFrom(v)
            else:
                setattr(m, name, v)
        return m

    return st.fixed_dictionaries({}, optional=fields).map(build)


def methods(service_desc):
    return sorted(service_desc.methods, key=lambda m: m.name)


LONG_LIVED = {"Watch"}  # streams that stay open by design: a deadline there is not a hang


def call(channel: grpc.Channel, service_desc, method, req, timeout: float = 20.0,
         max_events: int = 50) -> grpc.StatusCode:
    """Call ``method`` with ``req`` (a message, or a list of them for client streaming); read at
    most ``max_events`` responses; the final status (OK when it ended or was read enough)."""
    if method.name in LONG_LIVED:
        timeout = min(timeout, 1.5)
    path = f"/{service_desc.full_name}/{method.name}"
    ser = lambda m: m.SerializeToString()  # noqa: E731
    de = message_factory.GetMessageClass(method.output_type).FromString
    kinds = (method.client_streaming, method.server_streaming)
    t0 = time.monotonic()
    try:
        if kinds == (False, False):
            channel.unary_unary(path, ser, de)(req, timeout=timeout)
        elif kinds == (False, True):
            it = channel.unary_stream(path, ser, de)(req, timeout=timeout)
            for i, _ in enumerate(it):
                if i >= max_events:
                    it.cancel()
                    break
        elif kinds == (True, True):
            it = channel.stream_stream(path, ser, de)(iter(req), timeout=timeout)
            for i, _ in enumerate(it):
                if i >= max_events:
                    it.cancel()
                    break
        else:
            channel.stream_unary(path, ser, de)(iter(req), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.CANCELLED:
            return grpc.StatusCode.OK
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and method.name in LONG_LIVED:
            return code
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 >= timeout - 0.5:
            raise AssertionError(f"{method.name} hung for {timeout} s on {req!r:.300}") from None
        if code in BAD_CODES:
            raise AssertionError(f"{method.name} answered {code.name}: {exc.details()!r} for "
                                 f"{str(req)[:300]!r}") from None
        return code
    return grpc.StatusCode.OK


def request_strategy(method):
    m = message(method.input_type)
    return st.lists(m, max_size=3) if method.client_streaming else m
