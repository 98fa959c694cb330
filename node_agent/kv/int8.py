"""INT8 KV for cross-host request migration (issue 18): one payload layer ``[blocks, KV heads,
...]`` (:mod:`~node_agent.kv.codec`) quantised on the source to int8 with one symmetric scale per
(block, KV head) — per (layer, block, KV head) over the whole payload — and dequantised on the
target into the engine's dtype. Pure torch, no engine state.

Error: every element is within half a step (its scale / 2) of the original, a step being the
largest magnitude of its (block, KV head) over 127; an all-zero (block, head) is exact.
Size: :func:`remp.recovery.int8_payload_bytes` (the cost model's arithmetic, shared).

Wiring: the source agent quantises the merged payload file when the decision's format is INT8
(:func:`quantize_file`: per layer ``L<i>`` int8 and ``L<i>.scale``); the target checks it
(:func:`~node_agent.kv.codec.check_payload`, format INT8) and dequantises it into a payload of
its engine's dtype (:func:`dequantize_file`) before the import connector loads it.
"""

from __future__ import annotations

import os

import torch

from node_agent.kv.codec import layer_key, scale_key

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

QMAX = 127  # symmetric: -127 … 127 (-128 unused, so that negation is exact)


def _group_dims(x: torch.Tensor) -> tuple[int, ...]:
    if x.dim() < 3:
        raise ValueError(f"a payload layer is [blocks, KV heads, ...], got shape {tuple(x.shape)}")
    return tuple(range(2, x.dim()))


def _expand(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return scale.reshape(*scale.shape, *([1] * (like.dim() - 2)))


def quantize(layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` int8 of ``layer_kv``'s shape, ``scale`` float32 ``[blocks, heads]``
    (a zero (block, head) gets scale 1). Raises ValueError on a non-finite input: the engine's
    KV is finite, and a scale of inf would carry nothing."""
    x = layer_kv.float()
    amax = x.abs().amax(dim=_group_dims(x))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("KV holds a non-finite value: not quantised")
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x / _expand(scale, x)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The layer in ``dtype`` (the target engine's KV dtype) from :func:`quantize`'s output."""
    if q.dtype != torch.int8 or scale.shape != q.shape[:2]:
        raise ValueError(f"int8 [blocks, heads, ...] and scale [blocks, heads] expected, got "
                         f"{q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}")
    return (q.float() * _expand(scale.float(), q)).to(dtype)


def group_elements(layer_shape: tuple[int, ...]) -> int:
    """Elements that share one scale: everything after (block, KV head)."""
    n = 1
    for d in layer_shape[2:]:
        n *= d
    return n


def quantize_file(src: str, out: str) -> str:
    """A full-format payload file (one tensor ``L<i>`` per layer) as an INT8 payload at ``out``
    (``L<i>`` int8 and ``L<i>.scale`` float32); ``src`` is removed. Returns ``out``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    with safe_open(src, framework="pt") as st:
        for key in st.keys():  # noqa: SIM118 - a safetensors file, not a dict
            q, scale = quantize(st.get_tensor(key))
            layer = int(key[1:])
            tensors[layer_key(layer)], tensors[scale_key(layer)] = q, scale
    save_file(tensors, out)
    os.unlink(src)
    return out


def dequantize_file(src: str, out: str, dtype: str, layers: int) -> str:
    """A checked INT8 payload (:func:`~node_agent.kv.codec.check_payload`) as a full-format
    payload of ``dtype`` (the engine's KV dtype name) at ``out``; ``src`` is removed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(src, framework="pt") as st:
        tensors = {layer_key(i): dequantize(st.get_tensor(layer_key(i)),
                                            st.get_tensor(scale_key(i)), DTYPES[dtype])
                   for i in range(layers)}
    save_file(tensors, out)
    os.unlink(src)
    return out
