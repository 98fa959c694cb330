"""Proto round trips, enum conventions, the service contract and the generated-code check."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor, timestamp_pb2

from remp import protogen
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.node_agent.v1 import node_agent_pb2
from remp.policy.v1 import policy_pb2

MODULES = [types_pb2, controller_pb2, node_agent_pb2, policy_pb2]
ROOT = Path(__file__).resolve().parents[2]


def _fill(msg, depth=0):
    """Set every field of ``msg`` to a non-default value (recursively), deterministically."""
    for i, f in enumerate(msg.DESCRIPTOR.fields, start=1):
        repeated = f.is_repeated
        if f.type == descriptor.FieldDescriptor.TYPE_MESSAGE and \
                f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            getattr(msg, f.name)[f"{f.name}-{i}"] = (
                0.5 + i if vf.type == descriptor.FieldDescriptor.TYPE_DOUBLE else f"v-{i}-é")
            continue
        if f.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            target = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
            if f.message_type.full_name == "google.protobuf.Timestamp":
                target.CopyFrom(timestamp_pb2.Timestamp(seconds=1_700_000_000 + i, nanos=i))
            else:
                _fill(target, depth + 1)
            continue
        if f.type == descriptor.FieldDescriptor.TYPE_ENUM:
            value = f.enum_type.values[-1].number
        elif f.type == descriptor.FieldDescriptor.TYPE_STRING:
            value = f"{f.name}-{i}-é"
        elif f.type == descriptor.FieldDescriptor.TYPE_BOOL:
            value = True
        elif f.type in (descriptor.FieldDescriptor.TYPE_DOUBLE, descriptor.FieldDescriptor.TYPE_FLOAT):
            value = 0.5 + i
        elif f.type == descriptor.FieldDescriptor.TYPE_BYTES:
            value = bytes([i])
        else:
            value = 2**31 + i if f.type in (descriptor.FieldDescriptor.TYPE_UINT64,
                                             descriptor.FieldDescriptor.TYPE_INT64) else i
        if repeated:
            getattr(msg, f.name).append(value)
        else:
            setattr(msg, f.name, value)
    return msg


def all_messages():
    for mod in MODULES:
        for name, desc in mod.DESCRIPTOR.message_types_by_name.items():
            yield pytest.param(getattr(mod, name), id=desc.full_name)


@pytest.mark.parametrize("cls", list(all_messages()))
def test_round_trip_every_message(cls):
    msg = _fill(cls())
    assert msg.ListFields() or not cls.DESCRIPTOR.fields, "filled message has fields"
    data = msg.SerializeToString()
    back = cls.FromString(data)
    assert back == msg
    assert back.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)


def test_every_enum_starts_with_unspecified_zero():
    for mod in MODULES:
        for name, enum in mod.DESCRIPTOR.enum_types_by_name.items():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), f"{name}: value 0 is {zero}"


def test_phase_order_matches_transaction():
    names = [types_pb2.Phase.Name(n) for n in range(1, 9)]
    assert names == ["PHASE_SERVING_OLD", "PHASE_QUIESCING", "PHASE_PREPARING_WORKERS",
                     "PHASE_MPU_APPLIED", "PHASE_MIGRATE_KV", "PHASE_RELOAD_SHARDS",
                     "PHASE_REBINDING", "PHASE_SERVING_NEW"]


@pytest.mark.parametrize("mod,service,methods", [
    (controller_pb2, "Controller", {"Reconfigure", "Plan", "GetState", "ListNodes", "Watch", "Abort",
                                    "GetSwitch", "ListSwitches", "RegisterNode", "Heartbeat",
                                    "GetTraffic", "RecordRecommendation", "DrainNode",
                                    "ListRecoveries", "Rollout", "GetRollout", "ListRollouts",
                                    "ControlRollout"}),
    (node_agent_pb2, "NodeAgent", {"Describe", "ExecuteSwitch", "AbortSwitch", "GetSwitch",
                                   "ListRequests", "MigrateRequest", "ImportRequest",
                                   "SetDraining"}),
    (policy_pb2, "Policy", {"GetForecast", "GetRecommendation", "SetMode", "ListDecisions"}),
])
def test_service_contract(mod, service, methods):
    svc = mod.DESCRIPTOR.services_by_name[service]
    assert svc.full_name == f"remp.{mod.DESCRIPTOR.package.split('.')[1]}.v1.{service}"
    assert {m.name for m in svc.methods} == methods


def test_streaming_methods():
    na = node_agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].methods_by_name
    assert na["ExecuteSwitch"].server_streaming and not na["Describe"].server_streaming
    assert na["MigrateRequest"].server_streaming and not na["MigrateRequest"].client_streaming
    assert na["ImportRequest"].server_streaming and na["ImportRequest"].client_streaming
    ctl = controller_pb2.DESCRIPTOR.services_by_name["Controller"].methods_by_name
    assert ctl["Watch"].server_streaming


def test_generated_code_is_current():
    r = subprocess.run([sys.executable, "-m", "remp.protogen", "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_generated_code_check_detects_drift(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "protos", root / "protos")
    shutil.copytree(ROOT / "remp", root / "remp", ignore=shutil.ignore_patterns("__pycache__"))
    assert protogen.main(["--check", "--root", str(root)]) == 0
    proto = root / "protos/remp/node_agent/v1/node_agent.proto"
    proto.write_text(proto.read_text().replace("message GetSwitchRequest {",
                                               "message GetSwitchRequest {\n  bool extra = 9;"))
    assert protogen.main(["--check", "--root", str(root)]) == 1
    assert protogen.main(["--root", str(root)]) == 0  # regenerate
    assert protogen.main(["--check", "--root", str(root)]) == 0
