"""Where MigrateRequest may send a request (node_agent.migration.resolve_target): a configured
migration peer, or a node the controller has registered — asked over a real grpc.aio link with
the agent's own credential. Anything else is refused before a byte leaves the agent."""

from types import SimpleNamespace

import pytest

from node_agent.migration import resolve_target
from remp.auth import Credentials, Role
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.errors import FailedPrecondition, PermissionDenied, Unavailable
from remp.grpc_util import make_server
from remp.node_agent.v1 import node_agent_pb2 as pb


class FakeController(controller_pb2_grpc.ControllerServicer):
    def __init__(self):
        self.seen: list[dict] = []

    async def ListNodes(self, request, context):
        self.seen.append(dict(context.invocation_metadata()))
        return controller_pb2.ListNodesResponse(nodes=[
            controller_pb2.NodeState(node="node-a", agent_address="127.0.0.1:7001"),
            controller_pb2.NodeState(node="node-b", agent_address="127.0.0.1:7002")])


@pytest.fixture
async def controller():
    fake = FakeController()
    server, _, port = make_server(["remp.controller.v1.Controller"], "127.0.0.1", 0,
                                  auth=Credentials.load())
    controller_pb2_grpc.add_ControllerServicer_to_server(fake, server)
    await server.start()
    yield f"127.0.0.1:{port}", fake
    await server.stop(0)


def agent(controller_addr=None, peers=None):
    settings = SimpleNamespace(controller=controller_addr, migration_peers=peers, node="node-a")
    return SimpleNamespace(cfg=SimpleNamespace(settings=settings,
                                               credentials=Credentials.load()))


async def test_registered_nodes_are_asked_of_the_controller_with_the_agents_credential(
        controller):
    addr, fake = controller
    a = agent(addr)
    assert await resolve_target(a, pb.MigrateRequestRequest(target_node="node-b")) == \
        ("node-b", "127.0.0.1:7002")
    assert await resolve_target(a, pb.MigrateRequestRequest(
        target_address="127.0.0.1:7002")) == ("node-b", "127.0.0.1:7002")
    token = Credentials.load().tokens[Role.AGENT]
    assert fake.seen and all(md["authorization"] == f"Bearer {token}" for md in fake.seen)
    with pytest.raises(PermissionDenied, match="not the address of a node registered"):
        await resolve_target(a, pb.MigrateRequestRequest(target_address="10.6.6.6:443"))
    with pytest.raises(PermissionDenied, match="is not the address node 'node-b'"):
        await resolve_target(a, pb.MigrateRequestRequest(target_node="node-b",
                                                         target_address="10.6.6.6:443"))
    with pytest.raises(FailedPrecondition, match="is this node"):
        await resolve_target(a, pb.MigrateRequestRequest(target_node="node-a"))


async def test_peers_need_no_controller_and_nothing_else_is_allowed():
    a = agent(None, peers=["127.0.0.1:7009"])
    assert await resolve_target(a, pb.MigrateRequestRequest(
        target_address="127.0.0.1:7009", target_node="x")) == ("x", "127.0.0.1:7009")
    with pytest.raises(FailedPrecondition, match="no controller to ask"):
        await resolve_target(a, pb.MigrateRequestRequest(target_address="127.0.0.1:7002"))


async def test_an_unreachable_controller_keeps_the_request_here():
    with pytest.raises(Unavailable, match="the request stays here"):
        await resolve_target(agent("127.0.0.1:1"), pb.MigrateRequestRequest(
            target_address="127.0.0.1:7002"))
