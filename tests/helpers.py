"""Test helpers: the process and client helpers live in devstack.agentproc (shared with bench/)."""

from devstack.agentproc import (  # noqa: F401
    AGENT_SERVICE, GRPCURL, AgentProcess, arm_migration, arm_switch, complete, disarm,
    execute_switch, free_port, grpcurl, prompt, stream_completion, switch_under_load,
    wait_running,
)

# Agents whose tests switch with requests mid-decode serve the tiny model's whole context: on an
# idle 2-core machine it decodes ~290 tokens/s per request (fp32 TP2PP1), so 160-token requests
# lasted 0.55 s and could arrive one after another, never all running at once (the start gate
# then let the switch go with none in flight). Their tests ask ~1000 tokens.
LONG_CONTEXT = 2048
