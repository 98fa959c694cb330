"""``remp profile``: measure the prefill table the recovery decision reads (remp/recovery.py).

    remp profile --agent HOST:PORT --out prefill.json [--lengths 16,64,256] [--repeats 5]
    remp profile --http URL --out prefill.json ...          (no gRPC: no topology/model facts)

Against a running node agent's OpenAI API, on an otherwise idle engine, one request at a time:
for each prompt length, ``repeats`` completions of ``max_tokens=1`` whose prompts are random
token ids (exactly that many tokens, no tokenizer in the way; random, so the prefix cache never
hits: a hit needs a whole identical block), streamed, after one unrecorded warm-up. Each sample
has two numbers: the engine's own prefill time of that request (vLLM's
``vllm:request_prefill_time_seconds``: scheduled → first token; read from /metrics around each
request) and the client's time to first token (that plus queueing, HTTP and streaming). ``--source`` picks which one the table holds
(default ``engine``: the prefill work itself, as C_mig = bytes / bandwidth is the transfer
itself); the other is kept in the metadata.

The table is ``PrefillTable.fit`` of the samples (median per length, made monotone) with the
model, topology, host and the raw numbers in its metadata; the file is
``PrefillTable.dumps``/``loads`` JSON. It describes the topology the agent serves now; switch it
first (``remp reconfigure``) to measure another. The arithmetic (lengths, prompts, histogram
parsing, the table) is pure; the rest is I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from remp.recovery import PrefillTable, crossover_bandwidth

PREFILL_METRIC = "vllm:request_prefill_time_seconds"
DEFAULT_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SOURCES = ("engine", "ttft")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ProfileConfig:
    lengths: tuple[int, ...] = ()   # empty: DEFAULT_LENGTHS that fit, plus the longest that fits
    repeats: int = 5
    source: str = "engine"          # what the table's seconds are: "engine" or "ttft"
    model: str = "tiny"
    seed: int = 0
    vocab_size: int = 0             # 0: from the agent (Describe), else 2048
    max_model_len: int = 0          # 0: from the agent (Describe), else unbounded

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if any(n < 1 for n in self.lengths):
            raise ValueError("prompt lengths must be >= 1")
        if self.source not in SOURCES:
            raise ValueError(f"--source must be one of {', '.join(SOURCES)}")


@dataclass(frozen=True)
class Sample:
    tokens: int                     # prompt tokens the engine reported (usage.prompt_tokens)
    ttft_s: float                   # client: request sent -> first token
    engine_s: float | None = None   # engine: scheduled -> first token (vLLM's prefill time)


# ----------------------------------------------------------------------------- pure


def lengths_for(requested: tuple[int, ...], max_model_len: int) -> list[int]:
    """The prompt lengths to measure: each must leave room for one generated token. Without a
    request: the default ladder up to the limit plus the longest prompt the engine accepts."""
    limit = max_model_len - 1 if max_model_len > 0 else None
    if requested:
        bad = [n for n in requested if limit is not None and n > limit]
        if bad:
            raise ValueError(f"prompt lengths {bad} do not fit max_model_len {max_model_len} "
                             f"(at most {limit})")
        out = sorted(set(requested))
    else:
        out = [n for n in DEFAULT_LENGTHS if limit is None or n <= limit]
        if limit is not None and (not out or out[-1] < limit):
            out.append(limit)
    if len(out) < 2:
        raise ValueError("need at least two distinct prompt lengths")
    return out


def prompt_ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    """``n`` random token ids, avoiding the first ids (special tokens in most vocabularies)."""
    lo = min(3, vocab_size - 1)
    return [rng.randrange(lo, vocab_size) for _ in range(n)]


def histogram_sum_count(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of a Prometheus histogram summed over its label sets; None when absent."""
    tot_s = tot_c = 0.0
    seen = False
    for line in text.splitlines():
        if line.startswith(f"{name}_sum") or line.startswith(f"{name}_count"):
            key, _, val = line.rpartition(" ")
            try:
                v = float(val)
            except ValueError:
                continue
            seen = True
            if key.startswith(f"{name}_sum"):
                tot_s += v
            else:
                tot_c += v
    return (tot_s, tot_c) if seen else None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype: str) -> int:
    """K and V of every layer for one token (all ranks together), 0 when unknown."""
    return 2 * num_layers * num_kv_heads * head_size * DTYPE_BYTES.get(dtype, 0)


def build_table(samples: list[Sample], source: str, meta: dict) -> PrefillTable:
    """The monotone table (``PrefillTable.fit``: median per length, made monotone) of the
    samples' engine prefill seconds (``source="engine"``) or client TTFT (``"ttft"``), with the
    raw numbers per length in ``meta["measurements"]``."""
    if source == "engine" and any(s.engine_s is None for s in samples):
        raise RuntimeError(f"the engine did not report {PREFILL_METRIC} for every request "
                         "(use --source ttft)")
    by_len: dict[int, list[Sample]] = {}
    for s in samples:
        by_len.setdefault(s.tokens, []).append(s)
    raw = []
    for n in sorted(by_len):
        tt = sorted(s.ttft_s for s in by_len[n])
        en = sorted(s.engine_s for s in by_len[n] if s.engine_s is not None)
        raw.append({"tokens": n, "n": len(tt), "ttft_median_s": statistics.median(tt),
                    "ttft_min_s": tt[0], "ttft_max_s": tt[-1],
                    "engine_median_s": statistics.median(en) if en else None,
                    "engine_min_s": en[0] if en else None,
                    "engine_max_s": en[-1] if en else None})
    return PrefillTable.fit([(s.tokens, s.engine_s if source == "engine" else s.ttft_s)
                             for s in samples],
                            {**meta, "seconds_source": source, "measurements": raw})


def summary_lines(table: PrefillTable) -> list[str]:
    per_tok = table.meta.get("kv_bytes_per_token") or 0
    lines = []
    for (n, s), m in zip(table.points, table.meta.get("measurements", [])):
        eng = m.get("engine_median_s")
        line = (f"{n:6d} tokens: {s * 1e3:8.2f} ms ({m['n']} samples; TTFT median "
                f"{m['ttft_median_s'] * 1e3:.2f} ms"
                + (f", engine prefill median {eng * 1e3:.2f} ms" if eng is not None else "") + ")")
        if per_tok:
            line += (f"; migrating its {n * per_tok / 2**20:.2f} MiB of KV is cheaper above "
                     f"{crossover_bandwidth(n * per_tok, s) / 1e6:.1f} MB/s")
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------- I/O


async def _describe(agent: str) -> dict:
    import grpc

    from remp.grpc_util import channel_options
    from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

    async with grpc.aio.insecure_channel(agent, options=channel_options()) as ch:
        try:
            d = await node_agent_pb2_grpc.NodeAgentStub(ch).Describe(
                node_agent_pb2.DescribeRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise ConnectionError(f"agent {agent} unreachable: {exc.code().name} "
                                  f"{exc.details() or ''}") from None
    m = d.model
    return {"node": d.node, "http": d.http_address,
            "topology": f"TP{d.topology.tp}PP{d.topology.pp}",
            "host": {"hostname": d.host.hostname, "device_type": d.host.device_type,
                     "cpu_cores": d.host.cpu_cores, "device_count": d.host.device_count},
            "model": {"path": m.path, "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
                      "head_size": m.head_size, "hidden_size": m.hidden_size, "dtype": m.dtype,
                      "vocab_size": m.vocab_size, "max_model_len": m.max_model_len},
            "vllm_version": d.vllm_version,
            "kv_bytes_per_token": kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_size,
                                                     m.dtype)}


async def _prefill_sum_count(client: httpx.AsyncClient, http: str) -> tuple[float, float] | None:
    try:
        r = await client.get(f"{http}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return histogram_sum_count(r.text, PREFILL_METRIC) if r.status_code == 200 else None


async def first_token(client: httpx.AsyncClient, http: str, model: str, ids: list[int]) -> Sample:
    """Stream one ``max_tokens=1`` completion of the token ids; time to the first token."""
    sent = time.perf_counter()
    first = None
    prompt_tokens = None
    async with client.stream("POST", f"{http}/v1/completions", json={
            "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed: HTTP {r.status_code} "
                               f"{(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    if first is None:
        raise RuntimeError("no token streamed")
    return Sample(prompt_tokens if prompt_tokens is not None else len(ids), first - sent)


async def _timed(client: httpx.AsyncClient, http: str, model: str, ids: list[int]) -> Sample:
    """One sample: the completion, then the engine's prefill time of it from /metrics (the
    histogram is updated just after the response ends: wait for its count to move, <= 2 s)."""
    before = await _prefill_sum_count(client, http)
    s = await first_token(client, http, model, ids)
    if before is None:
        return s
    deadline = time.monotonic() + 2.0
    after = await _prefill_sum_count(client, http)
    while after is not None and after[1] <= before[1] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        after = await _prefill_sum_count(client, http)
    if after is None or after[1] != before[1] + 1:
        return s  # not exactly our request: no engine number for this sample
    return Sample(s.tokens, s.ttft_s, after[0] - before[0])


async def measure(http: str, cfg: ProfileConfig, lengths: list[int], vocab: int,
                  log=None) -> list[Sample]:
    """``cfg.repeats`` samples per length, one request at a time, after one warm-up each."""
    rng = random.Random(cfg.seed)
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=300) as client:
        await first_token(client, http, cfg.model, prompt_ids(8, vocab, rng))  # warm the path
        for n in lengths:
            await first_token(client, http, cfg.model, prompt_ids(n, vocab, rng))  # warm-up
            got = [await _timed(client, http, cfg.model, prompt_ids(n, vocab, rng))
                   for _ in range(cfg.repeats)]
            if any(s.tokens != n for s in got):
                raise RuntimeError(f"asked for {n}-token prompts, the engine counted "
                                   f"{sorted({s.tokens for s in got})}")
            samples += got
            if log:
                eng = [s.engine_s for s in got if s.engine_s is not None]
                log(f"{n} tokens: TTFT median {statistics.median(s.ttft_s for s in got) * 1e3:.2f}"
                    f" ms" + (f", engine prefill median {statistics.median(eng) * 1e3:.2f} ms"
                              if eng else ""))
    return samples


async def profile(agent: str | None, http: str | None, cfg: ProfileConfig) -> PrefillTable:
    facts = await _describe(agent) if agent else {}
    http = (http or facts.get("http", "")).rstrip("/")
    if not http:
        raise ValueError("no OpenAI API address: give --http or an --agent that reports one")
    model = facts.get("model", {})
    vocab = cfg.vocab_size or model.get("vocab_size") or 2048
    max_len = cfg.max_model_len or model.get("max_model_len") or 0
    lengths = lengths_for(cfg.lengths, max_len)
    t0 = time.time()
    samples = await measure(http, cfg, lengths, vocab,
                            log=lambda m: print(f"remp profile: {m}", file=sys.stderr))
    meta = {**facts, "source": "remp profile", "http": http,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "measured_on": socket.gethostname(),
            "method": (f"max_tokens=1 streamed completions of random token-id prompts, one at "
                       f"a time, {cfg.repeats} per length after one warm-up; engine = "
                       f"{PREFILL_METRIC} of each request, ttft = client time to first token; "
                       f"seconds = the median of the source, made monotone (PrefillTable.fit)"),
            "repeats": cfg.repeats, "seed": cfg.seed}
    return build_table(samples, cfg.source, meta)


# ----------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure prefill seconds by prompt length on a live agent "
                       "(the recovery decision's table)",
                       description="Measure prefill time for several prompt lengths against a "
                       "running agent's OpenAI API (idle engine, one request at a time) and write "
                       "the prefill table JSON that remp/recovery.py loads.")
    p.add_argument("--agent", help="node agent gRPC host:port (model facts, topology, API address)")
    p.add_argument("--http", help="OpenAI API base URL (default: what the agent reports)")
    p.add_argument("--out", required=True, type=Path, help="prefill table JSON to write")
    p.add_argument("--lengths", help="comma-separated prompt lengths in tokens (default: "
                   f"{','.join(map(str, DEFAULT_LENGTHS))} up to the engine's limit, plus the "
                   "longest prompt it accepts)")
    p.add_argument("--repeats", type=int, default=5, help="samples per length (median kept)")
    p.add_argument("--source", choices=SOURCES, default="engine",
                   help="the table's seconds: the engine's own prefill time per request "
                   "(scheduled -> first token; default) or the client's time to first token "
                   "(adds queueing, HTTP and streaming)")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=0, help="default: the agent's model")
    p.add_argument("--max-model-len", type=int, default=0, help="default: the agent's model")


def main(a: argparse.Namespace) -> int:
    def fail(msg: str, code: int) -> int:
        print(f"remp: error: {msg}", file=sys.stderr)
        return code

    if not (a.agent or a.http):
        return fail("give --agent HOST:PORT or --http URL", 2)
    try:
        lengths = tuple(int(x) for x in a.lengths.split(",") if x.strip()) if a.lengths else ()
        cfg = ProfileConfig(lengths=lengths, repeats=a.repeats, source=a.source, model=a.model,
                            seed=a.seed, vocab_size=a.vocab_size, max_model_len=a.max_model_len)
    except ValueError as exc:
        return fail(str(exc), 2)
    try:
        table = asyncio.run(profile(a.agent, a.http, cfg))
    except ValueError as exc:
        return fail(str(exc), 2)
    except (ConnectionError, RuntimeError, OSError, httpx.HTTPError) as exc:
        return fail(str(exc) or type(exc).__name__, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(table.dumps())
    for line in summary_lines(table):
        print(line)
    where = table.meta.get("topology", "?")
    print(f"prefill table ({len(table.points)} lengths, {where}) written to {a.out}")
    return 0
