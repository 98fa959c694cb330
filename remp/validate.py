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


# Node labels (``remp agent --label k=v``; a rollout's selector): Kubernetes-like, short.
LABEL_KEY_CHARS, LABEL_VALUE_CHARS = "A-Za-z0-9._/-", "A-Za-z0-9._-"
LABEL_KEY = re.compile(rf"[A-Za-z0-9]([{LABEL_KEY_CHARS}]{{0,61}}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(rf"([A-Za-z0-9]([{LABEL_VALUE_CHARS}]{{0,61}}[A-Za-z0-9])?)?")
MAX_LABELS = 64


def labels(field: str, items) -> dict[str, str]:
    """Node labels as a dict: each key 1-63 characters of [A-Za-z0-9._/-] and each value 0-63
    of [A-Za-z0-9._-], both starting and ending with a letter or digit; at most
    :data:`MAX_LABELS`. ``items``: a mapping, or ``k=v`` strings."""
    pairs = list(items.items()) if hasattr(items, "items") else \
        [tuple(kv.split("=", 1)) if "=" in kv else (kv, None) for kv in items]
    if len(pairs) > MAX_LABELS:
        raise InvalidArgument(f"{field}: at most {MAX_LABELS} labels (got {len(pairs)})")
    out: dict[str, str] = {}
    for k, v in pairs:
        if v is None:
            raise InvalidArgument(f"{field}: {_show(k)} is not key=value")
        if not LABEL_KEY.fullmatch(k):
            raise InvalidArgument(f"{field}: label key {_show(k)}: 1-63 characters of "
                                  f"[{LABEL_KEY_CHARS}], starting and ending with a letter or "
                                  "digit")
        if not LABEL_VALUE.fullmatch(v):
            raise InvalidArgument(f"{field}: label {k}'s value {_show(v)}: at most 63 "
                                  f"characters of [{LABEL_VALUE_CHARS}], starting and ending "
                                  "with a letter or digit")
        if k in out and out[k] != v:
            raise InvalidArgument(f"{field}: label {k} given twice")
        out[k] = v
    return out
