"""What the CPU serving benchmarks share: the machine line and how a result leaves the run."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> str:
    return f"{platform.machine()} {platform.node()} cpus={len(os.sched_getaffinity(0))}"


def emit(result: dict, out: Path | None, as_json: bool) -> None:
    """Write ``result`` to ``out`` (indented JSON) and, with ``as_json``, print it as the last
    line (one object)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    if as_json:
        print(json.dumps(result))
