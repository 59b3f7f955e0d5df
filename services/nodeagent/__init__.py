"""The node daemon: `agent.py` (agents and the host that runs them), `backends.py` (NVML and
simulated GPUs), `launcher.py` (job processes), `heartbeat.py` (bus messages), `main.py`
(entry points: `run_nodeagent`, `run_simulated_nodes`, `start_simulated_nodes`, `main`)."""

from .main import add_arguments, main, run_nodeagent, run_simulated_nodes, serve, start_simulated_nodes

__all__ = ["add_arguments", "main", "run_nodeagent", "run_simulated_nodes", "serve", "start_simulated_nodes"]
