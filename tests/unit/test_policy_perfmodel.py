"""The performance model (policy/perfmodel.py): tables read correctly, monotone, TP and H200 behave."""

import csv

import numpy as np
import pytest

from policy.perfmodel import (FIXED_KERNEL_MS, H100, H200, LLAMA2_7B, LLAMA2_70B, VIDUR_DIR,
                              BoundAttention, MeasuredAttention, PerfModel, build_profile,
                              load_collective, load_op_table, topologies)
from policy.profiles import BUILTIN_PROFILES, Profile, load_profile
from remp.topology import Topology


def test_vidur_table_known_row():
    # llama2-7b_mlp.csv row TP1, 1 token: attn_pre_proj 0.038 ms, mlp_up_proj 0.064 ms (Vidur median)
    t = load_op_table("llama2-7b")
    assert t.op_ms("attn_pre_proj", 1, 1) == pytest.approx(0.038)
    assert t.op_ms("mlp_up_proj", 1, 1) == pytest.approx(0.064)
    with open(VIDUR_DIR / "llama2-70b_mlp.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "8" and r["num_tokens"] == "64"]
    assert len(rows) == 1
    assert load_op_table("llama2-70b").op_ms("mlp_down_proj", 8, 64) == pytest.approx(float(rows[0]["mlp_down_proj_median_ms"]))
    # (TP8, 4096) was profiled twice (0.296, 0.295 ms): averaged
    assert load_op_table("llama2-70b").op_ms("mlp_down_proj", 8, 4096) == pytest.approx(0.2955)
    ar = load_collective("all_reduce")
    assert ar.ms(8, 2048) == pytest.approx(0.037)  # first 8-worker row
    assert ar.ms(1, 1e6) == 0.0


def test_tp_speeds_up_compute_bound_ops_and_collectives_grow():
    t = load_op_table("llama2-70b")
    for op in ("attn_pre_proj", "mlp_up_proj", "mlp_down_proj"):
        times = [t.op_ms(op, tp, 4096) for tp in (1, 2, 4, 8)]
        assert all(a > b for a, b in zip(times, times[1:])), (op, times)
        assert times[0] / times[3] > 4  # compute-bound: close to linear
    ar = load_collective("all_reduce")
    assert ar.ms(8, 64e6) > ar.ms(8, 1e6) > 0


def test_monotone_in_tokens_and_load():
    pm = PerfModel(LLAMA2_7B, H100, BoundAttention(H100))
    topo = Topology(2, 1)
    rounds = [pm.round_ms(topo, b, 0) for b in (1, 8, 64, 256)]
    assert all(a <= b for a, b in zip(rounds, rounds[1:]))
    cap = pm.capacity_rps(topo)
    pts = [pm.point(topo, f * cap) for f in (0.1, 0.5, 0.9)]
    assert all(p is not None for p in pts)
    assert pts[0][0] < pts[1][0] < pts[2][0]  # TTFT grows with load
    assert pts[0][2] <= pts[1][2] <= pts[2][2]  # TPOT too
    assert pm.point(topo, 1.5 * cap) is None


def test_more_gpus_more_capacity_and_kv():
    pm = PerfModel(LLAMA2_7B, H100, BoundAttention(H100))
    caps = [pm.capacity_rps(Topology(w, 1)) for w in (1, 2, 4, 8)]
    assert all(a < b for a, b in zip(caps, caps[1:]))
    assert pm.kv_tokens(Topology(2, 1)) > 2 * pm.kv_tokens(Topology(1, 1))
    # 70B weights (138 GB) do not fit one H100 or two (80 GB x 0.9 each)
    big = PerfModel(LLAMA2_70B, H100, BoundAttention(H100))
    assert not big.fits(Topology(1, 1)) and not big.fits(Topology(2, 1)) and big.fits(Topology(4, 1))
    assert PerfModel(LLAMA2_70B, H200, BoundAttention(H200)).fits(Topology(2, 1))


def test_h200_scaling_memory_bound_only():
    a, b = PerfModel(LLAMA2_70B, H100, BoundAttention(H100)), PerfModel(LLAMA2_70B, H200, BoundAttention(H200))
    # a 1-token GEMM is weight-bound: scaled by 3.35/4.8 beyond its fixed 12 us; a 4096-token one
    # is compute-bound: unchanged
    t = a.op_ms("mlp_up_proj", 1, 1)
    assert b.op_ms("mlp_up_proj", 1, 1) == pytest.approx(FIXED_KERNEL_MS + (t - FIXED_KERNEL_MS) * 3.35 / 4.8)
    assert a.op_ms("input_layernorm", 1, 1) < FIXED_KERNEL_MS  # a tiny kernel: all fixed, unchanged
    assert b.op_ms("input_layernorm", 1, 1) == pytest.approx(a.op_ms("input_layernorm", 1, 1))
    assert b.op_ms("mlp_up_proj", 1, 4096) == pytest.approx(a.op_ms("mlp_up_proj", 1, 4096))
    t = Topology(8, 1)
    assert b.round_ms(t, 64, 0) < a.round_ms(t, 64, 0)
    assert b.kv_tokens(t) > 1.7 * a.kv_tokens(t)


def test_measured_attention_plugs_in(tmp_path):
    p = tmp_path / "attention.csv"
    cols = "kind,q_heads,kv_heads,head_dim,batch,q_len,kv_len,dtype,backend,median_ms,p10_ms,p90_ms,reps"
    rows = [cols]
    for b in (1, 8, 64):
        rows.append(f"decode,8,1,128,{b},1,1024,bf16,cudnn,{0.01 + 0.001 * b},0,0,10")
        # rows that do not stand for vLLM's kernels are ignored (an upper bound, a slow backend)
        rows.append(f"decode_paged,8,1,128,{b},1,1024,bf16,gather16+flash,{9.0 * b},0,0,10")
        rows.append(f"decode,8,1,128,{b},1,1024,bf16,flash,{5.0 * b},0,0,10")
    for q in (128, 1024):
        rows.append(f"prefill,8,1,128,1,{q},{q},bf16,cudnn,{0.02 * q / 128},0,0,10")
    p.write_text("\n".join(rows) + "\n")
    m = MeasuredAttention(p, H200, H200)
    assert m.decode_ms(8, 1, 128, 8, 1024) == pytest.approx(0.018)
    assert m.decode_ms(8, 1, 128, 128, 1024) == pytest.approx(0.074 * 2)  # linear beyond the range
    assert MeasuredAttention(p, H200, H100).decode_ms(8, 1, 128, 8, 1024) == pytest.approx(
        FIXED_KERNEL_MS + (0.018 - FIXED_KERNEL_MS) * 4.8 / 3.35)  # the fixed part stays
    assert m.decode_ms(64, 8, 128, 8, 1024) == BoundAttention(H200).decode_ms(64, 8, 128, 8, 1024)  # no rows
    prof = build_profile("llama2-70b", "h200", attention_csv=p)
    assert "measured-h200" in prof.notes


def test_uneven_stages_cost_their_fullest_stage():
    """PP3 of 32 layers (11/11/10): the round, the weights and the KV per token are those of the
    11-layer stage, so it lies between PP2 and PP4 per GPU and never beats 32/3 exactly."""
    pm = PerfModel(LLAMA2_7B, H100, BoundAttention(H100))
    assert pm.m.max_stage_layers(3) == 11 and pm.m.max_stage_layers(4) == 8
    assert pm.m.kv_bytes_per_token(1, 3) == pytest.approx(11 / 8 * pm.m.kv_bytes_per_token(1, 4))
    assert pm.weights_per_rank_bytes(Topology(1, 4)) == pytest.approx(
        pm.m.params * pm.m.dtype_bytes / 4)
    w3 = pm.weights_per_rank_bytes(Topology(1, 3))
    assert pm.m.params * pm.m.dtype_bytes / 3 < w3 < pm.m.params * pm.m.dtype_bytes / 2
    r3, r4 = pm.round_ms(Topology(1, 3), 30, 0), pm.round_ms(Topology(1, 4), 30, 0)
    caps = [pm.capacity_rps(Topology(1, pp)) for pp in (2, 3, 4)]
    assert caps[0] < caps[1] < caps[2] and r3 > 0 and r4 > 0


def test_builtin_profiles_load_and_round_trip():
    names = [n for n in BUILTIN_PROFILES if n != "h200x8-analytic"]
    assert "h100x8-llama2-70b" in names and "h200x8-llama2-7b" in names
    p = load_profile("h100x8-llama2-7b")
    assert {t.world_size for t in p.topologies} == set(range(1, 9))
    assert len(p.topologies) == len(topologies(LLAMA2_7B))
    # what an agent on 8 GPUs registers: every world up to the host's, PP any degree up to the
    # layers (uneven stages laid out as vLLM does: PP3 of 32 layers is 11/11/10), TP Vidur's
    big = load_profile("h100x8-llama2-70b")
    assert {t.world_size for t in big.topologies} == {3, 4, 5, 6, 7, 8}  # 1-2: weights too big
    assert {Topology(1, 3), Topology(2, 3), Topology(1, 7)} <= set(big.topologies)
    assert all(t.tp in (1, 2, 4, 8) for t in big.topologies)
    assert Topology(3, 1) not in topologies(LLAMA2_70B)  # TP must divide the 8 KV heads
    assert [t for t in topologies(LLAMA2_7B) if t.world_size == 8] == [Topology(8, 1), Topology(4, 2),
                                                                      Topology(2, 4), Topology(1, 8)]
    q = Profile.from_json(p.to_json())
    assert q.topologies == p.topologies and q.default_slo == p.default_slo
    assert all(np.all(np.diff(c.load_rps) > 0) for c in p.curves)
    assert "bound" in p.notes or "measured" in p.notes


def test_erlang_c_is_the_mm1_case_at_one_server_and_falls_with_more():
    from policy.perfmodel import erlang_c

    assert erlang_c(1, 0.8) == pytest.approx(0.8)
    assert erlang_c(2, 0.5) == pytest.approx(2 * 0.5 ** 2 / (1 + 0.5))  # M/M/2 closed form
    assert erlang_c(50, 0.0) == 0.0
    for c in (1, 8, 92):
        xs = [erlang_c(c, r) for r in (0.3, 0.6, 0.9, 0.99)]
        assert xs == sorted(xs) and all(0 <= x <= 1 for x in xs)
    assert erlang_c(92, 0.8) < erlang_c(8, 0.8) < erlang_c(1, 0.8)


def test_the_ttft_queue_is_one_of_many_slots_as_vllm_showed():
    """vLLM 0.25.0 on an H100 (bench/results/vllm_gpu_vs_model_h100-2026-12-07.md), Llama-2-7B TP 1,
    1024 in / 256 out: TTFT p50 / p90 66 / 95 ms at 0.8 x the model's capacity, nothing queued.
    The M/M/1 queue the model had said 277 / 1,057 ms; the M/M/c one (c = the requests in the
    engine at capacity) puts no wait there, and a growing one only next to capacity."""
    from dataclasses import replace

    pm = PerfModel(LLAMA2_7B, H100)
    pm = PerfModel(LLAMA2_7B, H100, request=replace(pm.req, prompt_sigma=0.0))
    t = Topology(1, 1)
    cap = pm.capacity_rps(t)
    assert pm.queue_slots(t) > 50  # about 70 requests in the engine at capacity
    t50, t90, _, _ = pm.point(t, 0.8 * cap)
    assert t50 < 0.08 and t90 < 0.08
    near = pm.point(t, 0.97 * cap)
    assert near[1] > 0.3  # the wait grows next to capacity
