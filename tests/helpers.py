"""Test helpers: the process and client helpers live in devstack.agentproc (shared with bench/)."""

from devstack.agentproc import (  # noqa: F401
    AGENT_SERVICE, GRPCURL, AgentProcess, arm_migration, arm_switch, complete, disarm,
    execute_switch, free_port, grpcurl, prompt, stream_completion, switch_under_load,
    wait_running,
)
