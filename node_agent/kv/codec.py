"""The payload of one request's KV that cross-host request migration sends (a safetensors file):
per global layer ``L<layer>``, the request's blocks × every KV head, in the engine's per-layer
layout (``[blocks, KV heads, ...]``).

Written in two steps on the source: every rank saves its part (its layers × its KV heads, keys
``L<layer>.h<first head>``: :func:`rank_part_key`), the agent merges the parts into one tensor per
layer (:func:`merge_rank_parts`). On the target the agent checks the file in full before the
engine sees it (:func:`check_payload`: pure), and every rank loads its KV heads of each layer
(:func:`rank_heads`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from remp.errors import InvalidArgument

# safetensors dtype name, bytes, and the exponent mask of that float format (all ones: inf/NaN)
KV_DTYPES = {"float32": ("F32", 4, 0x7F800000), "bfloat16": ("BF16", 2, 0x7F80),
             "float16": ("F16", 2, 0x7C00)}
_FINITE_CHUNK = 16 << 20


def kv_bytes_estimate(blocks: int, shape, block_size: int, dtype_bytes: int) -> int:
    """A request's KV over every layer and KV head (what a MIGRATE sends)."""
    return blocks * shape.num_layers * shape.num_kv_heads * block_size * 2 * shape.head_size * dtype_bytes



def layer_key(layer: int) -> str:
    """A layer's tensor in the payload."""
    return f"L{layer}"


def rank_part_key(layer: int, head_start: int) -> str:
    """One rank's part of a layer (its KV heads from ``head_start``) before the merge."""
    return f"L{layer}.h{head_start}"


def merge_rank_parts(files: list[str], out: str) -> str:
    """Every rank's parts (:func:`rank_part_key`) into one tensor per layer, written to ``out``;
    the rank files are removed. Returns ``out``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    parts: dict[int, list] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                layer, head = key[1:].split(".h")
                parts.setdefault(int(layer), []).append((int(head), st.get_tensor(key)))
        os.unlink(f)
    merged = {layer_key(ly): torch.cat([t for _, t in sorted(p, key=lambda x: x[0])], dim=1)
              for ly, p in parts.items()}
    save_file(merged, out)
    return out


def first_head(tp_rank: int, heads: int) -> int:
    """The first KV head of TP rank ``tp_rank`` holding ``heads`` KV heads (vLLM's order)."""
    return tp_rank * heads


def rank_heads(layer_kv, tp_rank: int, heads: int):
    """A rank's KV heads (TP rank ``tp_rank`` of ``heads`` each) of one payload layer."""
    return layer_kv.narrow(1, first_head(tp_rank, heads), heads)


@dataclass(frozen=True)
class ImportLimits:
    """What an imported request must fit: this agent's model, engine and settings."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dtype: str = "float32"
    kv_rest: tuple[int, ...] | None = None  # a layer's KV shape after (blocks, heads), if known

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPES[self.kv_dtype][1]

    @property
    def layer_block_bytes(self) -> int:
        """One block of one layer, every KV head."""
        return self.num_kv_heads * self.block_size * 2 * self.head_size * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """One block over every layer (what :func:`kv_bytes_estimate` counts per block)."""
        return self.num_layers * self.layer_block_bytes

    @property
    def max_header_bytes(self) -> int:
        """The safetensors header of an export: ~100 bytes per layer; generous, still small."""
        return 1024 + 160 * self.num_layers

    def blocks_for(self, tokens: int) -> range:
        """Block counts an export of a request of ``tokens`` tokens can have: its KV covers every
        token but the last; the engine may have allocated the slot of the next one already."""
        bs = self.block_size
        return range(-(-(tokens - 1) // bs), -(-(tokens + 1) // bs) + 1)


@dataclass(frozen=True)
class ImportPlan:
    """A checked ImportRequest header."""

    request_id: str
    kv_bytes: int  # 0: recompute
    blocks: tuple[int, ...] = ()  # block counts kv_bytes is consistent with



def _bad(msg: str) -> InvalidArgument:
    return InvalidArgument(f"ImportRequest: {msg}")



def _ints(v, n: int | None = None) -> list[int] | None:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        return None
    if not all(type(x) is int and x >= 0 for x in v):
        return None
    return v


def check_payload(buf, plan: ImportPlan, lim: ImportLimits) -> int:
    """The received KV payload (bytes-like: bytes, memoryview, mmap), checked as a safetensors
    file an export of this model makes: header length, exactly one tensor ``L<i>`` per layer,
    dtype, shapes, offsets (contiguous, covering the data exactly), and every value finite.
    Returns the number of blocks; raises InvalidArgument."""
    total = len(buf)
    if total != plan.kv_bytes:
        raise _bad(f"KV payload incomplete: {total} of {plan.kv_bytes} bytes")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if not 2 <= n <= lim.max_header_bytes or 8 + n > total:
        raise _bad(f"KV payload: safetensors header length {n} is not in [2, "
                   f"{lim.max_header_bytes}]")
    data_len = total - 8 - n
    blocks, rem = divmod(data_len, lim.block_bytes)
    if rem or blocks not in plan.blocks:
        raise _bad(f"KV payload: {data_len} bytes of tensors are not the blocks the header "
                   f"announced ({', '.join(map(str, plan.blocks))} × {lim.block_bytes} bytes)")
    try:
        hdr = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _bad("KV payload: the safetensors header is not JSON") from None
    if not isinstance(hdr, dict):
        raise _bad("KV payload: the safetensors header is not a JSON object")
    meta = hdr.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise _bad("KV payload: __metadata__ must be a small string → string map")
    want = [layer_key(i) for i in range(lim.num_layers)]
    if set(hdr) != set(want):
        extra = sorted(set(hdr) - set(want))[:3]
        missing = [k for k in want if k not in hdr][:3]
        raise _bad(f"KV payload: tensors must be exactly L0..L{lim.num_layers - 1} (one per "
                   f"layer); unexpected {[k[:32] for k in extra]}, missing {missing}")
    st_dtype, size, _ = KV_DTYPES[lim.kv_dtype]
    rest = lim.kv_rest
    spans = []
    for key in want:
        e = hdr[key]
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _bad(f"KV payload: {key} needs exactly dtype, shape and data_offsets")
        if e["dtype"] != st_dtype:
            raise _bad(f"KV payload: {key} is {str(e['dtype'])[:16]}, this engine's KV is "
                       f"{st_dtype}")
        shape = _ints(e["shape"])
        ok = (shape is not None and len(shape) >= 3 and shape[:2] == [blocks, lim.num_kv_heads]
              and (list(rest) == shape[2:] if rest is not None
                   else math.prod(shape[2:]) == 2 * lim.block_size * lim.head_size))
        if not ok:
            expect = [blocks, lim.num_kv_heads, *(rest or ["…"])]
            raise _bad(f"KV payload: {key} has shape {str(e['shape'])[:64]}, expected {expect}")
        off = _ints(e["data_offsets"], 2)
        if off is None or off[1] - off[0] != math.prod(shape) * size:
            raise _bad(f"KV payload: {key} data_offsets do not match its shape and dtype")
        spans.append((off[0], off[1], key))
    spans.sort()
    at = 0
    for start, end, key in spans:
        if start != at:
            raise _bad(f"KV payload: {key} overlaps or leaves a gap (offset {start}, expected "
                       f"{at})")
        at = end
    if at != data_len:
        raise _bad(f"KV payload: tensors cover {at} of {data_len} data bytes")
    bad = _first_nonfinite(buf, 8 + n, total, lim.kv_dtype)
    if bad is not None:
        key = next(k for s, e, k in spans if s <= bad - 8 - n < e)
        raise _bad(f"KV payload: {key} holds a NaN or infinity")
    return blocks


def _first_nonfinite(buf, start: int, end: int, kv_dtype: str) -> int | None:
    """Byte offset of the first NaN/inf value in ``buf[start:end]``, or None."""
    import numpy as np

    _, size, mask = KV_DTYPES[kv_dtype]
    dt = np.dtype(np.uint32 if size == 4 else np.uint16).newbyteorder("<")
    for off in range(start, end, _FINITE_CHUNK):
        count = (min(end, off + _FINITE_CHUNK) - off) // size
        a = np.frombuffer(buf, dtype=dt, count=count, offset=off)
        hit = np.flatnonzero((a & mask) == mask)
        if hit.size:
            return off + int(hit[0]) * size
    return None
