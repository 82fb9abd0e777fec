"""Agent runs: a Responses request whose tools Kiln runs itself (MCP servers' tools, sandboxed
Python), looped turn by turn in the serving engine until the model answers without calling one."""
