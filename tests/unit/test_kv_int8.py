"""INT8 KV for cross-host migration: the codec (node_agent.kv.int8) and the decision's choice of
format (remp.recovery: kv_int8 off / on / auto, codec time in the cost), and the payload files
the agent sends (quantize_file) and the target loads (check_payload, dequantize_file)."""

from __future__ import annotations

import pytest
import torch

from node_agent.kv.int8 import QMAX, dequantize, group_elements, quantize
from remp.recovery import (Action, DisplacedRequest, KvFormat, PrefillTable, RecoveryConfig,
                           decide, int8_payload_bytes)

# the tiny model's per-layer payload shape: [blocks, KV heads, K/V, block size, head size]
SHAPE = (6, 4, 2, 16, 32)
TABLE = PrefillTable(((16, 0.010), (64, 0.020), (256, 0.060), (1024, 0.300)))


def layer(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g) * torch.linspace(0.01, 30, SHAPE[0]).view(-1, 1, 1, 1, 1)
    x[2, 1] = 0  # an all-zero (block, head)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_element_is_within_half_a_step(dtype):
    x = layer(dtype)
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == SHAPE[:2]
    assert int(q.abs().max()) <= QMAX
    back = dequantize(q, scale, dtype)
    assert back.dtype == dtype
    err = (back.float() - x.float()).abs()
    # half a step of its (block, head), plus the target dtype's own rounding of the result
    step = scale.view(*SHAPE[:2], 1, 1, 1)
    slack = 0 if dtype == torch.float32 else x.float().abs() * 2 ** -8
    assert bool((err <= step / 2 * (1 + 1e-6) + slack).all())
    assert bool((back[2, 1] == 0).all()) and float(scale[2, 1]) == 1.0  # zero stays exact
    # the scale is the group's largest magnitude / 127: the extreme element round-trips exactly
    amax = x.float().abs().amax(dim=(2, 3, 4))
    assert torch.allclose(scale[amax > 0], amax[amax > 0] / QMAX)


def test_non_finite_and_wrong_shapes_are_refused():
    x = layer()
    x[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x)
    with pytest.raises(ValueError, match=r"\[blocks, KV heads"):
        quantize(torch.zeros(3, 4))
    q, scale = quantize(layer())
    with pytest.raises(ValueError):
        dequantize(q.float(), scale, torch.float32)
    with pytest.raises(ValueError):
        dequantize(q, scale[:, :2], torch.float32)


@pytest.mark.parametrize("dtype,dtype_bytes,least", [(torch.bfloat16, 2, 1.9),
                                                      (torch.float32, 4, 3.9)])
def test_payload_size_matches_the_tensors_and_is_at_least_1_9x_smaller(dtype, dtype_bytes, least):
    x = layer(dtype)
    q, scale = quantize(x)
    full = x.numel() * dtype_bytes
    n = int8_payload_bytes(full, dtype_bytes, group_elements(SHAPE))
    assert n == q.numel() * 1 + scale.numel() * 4
    assert full / n >= least
    with pytest.raises(ValueError):
        int8_payload_bytes(full, 0, 1024)


def request(kv_bytes=4 << 20, tokens=256, int8=True, **kw):
    return DisplacedRequest("r", kv_bytes=kv_bytes, tokens=tokens,
                            int8_bytes=int8_payload_bytes(kv_bytes, 2, 1024) if int8 else None,
                            **kw)


def test_off_sends_full_width_and_on_sends_int8():
    [off] = decide([request()], TABLE, 1e9)
    assert off.kv_format is KvFormat.FULL and off.payload_bytes == 4 << 20
    cfg = RecoveryConfig(kv_int8="on", int8_codec_s_per_byte=1e-10)
    [on] = decide([request()], TABLE, 1e9, cfg)
    assert on.action is Action.MIGRATE and on.kv_format is KvFormat.INT8
    assert on.payload_bytes == int8_payload_bytes(4 << 20, 2, 1024)
    assert on.migrate_s == pytest.approx(on.payload_bytes / 1e9 + (4 << 20) * 1e-10)
    assert on.to_event()["kv_format"] == "int8"
    # a request without an INT8 size (e.g. a target that cannot take it) goes at full width
    [full] = decide([request(int8=False)], TABLE, 1e9, cfg)
    assert full.kv_format is KvFormat.FULL


def test_auto_changes_its_choice_as_the_link_slows():
    # 4 MiB of bf16 KV, a 256-token prefill of 60 ms, codec 0.2 ns/B (0.84 ms in all):
    # fast link: INT8 saves less than the codec costs → full; slower: INT8; slower still: its
    # INT8 transfer exceeds the prefill → recompute
    cfg = RecoveryConfig(kv_int8="auto", int8_codec_s_per_byte=0.2e-9)
    seen = []
    for bw in (20e9, 1e9, 0.1e9, 0.03e9):
        [d] = decide([request()], TABLE, bw, cfg)
        seen.append((d.action, d.kv_format))
    assert seen == [(Action.MIGRATE, KvFormat.FULL), (Action.MIGRATE, KvFormat.INT8),
                    (Action.MIGRATE, KvFormat.INT8), (Action.RECOMPUTE, KvFormat.INT8)]
    # the crossover moved: at 0.05 GB/s full width (84 ms) loses to the prefill (60 ms), INT8
    # (42 ms + 0.8 ms codec) still migrates
    [full] = decide([request()], TABLE, 0.05e9)
    [int8] = decide([request()], TABLE, 0.05e9, cfg)
    assert (full.action, int8.action) == (Action.RECOMPUTE, Action.MIGRATE)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="kv_int8"):
        RecoveryConfig(kv_int8="maybe")
    with pytest.raises(ValueError):
        RecoveryConfig(int8_codec_s_per_byte=-1)
    with pytest.raises(ValueError):
        DisplacedRequest("r", kv_bytes=1, tokens=1, int8_bytes=-1)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_payload_file_round_trip_passes_the_targets_check(tmp_path, dtype, name):
    """Source: a merged full payload → INT8 file (quantize_file); target: check_payload (INT8)
    → dequantize_file into the engine's dtype; every element within half a step."""
    from safetensors.torch import load_file, save_file

    from node_agent.kv.codec import INT8, ImportLimits, ImportPlan, check_payload
    from node_agent.kv.int8 import dequantize_file, quantize_file

    layers = {f"L{i}": layer(dtype, seed=i) for i in range(4)}
    full = tmp_path / "export.safetensors"
    save_file(layers, full)
    q = quantize_file(str(full), str(tmp_path / "export.int8.safetensors"))
    assert not full.exists()
    lim = ImportLimits(vocab_size=2048, max_model_len=512, block_size=16, num_layers=4,
                       num_kv_heads=4, head_size=32, kv_dtype=name, kv_rest=SHAPE[2:])
    with open(q, "rb") as f:
        data = f.read()
    assert check_payload(data, ImportPlan("r", len(data), (SHAPE[0],), INT8), lim) == SHAPE[0]
    full_bytes = sum(t.numel() * t.element_size() for t in layers.values())
    header = 8 + int.from_bytes(data[:8], "little")
    assert len(data) - header == int8_payload_bytes(full_bytes, dtype.itemsize,
                                                    group_elements(SHAPE))
    out = dequantize_file(q, str(tmp_path / "import.safetensors"), name, 4)
    back = load_file(out)
    assert set(back) == set(layers)
    for k, x in layers.items():
        assert back[k].dtype == dtype and back[k].shape == x.shape
        _, scale = quantize(x)
        step = scale.view(*SHAPE[:2], 1, 1, 1)
        slack = 0 if dtype == torch.float32 else x.float().abs() * 2 ** -8
        assert bool(((back[k].float() - x.float()).abs() <= step / 2 * (1 + 1e-6) + slack).all())
