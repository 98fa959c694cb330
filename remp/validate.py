"""Bounds on the strings callers send, applied before a string becomes a Redis key, a file path,
a metric label or a log line. Pure; raises :class:`remp.errors.InvalidArgument` with a message
that names the field and the rule (never echoes more than a short prefix of the value)."""

from __future__ import annotations

import re

from remp.errors import InvalidArgument

NAME_CHARS = "A-Za-z0-9._:-"
_NAME = re.compile(rf"[A-Za-z0-9][{NAME_CHARS}]*")
MAX_NAME = 128
MAX_TEXT = 1024


def _show(value: str) -> str:
    return repr(value[:32] + ("…" if len(value) > 32 else ""))


def name(field: str, value: str, *, required: bool = False, max_len: int = MAX_NAME) -> str:
    """An identifier (node, switch id, request id …): ``[A-Za-z0-9][A-Za-z0-9._:-]*``, at most
    ``max_len`` characters; empty only when not ``required``."""
    if not value:
        if required:
            raise InvalidArgument(f"{field} is required")
        return value
    if len(value) > max_len or not _NAME.fullmatch(value):
        raise InvalidArgument(f"{field}: at most {max_len} characters of [{NAME_CHARS}], "
                              f"starting with a letter or digit (got {_show(value)}, "
                              f"{len(value)} characters)")
    return value


def text(field: str, value: str, *, max_len: int = MAX_TEXT) -> str:
    """Free text (a reason): printable, at most ``max_len`` characters."""
    if len(value) > max_len or not value.isprintable():
        raise InvalidArgument(f"{field}: at most {max_len} printable characters "
                              f"(got {len(value)} characters)")
    return value
