"""The payload of one request's KV that cross-host request migration sends (a safetensors file):
per global layer ``L<layer>``, the request's blocks × every KV head, in the engine's per-layer
layout (``[blocks, KV heads, ...]``).

Written in two steps on the source: every rank saves its part (its layers × its KV heads, keys
``L<layer>.h<first head>``: :func:`rank_part_key`), the agent merges the parts into one tensor per
layer (:func:`merge_rank_parts`). On the target the agent checks the file in full before the
engine sees it (:func:`check_payload`: pure), and every rank loads its KV heads of each layer
(:func:`rank_heads`).

INT8 (issue 18, :mod:`node_agent.kv.int8`): per layer ``L<layer>`` int8 of the same shape and
``L<layer>.scale`` float32 ``[blocks, KV heads]``; the target checks it as strictly (:func:`
check_payload` with the plan's ``kv_format``) and dequantises it into its engine's dtype, the
full format, before the engine sees it."""

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
FULL, INT8 = "full", "int8"  # payload formats (ImportHeader.kv_format)
SCALE_BYTES = 4  # one float32 per (layer, block, KV head)


def kv_bytes_estimate(blocks: int, shape, block_size: int, dtype_bytes: int) -> int:
    """A request's KV over every layer and KV head (what a MIGRATE sends)."""
    return blocks * shape.num_layers * shape.num_kv_heads * block_size * 2 * shape.head_size * dtype_bytes



def layer_key(layer: int) -> str:
    """A layer's tensor in the payload."""
    return f"L{layer}"


def scale_key(layer: int) -> str:
    """A layer's INT8 scales ``[blocks, KV heads]`` in an INT8 payload."""
    return f"L{layer}.scale"


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

    @property
    def group_elements(self) -> int:
        """Elements of one (block, KV head) of one layer: what one INT8 scale covers."""
        return self.block_size * 2 * self.head_size

    def format_block_bytes(self, fmt: str) -> int:
        """One block over every layer in payload format ``fmt``: the engine's dtype, or one
        byte per element plus a float32 scale per (layer, KV head)."""
        if fmt == INT8:
            return self.num_layers * self.num_kv_heads * (self.group_elements + SCALE_BYTES)
        return self.block_bytes

    def format_max_header_bytes(self, fmt: str) -> int:
        """An INT8 payload names two tensors per layer."""
        return self.max_header_bytes + (160 * self.num_layers if fmt == INT8 else 0)

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
    kv_format: str = FULL  # FULL or INT8



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
    file an export of this model makes: header length, exactly one tensor ``L<i>`` per layer
    (INT8: and ``L<i>.scale``), dtype, shapes, offsets (contiguous, covering the data exactly),
    and every value finite (INT8: :func:`_check_int8_values`). Returns the number of blocks;
    raises InvalidArgument."""
    fmt = plan.kv_format
    if fmt not in (FULL, INT8):
        raise _bad(f"KV payload format {fmt[:16]!r} is not known")
    total = len(buf)
    if total != plan.kv_bytes:
        raise _bad(f"KV payload incomplete: {total} of {plan.kv_bytes} bytes")
    n = int.from_bytes(bytes(buf[:8]), "little")
    max_header, block_bytes = lim.format_max_header_bytes(fmt), lim.format_block_bytes(fmt)
    if not 2 <= n <= max_header or 8 + n > total:
        raise _bad(f"KV payload: safetensors header length {n} is not in [2, {max_header}]")
    data_len = total - 8 - n
    blocks, rem = divmod(data_len, block_bytes)
    if rem or blocks not in plan.blocks:
        raise _bad(f"KV payload: {data_len} bytes of tensors are not the blocks the header "
                   f"announced ({', '.join(map(str, plan.blocks))} × {block_bytes} bytes)")
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
    kv_keys = [layer_key(i) for i in range(lim.num_layers)]
    scale_keys = [scale_key(i) for i in range(lim.num_layers)] if fmt == INT8 else []
    want = kv_keys + scale_keys
    if set(hdr) != set(want):
        extra = sorted(set(hdr) - set(want))[:3]
        missing = [k for k in want if k not in hdr][:3]
        names = "L<i>, L<i>.scale" if fmt == INT8 else "L<i>"
        raise _bad(f"KV payload: tensors must be exactly {names} for i in 0..{lim.num_layers - 1}"
                   f"; unexpected {[k[:32] for k in extra]}, missing {missing}")
    st_dtype, size, _ = KV_DTYPES[lim.kv_dtype]
    if fmt == INT8:
        st_dtype, size = "I8", 1
    rest = lim.kv_rest
    spans = []
    for key in want:
        e = hdr[key]
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _bad(f"KV payload: {key} needs exactly dtype, shape and data_offsets")
        is_scale = key in scale_keys
        want_dtype, esize = ("F32", SCALE_BYTES) if is_scale else (st_dtype, size)
        if e["dtype"] != want_dtype:
            raise _bad(f"KV payload: {key} is {str(e['dtype'])[:16]}, expected {want_dtype}")
        shape = _ints(e["shape"])
        if is_scale:
            ok = shape == [blocks, lim.num_kv_heads]
        else:
            ok = (shape is not None and len(shape) >= 3
                  and shape[:2] == [blocks, lim.num_kv_heads]
                  and (list(rest) == shape[2:] if rest is not None
                       else math.prod(shape[2:]) == lim.group_elements))
        if not ok:
            expect = [blocks, lim.num_kv_heads, *([] if is_scale else (rest or ["…"]))]
            raise _bad(f"KV payload: {key} has shape {str(e['shape'])[:64]}, expected {expect}")
        off = _ints(e["data_offsets"], 2)
        if off is None or off[1] - off[0] != math.prod(shape) * esize:
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
    if fmt == INT8:
        _check_int8_values(buf, 8 + n, hdr, lim, blocks)
        return blocks
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


def max_int8_scale(kv_dtype: str) -> float:
    """The largest scale whose 127 steps stay finite in the engine's KV dtype."""
    import numpy as np

    big = {"float32": float(np.finfo(np.float32).max), "bfloat16": 3.3895313892515355e38,
           "float16": 65504.0}[kv_dtype]
    return big / 127


def _check_int8_values(buf, data_start: int, hdr: dict, lim: ImportLimits, blocks: int) -> None:
    """An INT8 payload's values (layout already checked): every scale finite and in (0, the
    largest that keeps 127 steps finite in this engine's dtype], or exactly 0 with its whole
    (block, KV head) 0; every int8 value in -127..127 (what the quantiser makes)."""
    import numpy as np

    top = max_int8_scale(lim.kv_dtype)
    groups = blocks * lim.num_kv_heads
    for i in range(lim.num_layers):
        sk, qk = scale_key(i), layer_key(i)
        # copies (one layer at a time): no array may still view ``buf`` (an mmap) when this
        # raises, or closing the map fails
        s0, s1 = hdr[sk]["data_offsets"]
        scale = np.frombuffer(bytes(buf[data_start + s0:data_start + s1]), dtype=np.dtype("<f4"))
        if not (np.isfinite(scale).all() and (scale >= 0).all() and (scale <= top).all()):
            raise _bad(f"KV payload: {sk} holds a scale that is not finite, negative or above "
                       f"{top:.3g} (the largest whose steps stay finite in {lim.kv_dtype})")
        q0, q1 = hdr[qk]["data_offsets"]
        q = np.frombuffer(bytes(buf[data_start + q0:data_start + q1]),
                          dtype=np.int8).reshape(groups, lim.group_elements)
        if (q == -128).any():
            raise _bad(f"KV payload: {qk} holds -128 (INT8 KV is symmetric: -127..127)")
        zero = scale == 0
        if zero.any() and q[zero].any():
            raise _bad(f"KV payload: {sk} is 0 where {qk} is not all zero")
