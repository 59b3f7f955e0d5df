"""The fold's reducers, one module per concern; `ClusterState.apply` (core/state.py) holds the
one table that sends each fact to its reducer.

- `checks`: what a fact may say (its node, its time, its chain number) and `violate`;
- `jobs`: a job's lifecycle, from submit to its end; `arrays`: job arrays' tasks and index;
- `holdings`: who holds each GPU, and the nodes' CPUs and memory; `fence`: where an attempt
  may still run;
- `nodes`: nodes and GPUs registered, labeled, drained, partitioned, lost, quarantined;
- `teams`: quotas, limits, decayed usage and idle accounting;
- `forgetting`: finished jobs forgotten, then retired, past their horizons.

Each reducer is a function of the state (`st`), not a method: `ClusterState` keeps the data
and the queries, and a concern's rules read in one file instead of across one long class.
"""
