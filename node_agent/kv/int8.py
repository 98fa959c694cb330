"""INT8 KV for cross-host request migration (issue 18): one payload layer ``[blocks, KV heads,
...]`` (:mod:`~node_agent.kv.codec`) quantised on the source to int8 with one symmetric scale per
(block, KV head) — per (layer, block, KV head) over the whole payload — and dequantised on the
target into the engine's dtype. Pure torch, no engine state.

Error: every element is within half a step (its scale / 2) of the original, a step being the
largest magnitude of its (block, KV head) over 127; an all-zero (block, head) is exact.
Size: :func:`remp.recovery.int8_payload_bytes` (the cost model's arithmetic, shared).

Not wired yet: the agent's export (merge of the rank parts), :func:`~node_agent.kv.codec.
check_payload` and the ranks' load still move the engine's dtype; this module and the decision's
choice of format (:func:`remp.recovery.decide`, ``RecoveryConfig.kv_int8``) are the first part.
"""

from __future__ import annotations

import torch

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
