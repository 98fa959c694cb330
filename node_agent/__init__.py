"""remp node agent: one per host; embeds vLLM and executes topology switches in the live engine."""
