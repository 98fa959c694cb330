"""The request-import contract between the agent and the remp import KV connector inside its
engine: where payloads live, the per-process key, and which ``kv_transfer_params`` the connector
honours. Plain Python (no vLLM): the agent front end and the connector both import it."""

from __future__ import annotations

import hmac
import os
import re

IMPORT_DIR_ENV = "REMP_IMPORT_DIR"  # the agent's private (0700) directory of import payloads
IMPORT_KEY_ENV = "REMP_IMPORT_KEY"  # per agent process; only it and its engine know it
IMPORT_FILE = re.compile(r"import-[0-9a-f]{32}\.safetensors")


def import_params(path: str, tokens: int) -> dict:
    """The ``kv_transfer_params`` the agent submits an import with (the remp import connector)."""
    return {"remp_import": path, "tokens": tokens, "remp_key": os.environ.get(IMPORT_KEY_ENV, "")}


def trusted_import(p: dict) -> bool:
    """Whether ``kv_transfer_params`` are an import the agent itself submitted: its key, a
    generated file name in its import directory. They also arrive from the OpenAI API (any HTTP
    client may send them): the connector ignores every other."""
    key, where = os.environ.get(IMPORT_KEY_ENV, ""), os.environ.get(IMPORT_DIR_ENV, "")
    k, path, tokens = p.get("remp_key"), p.get("remp_import"), p.get("tokens")
    return (bool(key) and bool(where) and isinstance(k, str) and hmac.compare_digest(k, key)
            and isinstance(path, str) and os.path.dirname(path) == where
            and IMPORT_FILE.fullmatch(os.path.basename(path)) is not None
            and type(tokens) is int and tokens > 0)
