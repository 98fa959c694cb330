"""Test helpers: the process and client helpers live in remp.agentproc (shared with bench/)."""

from remp.agentproc import (  # noqa: F401
    AGENT_SERVICE, GRPCURL, AgentProcess, complete, execute_switch, free_port, grpcurl, prompt,
    stream_completion, switch_under_load,
)
