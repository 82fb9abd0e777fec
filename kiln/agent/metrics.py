"""Agent-run metrics on the server's Prometheus registry (beside the engine's, on /metrics).

- `kiln:agent_runs_total{model_name, status}`: Responses requests whose tools Kiln ran, by how
  they ended: completed, incomplete, failed, or cancelled (the client left first);
- `kiln:agent_run_turns{model_name}`: model turns per run (each one engine request);
- `kiln:agent_tool_calls_total{model_name, tool_type, outcome}`: the tools Kiln ran
  (`kiln_python` or `mcp`), `ok` or `error` (raised, timed out, bad arguments, unreachable);
- `kiln:agent_tool_seconds{model_name, tool_type}`: how long each call took.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self.runs = Counter("kiln:agent_runs", "Agent runs (Responses requests whose tools Kiln ran), by how they "
                            "ended", ["model_name", "status"], registry=registry)
        self.turns = Histogram("kiln:agent_run_turns", "Model turns per agent run", ["model_name"],
                               buckets=TURN_BUCKETS, registry=registry).labels(model_name)
        self.tool_calls = Counter("kiln:agent_tool_calls", "Tool calls Kiln ran for agent runs",
                                  ["model_name", "tool_type", "outcome"], registry=registry)
        self.tool_seconds = Histogram("kiln:agent_tool_seconds", "Time a tool call Kiln ran took",
                                      ["model_name", "tool_type"], buckets=TOOL_BUCKETS, registry=registry)

    def run_ended(self, status: str, turns: int) -> None:
        self.runs.labels(self.model_name, status).inc()
        self.turns.observe(turns)

    def tool_called(self, tool_type: str, error: bool, seconds: float) -> None:
        self.tool_calls.labels(self.model_name, tool_type, "error" if error else "ok").inc()
        self.tool_seconds.labels(self.model_name, tool_type).observe(seconds)
