"""The node daemon (imports nothing, so that e.g. the fence keeper's process stays small):
`main.py` (entry points: `serve`, `run_nodeagent`, `run_simulated_nodes`, `main`), `host.py`
(`NodeHost`: one connection and fold for one or many agents; its writer `appends.py`, its read
barrier `readbarrier.py`), `agent.py` (`NodeAgent`: one node, following the log) with its
concerns `launch.py`, `runs.py`, `handshake.py` (checkpoints), `adoption.py`, `node_control.py`,
`registration.py`; `agent_config.py` (`AgentConfig`); `backends.py` (NVML and simulated GPUs);
`launcher.py` (job processes); `fencing.py` and `keeper.py` (never two running copies)."""
