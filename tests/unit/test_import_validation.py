"""ImportRequest's checks (node_agent.migration, pure): a header and a KV payload that do not fit
this agent's model and engine are refused with INVALID_ARGUMENT before anything reaches the
engine; MigrateRequest targets must be registered nodes; the import connector honours only the
agent's own imports; a dead engine is restarted a bounded number of times."""

import json
import math
import struct

import grpc
import numpy as np
import pytest
from safetensors.numpy import save

from node_agent import engine_plugin
from remp.backoff import RestartBudget
from node_agent.migration import (ImportLimits, check_address, check_header, check_payload,
                                  kv_bytes_estimate, match_target)
from remp.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.topology import ModelShape

# the tiny test model (4 layers, 4 KV heads, head size 32) on vLLM CPU: block size 16 here
LIM = ImportLimits(vocab_size=2048, max_model_len=512, block_size=16, num_layers=4,
                   num_kv_heads=4, head_size=32, kv_dtype="float32", kv_rest=(16, 64))
PROMPT, OUT = list(range(3, 40)), [7, 8, 9]  # 40 tokens: KV of 39 = 3 blocks


def kv(blocks=3, layers=4, dtype=np.float32, rest=(16, 64), value=0.5, extra=None):
    t = {f"L{i}": np.full((blocks, 4, *rest), value, dtype=dtype) for i in range(layers)}
    t.update(extra or {})
    return save(t)


def header(data: bytes, **kw) -> pb.ImportHeader:
    h = dict(request_id="cmpl-0123abcd-0", prompt_token_ids=PROMPT, output_token_ids=OUT,
             max_tokens=100, temperature=0.0, kv_bytes=len(data), block_size=16)
    h.update(kw)
    return pb.ImportHeader(**h)


def refused(exc_type, fn, *a):
    with pytest.raises(exc_type) as e:
        fn(*a)
    assert e.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_export_of_this_model_passes():
    data = kv()
    plan = check_header(header(data), LIM)
    assert plan.kv_bytes == len(data) and 3 in plan.blocks
    assert check_payload(data, plan, LIM) == 3
    # the arithmetic is the one MigrateRequest decides with
    shape = ModelShape(num_layers=4, num_attention_heads=8, num_kv_heads=4, hidden_size=256,
                       head_size=32)
    tensor_bytes = len(data) - 8 - int.from_bytes(data[:8], "little")
    assert tensor_bytes == kv_bytes_estimate(3, shape, 16, 4) == 3 * LIM.block_bytes


def test_recompute_header_needs_no_payload():
    plan = check_header(header(b"", kv_bytes=0, block_size=0), LIM)
    assert plan.kv_bytes == 0


@pytest.mark.parametrize("kw,msg", [
    ({"request_id": "../../../../tmp/x"}, "request_id"),
    ({"request_id": "a" * 100_000}, "at most 128"),
    ({"request_id": ""}, "request_id is required"),
    ({"prompt_token_ids": []}, "prompt_token_ids is required"),
    ({"prompt_token_ids": [1, 2, 2048]}, "token id 2048 is outside this model's vocabulary"),
    ({"output_token_ids": [4_000_000_000]}, "outside this model's vocabulary"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4_000_000_000}, "exceed this agent's max_model_len 512"),
    ({"prompt_token_ids": [5] * 600}, "exceed this agent's max_model_len 512"),
    ({"max_tokens": 3}, "nothing is left to generate"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"kv_bytes": 1 << 20}, "kv_bytes 1048576 is not the size of 39 tokens"),
    ({"kv_bytes": 1 << 62}, "is not the size of"),
    ({"prompt_token_ids": [5], "output_token_ids": []}, "at least 2 tokens"),
])
def test_bad_headers_are_invalid_arguments(kw, msg):
    assert msg in refused(InvalidArgument, check_header, header(kv(), **kw), LIM)


def test_block_size_mismatch_is_a_precondition():
    assert "migrate with RECOMPUTE" in refused(FailedPrecondition, check_header,
                                              header(kv(), block_size=128), LIM)


def test_random_bytes_of_the_right_size_are_refused():
    data = kv()
    rnd = np.random.default_rng(0).bytes(len(data))
    msg = refused(InvalidArgument, check_payload, rnd, check_header(header(data), LIM), LIM)
    assert "header length" in msg


def _rewrite(data: bytes, edit) -> bytes:
    """The same payload with its safetensors header edited (padded to the same length)."""
    n = int.from_bytes(data[:8], "little")
    hdr = json.loads(data[8:8 + n])
    edit(hdr)
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    m = max(n, -(-len(raw) // 8) * 8)
    return struct.pack("<Q", m) + raw.ljust(m) + data[8 + n:]


def _set(key, field, value):
    def edit(h):
        h[key][field] = value
    return edit


@pytest.mark.parametrize("make,msg", [
    (lambda d: _rewrite(d, _set("L0", "dtype", "F16")), "L0 is F16"),
    (lambda d: _rewrite(d, _set("L1", "shape", [3, 4, 64, 16])), "L1 has shape"),
    (lambda d: _rewrite(d, _set("L1", "shape", [3, 8, 8, 64])), "L1 has shape"),
    (lambda d: _rewrite(d, _set("L2", "data_offsets", [0, 49152])), "overlaps or leaves a gap"),
    (lambda d: _rewrite(d, _set("L2", "data_offsets", [0, 7])), "data_offsets do not match"),
    (lambda d: _rewrite(d, _set("L3", "data_offsets", [-8, 49144])), "data_offsets"),
    (lambda d: _rewrite(d, _set("L3", "shape", "x")), "L3 has shape"),
    (lambda d: _rewrite(d, lambda h: h.update(L9=h.pop("L3"))), "unexpected ['L9']"),
    (lambda d: _rewrite(d, lambda h: h.update(__metadata__={"a": {"b": 1}})), "__metadata__"),
    (lambda d: _rewrite(d, lambda h: h.update(L4=h["L3"])), "unexpected ['L4']"),
    (lambda d: d[:8] + b"\xff" * 8 + d[16:], "not JSON"),
    (lambda d: (1 << 40).to_bytes(8, "little") + d[8:], "header length"),
])
def test_malformed_payloads_are_refused(make, msg):
    data = make(kv())
    plan = check_header(header(data), LIM)  # the header announces exactly these bytes
    assert msg in refused(InvalidArgument, check_payload, data, plan, LIM)


def test_payload_of_another_shape_or_dtype_is_refused():
    plan_for = lambda d: check_header(header(d), LIM)  # noqa: E731
    # a layer too many (the header's kv_bytes would not even match)
    with pytest.raises(InvalidArgument):
        d = kv(layers=5)
        check_payload(d, plan_for(d), LIM)
    # bfloat16-sized halves announced to a float32 engine
    d = kv(dtype=np.float16, blocks=6)
    with pytest.raises(InvalidArgument, match="F16"):
        check_payload(d, plan_for(d), LIM)
    # tensors that are not the engine's per-layer layout, same size
    d = kv(rest=(64, 16))
    assert "expected [3, 4, 16, 64]" in refused(InvalidArgument, check_payload, d, plan_for(d),
                                                LIM)
    # a layout the agent could not learn from the engine: the element count still has to fit
    loose = ImportLimits(**{**LIM.__dict__, "kv_rest": None})
    assert check_payload(d, check_header(header(d), loose), loose) == 3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_kv_is_refused(bad):
    d = bytearray(kv())
    plan = check_header(header(bytes(d)), LIM)
    at = len(d) - 4 * 100
    d[at:at + 4] = struct.pack("<f", bad)
    assert "L3 holds a NaN or infinity" in refused(InvalidArgument, check_payload, bytes(d),
                                                    plan, LIM)


def test_short_or_long_payload_is_refused():
    data = kv()
    plan = check_header(header(data), LIM)
    assert "incomplete" in refused(InvalidArgument, check_payload, data[:-1], plan, LIM)
    assert "incomplete" in refused(InvalidArgument, check_payload, data + b"x", plan, LIM)


def test_bfloat16_engine_checks_bf16_exponents():
    lim = ImportLimits(**{**LIM.__dict__, "kv_dtype": "bfloat16"})
    raw = np.full((3, 4, 16, 64), 0x3F80, dtype=np.uint16)  # 1.0 in bfloat16
    tensors = {f"L{i}": raw for i in range(4)}
    data = bytearray(save(tensors))
    data = bytes(data)
    n = int.from_bytes(data[:8], "little")
    data = _rewrite(data, lambda h: [h[k].update(dtype="BF16") for k in h if k.startswith("L")])
    plan = check_header(header(data), lim)
    assert check_payload(data, plan, lim) == 3
    nan = bytearray(data)
    nan[8 + n + 10:8 + n + 12] = (0x7FC0).to_bytes(2, "little")
    assert "NaN" in refused(InvalidArgument, check_payload, bytes(nan), plan, lim)


# ---------------------------------------------------------------------------- targets

NODES = [("node-a", "10.0.0.1:50061"), ("node-b", "10.0.0.2:50061")]


def test_target_by_name_or_address_of_a_registered_node():
    assert match_target(NODES, "node-b", "", "node-a") == ("node-b", "10.0.0.2:50061")
    assert match_target(NODES, "node-b", "10.0.0.2:50061", "node-a") == ("node-b",
                                                                         "10.0.0.2:50061")
    assert match_target(NODES, "", "10.0.0.2:50061", "node-a") == ("node-b", "10.0.0.2:50061")


@pytest.mark.parametrize("node,addr,exc,msg", [
    ("", "evil.example:443", PermissionDenied, "not the address of a node registered"),
    ("node-z", "", PermissionDenied, "not registered with the controller"),
    ("node-b", "evil.example:443", PermissionDenied, "is not the address node 'node-b'"),
    ("node-a", "", FailedPrecondition, "is this node"),
])
def test_unregistered_targets_are_refused(node, addr, exc, msg):
    with pytest.raises(exc, match=msg):
        match_target(NODES, node, addr, "node-a")


@pytest.mark.parametrize("addr", ["nohost", ":5", "h:0", "h:99999", "h:5 x", "a" * 300 + ":1"])
def test_target_address_must_be_host_port(addr):
    with pytest.raises(InvalidArgument):
        check_address("target_address", addr)


# ---------------------------------------------------------------------------- connector

def test_connector_honours_only_the_agents_own_imports(monkeypatch, tmp_path):
    monkeypatch.setenv(engine_plugin.IMPORT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(engine_plugin.IMPORT_KEY_ENV, "k" * 64)
    good = str(tmp_path / ("import-" + "0" * 32 + ".safetensors"))
    assert engine_plugin.trusted_import(engine_plugin.import_params(good, 5))
    # what an HTTP client could put in kv_transfer_params: no key, a wrong one, other paths
    for p in ({"remp_import": good, "tokens": 5},
              {"remp_import": good, "tokens": 5, "remp_key": "guess"},
              engine_plugin.import_params("/etc/passwd", 5),
              engine_plugin.import_params(f"{tmp_path}/../x/import-{'0' * 32}.safetensors",
                                          5),
              engine_plugin.import_params(str(tmp_path / "import-../../etc.safetensors"), 5),
              engine_plugin.import_params(good, True),
              engine_plugin.import_params(good, 0),
              engine_plugin.import_params(good, "5")):
        assert not engine_plugin.trusted_import(p), p
    monkeypatch.setenv(engine_plugin.IMPORT_KEY_ENV, "")
    assert not engine_plugin.trusted_import(engine_plugin.import_params(good, 5))


# ---------------------------------------------------------------------------- restarts

def test_restart_budget_allows_n_deaths_per_window_with_backoff():
    b = RestartBudget(limit=2, window_s=100)
    assert b.on_death(0.0) == 1
    assert b.on_death(10.0) == 2
    assert b.on_death(20.0) is None  # the third death within 100 s: give up
    b = RestartBudget(limit=2, window_s=100)
    assert b.on_death(0.0) is not None and b.on_death(10.0) is not None
    assert b.on_death(150.0) is not None  # the first two have left the window
    assert RestartBudget(limit=0, window_s=100).on_death(0.0) is None


async def test_a_slow_sender_cannot_hold_an_import_slot(tmp_path):
    """The payload must arrive within its deadline; the partial file is removed."""
    import asyncio

    from node_agent.migration import _receive_payload
    from remp.errors import Unavailable
    from remp.node_agent.v1 import node_agent_pb2 as pb

    async def trickle():
        for _ in range(100):
            yield pb.ImportChunk(kv=b"x")
            await asyncio.sleep(0.05)

    with pytest.raises(Unavailable, match="too slow"):
        await _receive_payload(str(tmp_path), trickle(), 100, deadline_s=0.3)
    assert list(tmp_path.iterdir()) == []

    async def fast():
        yield pb.ImportChunk(kv=b"y" * 10)
    path = await _receive_payload(str(tmp_path), fast(), 10, deadline_s=5)
    with open(path, "rb") as f:
        assert f.read() == b"y" * 10


# ---------------------------------------------------------------- INT8 payloads (issue 18)

def int8_kv(blocks=3, layers=4, rest=(16, 64), q=5, scale=0.01, extra=None, drop=()):
    t = {}
    for i in range(layers):
        t[f"L{i}"] = np.full((blocks, 4, *rest), q, dtype=np.int8)
        t[f"L{i}.scale"] = np.full((blocks, 4), scale, dtype=np.float32)
    for k in drop:
        t.pop(k)
    t.update(extra or {})
    return save(t)


def int8_header(data: bytes, **kw) -> pb.ImportHeader:
    return header(data, kv_format=pb.KV_FORMAT_INT8, **kw)


def test_an_int8_export_passes_and_its_size_is_exact():
    data = int8_kv()
    plan = check_header(int8_header(data), LIM)
    assert plan.kv_format == "int8" and 3 in plan.blocks
    assert check_payload(data, plan, LIM) == 3
    # tensors: one byte per element + a float32 per (layer, block, KV head): the cost model's
    tensor_bytes = len(data) - 8 - int.from_bytes(data[:8], "little")
    full = 3 * LIM.block_bytes
    from remp.recovery import int8_payload_bytes
    assert tensor_bytes == int8_payload_bytes(full, 4, LIM.group_elements) \
        == 3 * LIM.format_block_bytes("int8")
    assert full / tensor_bytes == pytest.approx(3.98, abs=0.01)
    # the same bytes announced as the full format do not fit the model's full-width size
    assert "is not the size" in refused(InvalidArgument, check_header, header(data), LIM)
    # and a full payload announced as INT8 neither
    assert "is not the size" in refused(InvalidArgument, check_header, int8_header(kv()), LIM)


def test_an_unknown_kv_format_is_refused():
    data = kv()
    assert "kv_format 7" in refused(InvalidArgument, check_header, header(data, kv_format=7),
                                    LIM)
    # UNSPECIFIED (a sender from before INT8) is the full format
    assert check_header(header(data, kv_format=0), LIM).kv_format == "full"


@pytest.mark.parametrize("scale,msg", [
    (float("nan"), "not finite"), (float("inf"), "not finite"), (-0.5, "negative"),
    (1e37, "above"),  # 127 steps of it overflow float32
])
def test_int8_bad_scales_are_refused(scale, msg):
    data = int8_kv(scale=scale)
    plan = check_header(int8_header(data), LIM)
    assert "L0.scale" in refused(InvalidArgument, check_payload, data, plan, LIM)


def test_int8_zero_scale_only_for_an_all_zero_group():
    zero = int8_kv(q=0, scale=0.0)
    assert check_payload(zero, check_header(int8_header(zero), LIM), LIM) == 3
    bad = int8_kv(q=3, scale=0.0)
    assert "is 0 where L0 is not all zero" in refused(
        InvalidArgument, check_payload, bad, check_header(int8_header(bad), LIM), LIM)


def test_int8_minus_128_is_refused():
    data = int8_kv(q=-128)
    assert "-128" in refused(InvalidArgument, check_payload, data,
                             check_header(int8_header(data), LIM), LIM)


@pytest.mark.parametrize("make,msg", [
    # scales as int32: the same size, the wrong dtype
    (lambda: int8_kv(extra={f"L{i}.scale": np.full((3, 4), 1, np.int32)
                            for i in range(4)}), "expected F32"),
    (lambda: int8_kv(extra={"L0": np.full((3, 4, 16, 64), 1, np.uint8)}), "expected I8"),
    (lambda: int8_kv(extra={"L0.scale": np.full((4, 3), 0.01, np.float32)}), "has shape"),
    (lambda: int8_kv(drop=["L3.scale"], extra={"L3.scales": np.full((3, 4), 0.01, np.float32)}),
     "L<i>.scale"),
])
def test_int8_tensor_names_dtypes_and_shapes_are_exact(make, msg):
    data = make()
    try:
        plan = check_header(int8_header(data), LIM)
    except InvalidArgument as exc:  # a size the format cannot have is refused at the header
        assert "is not the size" in str(exc)
        return
    assert msg in refused(InvalidArgument, check_payload, data, plan, LIM)


def test_int8_payload_wrong_size_is_refused():
    data = int8_kv()
    plan = check_header(int8_header(data), LIM)
    assert "incomplete" in refused(InvalidArgument, check_payload, data[:-1], plan, LIM)
    assert "incomplete" in refused(InvalidArgument, check_payload, data + b"\0", plan, LIM)
