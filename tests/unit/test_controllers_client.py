"""remp/controllers.py, the pure parts: the address list and where a failed call goes next
(controller HA). The failed calls are real grpc.aio.AioRpcError values, as a channel makes them."""

import grpc
import pytest

from remp.controllers import RESUMABLE, addresses, leader_of, next_address, refused_unsent


def err(code, details="", leader=None):
    md = grpc.aio.Metadata(("remp-leader", leader)) if leader is not None else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), md, details)


U = grpc.StatusCode.UNAVAILABLE


def test_addresses_are_bounded_host_ports():
    assert addresses("a:1, b:2,,a:1") == ["a:1", "b:2"]
    assert addresses(["[::1]:50051"]) == ["[::1]:50051"]
    for bad in ("", " , ", "a", "a:0", "a:65536", "a:x", "a b:1", "a:1/x", "u@a:1",
                "h" * 300 + ":1", ",".join(f"h{i}:1" for i in range(17))):
        with pytest.raises(ValueError):
            addresses(bad)


def test_a_follower_names_the_leader_once_an_unreachable_one_moves_on():
    addrs = ["a:1", "b:2", "c:3"]
    not_leader = err(U, "not the leader; leader at c:3", "c:3")
    assert leader_of(not_leader) == "c:3" and refused_unsent(not_leader)
    assert next_address(not_leader, addrs, {"a:1"}) == "c:3"
    assert next_address(not_leader, addrs, {"a:1", "c:3"}) == "b:2"  # it was tried: rotate
    assert next_address(err(U, "not the leader; no leader elected yet, retry shortly"),
                        addrs, {"a:1"}) == "b:2"
    down = err(U, "failed to connect to all addresses; last error: Connection refused")
    assert next_address(down, addrs, {"a:1"}) == "b:2"
    assert next_address(down, addrs, set(addrs)) == ""
    # the leader's own answers, and a call cut off mid-way (its effect unknown): as they are
    for answer in (err(U, "agent n1 unreachable"), err(U, "Socket closed"),
                   err(grpc.StatusCode.NOT_FOUND, "unknown node"),
                   err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")):
        assert next_address(answer, addrs, {"a:1"}) == ""
    # a leader hint that is not host:port is ignored
    assert leader_of(err(U, "not the leader", "evil\nheader")) == ""
    assert grpc.StatusCode.INVALID_ARGUMENT not in RESUMABLE and U in RESUMABLE
