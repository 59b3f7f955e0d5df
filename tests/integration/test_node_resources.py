"""A node daemon registers the CPUs and memory it offers, and registers again when a restart
offers other amounts (`--cpus`, `--mem`); one that declares none leaves what the log says.
Real node daemons on a real log."""

from __future__ import annotations

from gpusched.core import events as ev

from .node_helpers import Cluster


async def test_a_restarted_daemon_offering_other_cpus_registers_them(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        first = await c.start_nodes(["r0"], gpus=2, cpus=4.0, memory_mb=2048)
        await c.wait(lambda s: (s.nodes["r0"].cpus, s.nodes["r0"].memory_mb) == (4.0, 2048), "declared")
        await first.stop()
        c.hosts.remove(first)
        second = await c.start_nodes(["r0"], gpus=2, cpus=6.0, memory_mb=2048)
        await c.wait(lambda s: s.nodes["r0"].cpus == 6.0, "declared anew")
        await second.stop()
        c.hosts.remove(second)
        await c.start_nodes(["r0"], gpus=2)  # declares nothing: the log's amounts stay
        await c.refold()
        regs = [e for e in c.history if isinstance(e, ev.NodeRegistered)]
        assert [(e.cpus, e.memory_mb) for e in regs] == [(4.0, 2048), (6.0, 2048)]
        assert c.state.nodes["r0"].cpus == 6.0
