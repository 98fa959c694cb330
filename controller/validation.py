"""Bounds on every string a caller sends the controller, checked before it becomes a Redis key,
a metric label or a log line (pure: no I/O).

:func:`check` walks a request message (nested messages and repeated fields included) and
raises :class:`InvalidArgument` naming the first field out of bounds, e.g.
``request_id: at most 128 characters of [A-Za-z0-9._:-] (got 100000 characters: 'rrrr…')``.
Each string field has a rule by name (:data:`RULES`, per message where a name means something
else); a string field with no rule is printable text of at most 256 characters, so a field added
to the protos later is bounded too. Required-ness stays with the domain code ("node is
required"): here the empty string always passes.

The in-flight journal of a heartbeat is not refused for an odd request id (the ids come from
the OpenAI clients' ``X-Request-Id``, and refusing the heartbeat would mark a healthy node
LOST): :func:`journal_entries` keeps the entries that are usable and within the size budget.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from remp.errors import InvalidArgument
from remp.validate import LABEL_KEY_CHARS, LABEL_VALUE_CHARS, MAX_LABELS
from remp.validate import LABEL_KEY as LABEL_KEY_RE
from remp.validate import LABEL_VALUE as LABEL_VALUE_RE

MAX_REPEATED = 4096  # entries of any repeated string or message field
JOURNAL_MAX_ENTRIES = 4096
JOURNAL_MAX_TOKENS = 2_000_000  # prompt + output token ids kept per heartbeat journal
JOURNAL_ID = re.compile(r"[!-~]{1,256}")  # printable ASCII, no spaces (X-Request-Id-like)


@dataclass(frozen=True)
class Rule:
    """At most ``max_len`` characters, each matching ``chars`` (None: printable text, i.e.
    no control characters, no line breaks); ``whole``, when given, must match the value."""

    max_len: int
    chars: str | None  # a regex character class, e.g. "[A-Za-z0-9._:-]"
    whole: str | None = None
    note: str = ""

    def __post_init__(self):
        pat = self.whole or (f"{self.chars}*" if self.chars else None)
        object.__setattr__(self, "_re", re.compile(pat) if pat else None)

    @property
    def text(self) -> str:
        kind = f"characters of {self.chars}" if self.chars else "printable characters"
        return f"at most {self.max_len} {kind}{self.note}"

    def ok(self, value: str) -> bool:
        if len(value) > self.max_len:
            return False
        if not value:
            return True
        if self._re is None:
            return value.isprintable()
        return self._re.fullmatch(value) is not None

    def check(self, where: str, value: str) -> None:
        if not self.ok(value):
            raise InvalidArgument(f"{where}: {self.text} (got {_show(value)})")


def _show(value: str) -> str:
    if len(value) <= 40:
        return repr(value)
    return f"{len(value)} characters: {value[:16]!r}…"


NODE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")

ID = Rule(128, "[A-Za-z0-9._:-]", whole=r"[A-Za-z0-9][A-Za-z0-9._:-]*",
          note=", starting with a letter or digit")
NODE = Rule(253, "[A-Za-z0-9._-]", whole=NODE_NAME.pattern,
            note=", starting and ending with a letter or digit")
ADDRESS = Rule(256, r"[A-Za-z0-9._:/\[\]-]", note=" (host:port)")
URL = Rule(256, r"[A-Za-z0-9._~:/\[\]%@-]", whole=r"https?://[A-Za-z0-9._~:/\[\]%@-]+",
           note=", an http:// or https:// URL")
NAME = Rule(128, "[A-Za-z0-9._+-]")
HOSTNAME = Rule(253, "[A-Za-z0-9._-]")
DEVICE = Rule(64, "[A-Za-z0-9._:-]", note=' (a device like "cpu" or "cuda:3")')
PAGE_TOKEN = Rule(12, "[0-9]", note=" (a token this server returned)")
REASON = Rule(1024, None)
PATH = Rule(4096, None)
LABEL = Rule(256, None)
DEFAULT = Rule(256, None)
LABEL_KEY = Rule(63, f"[{LABEL_KEY_CHARS}]", whole=LABEL_KEY_RE.pattern,
                 note=", starting and ending with a letter or digit")
LABEL_VALUE = Rule(63, f"[{LABEL_VALUE_CHARS}]", whole=LABEL_VALUE_RE.pattern,
                   note=", starting and ending with a letter or digit")
TOPOLOGY_KEY = Rule(16, "[TP0-9]", whole=r"TP[1-9][0-9]{0,3}PP[1-9][0-9]{0,3}",
                    note=", a topology like TP2PP1")
# an Event.id (WatchRequest.after_id): a Redis stream id; its range (each part at most
# 2^64-1) is checked by controller.watch.stream_id
STREAM_ID = Rule(41, "[0-9-]", whole=r"[0-9]{1,20}-[0-9]{1,20}",
                 note=", a Redis stream id <ms>-<seq> as Event.id carries it")
SKIP = None  # checked elsewhere (see journal_entries)

# field name → rule; (message full name, field name) first where a name means something else
RULES: dict = {
    "node": NODE,
    "target_node": NODE,
    "request_id": ID,
    "switch_id": ID,
    "decision_id": ID,
    "reason": REASON,
    "agent_address": ADDRESS,
    "http_address": URL,
    "page_token": PAGE_TOKEN,
    "hostname": HOSTNAME,
    "device_type": NAME,
    "device": DEVICE,
    "device_names": LABEL,
    "path": PATH,
    "architecture": NAME,
    "dtype": NAME,
    "nodes": NODE,
    "rollout_id": ID,
    "after_id": STREAM_ID,
    ("remp.controller.v1.InflightRequest", "request_id"): SKIP,
}
# map field name → (key rule, value rule: None when the values are not strings) and the most
# entries; a map not listed takes DEFAULT for both and MAX_MAP entries
MAP_RULES: dict = {
    "labels": (LABEL_KEY, LABEL_VALUE, MAX_LABELS),
    "capacity_rps": (TOPOLOGY_KEY, None, 256),
}
MAX_MAP = 256


def rule_for(message_name: str, field: str):
    key = (message_name, field)
    if key in RULES:
        return RULES[key]
    return RULES.get(field, DEFAULT)


def check(msg: Message, prefix: str = "") -> None:
    """Raise :class:`InvalidArgument` for the first string field of ``msg`` (recursively) that
    is out of bounds, or a repeated field with more than :data:`MAX_REPEATED` entries."""
    name = msg.DESCRIPTOR.full_name
    for fd, value in msg.ListFields():
        where = f"{prefix}{fd.name}"
        repeated = fd.is_repeated
        if fd.type == FieldDescriptor.TYPE_STRING:
            rule = rule_for(name, fd.name)
            if rule is None:
                continue
            if repeated:
                _count(where, value)
                for i, v in enumerate(value):
                    rule.check(f"{where}[{i}]", v)
            else:
                rule.check(where, value)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            if fd.message_type.full_name == "google.protobuf.Timestamp" and not repeated:
                _timestamp(where, value)
                continue
            if fd.message_type.GetOptions().map_entry:
                _map(where, fd, value)
                continue
            if repeated:
                if fd.message_type.full_name != "remp.controller.v1.InflightRequest":
                    _count(where, value)
                for i, v in enumerate(value):
                    check(v, f"{where}[{i}].")
            else:
                check(value, f"{where}.")


TS_MIN_S, TS_MAX_S = -62135596800, 253402300799  # 0001-01-01 .. 9999-12-31 (protobuf's range)


def _timestamp(where: str, ts) -> None:
    if not (TS_MIN_S <= ts.seconds <= TS_MAX_S and 0 <= ts.nanos <= 999_999_999):
        raise InvalidArgument(f"{where}: not a valid timestamp (seconds {ts.seconds}, nanos "
                              f"{ts.nanos}; years 0001-9999)")


def _map(where: str, fd, value) -> None:
    key_rule, value_rule, most = MAP_RULES.get(fd.name, (DEFAULT, DEFAULT, MAX_MAP))
    if len(value) > most:
        raise InvalidArgument(f"{where}: at most {most} entries (got {len(value)})")
    strings = fd.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_STRING
    for k in sorted(value):
        if not k:
            raise InvalidArgument(f"{where}: a key is empty")
        key_rule.check(f"{where} key", k)
        if strings and value_rule is not None:
            value_rule.check(f"{where}[{k}]", value[k])


def _count(where: str, value: Sequence) -> None:
    if len(value) > MAX_REPEATED:
        raise InvalidArgument(f"{where}: at most {MAX_REPEATED} entries (got {len(value)})")


def journal_entries(entries: Iterable) -> tuple[list, int]:
    """The in-flight entries to keep (a usable request id, within :data:`JOURNAL_MAX_ENTRIES`
    entries and :data:`JOURNAL_MAX_TOKENS` token ids in all, in order) and how many were
    dropped. Dropped entries cannot be recovered if the node is lost; the heartbeat itself is
    still accepted."""
    kept, dropped, tokens = [], 0, 0
    for e in entries:
        n = len(e.prompt_token_ids) + len(e.output_token_ids)
        if (len(kept) >= JOURNAL_MAX_ENTRIES or tokens + n > JOURNAL_MAX_TOKENS
                or not JOURNAL_ID.fullmatch(e.request_id)):
            dropped += 1
            continue
        kept.append(e)
        tokens += n
    return kept, dropped
