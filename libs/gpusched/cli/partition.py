"""`gpusched partition`: the partitions the reconciler declared (many nodes silent at once),
and an admin's confirmation that their nodes are gone.

`gpusched partition` lists the nodes held in a declared partition (their jobs kept, not
requeued, no new work on them). `gpusched partition confirm [NODE...]` (admin; default: every
partitioned node) appends `PartitionEnded(lost=True)`: the nodes are lost as by `NodeLost` and
their jobs requeued from their checkpoints. Confirm only once the cut-off nodes' jobs are known
to have stopped (their agents fence themselves after `node_timeout_s - margin`, docs/operating.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from gpusched.cli.output import CONNECTION, UsageError
from gpusched.core import events as ev


async def partition_data(nats: str | None, creds: str | None = None) -> list[str]:
    from gpusched.cli.reads import fold_state

    state = await fold_state(nats, use_snapshot=False, creds=creds)
    return sorted(n for n, node in state.nodes.items() if node.partitioned and not node.lost)


async def confirm(nats: str | None, nodes: list[str], reason: str, creds: str | None = None) -> list[str]:
    from gpusched.bus.cas import append_cas
    from gpusched.cli.reads import open_log
    from gpusched.services.runtime import FoldedLog

    log = await open_log(nats, creds)
    folded = FoldedLog(log)
    try:
        await folded.start()
        held = sorted(n for n, node in folded.state.nodes.items() if node.partitioned and not node.lost)
        unknown = sorted(set(nodes) - set(held))
        if unknown:
            raise UsageError(f"not in a declared partition: {', '.join(unknown)} (partitioned: {', '.join(held) or 'none'})")
        chosen = nodes or held
        if chosen:
            _, conflicted = await append_cas(folded, [ev.PartitionEnded(at=time.time(), nodes=chosen,
                                                                       reason=reason, lost=True)])
            if conflicted:
                raise UsageError("the log moved under the confirmation; run it again")
        return chosen
    finally:
        await folded.stop()
        await log.close()


def cmd_partition(args: argparse.Namespace) -> int:
    if args.action == "confirm":
        done = asyncio.run(confirm(args.nats, args.nodes, f"admin confirmed lost: {args.reason}", args.creds))
        print(json.dumps({"confirmed_lost": done}) if args.json else
              (f"confirmed lost: {', '.join(done)}" if done else "no declared partition"))
        return 0
    if args.nodes:
        raise UsageError("nodes are named only with `confirm`")
    held = asyncio.run(partition_data(args.nats, args.creds))
    print(json.dumps({"partitioned": held}) if args.json else
          (f"in a declared partition: {', '.join(held)}" if held else "no declared partition"))
    return 0


def register(sub) -> None:
    p = sub.add_parser("partition", help="nodes in a declared partition; `confirm`: an admin declares them lost",
                       description=__doc__.split("\n\n")[1].replace("\n", " "), parents=[CONNECTION])
    p.add_argument("action", nargs="?", choices=["show", "confirm"], default="show",
                   help="show (default): the partitioned nodes; confirm: declare them lost (admin)")
    p.add_argument("nodes", nargs="*", help="confirm: these nodes only (default: every partitioned node)")
    p.add_argument("--reason", default="by an admin", help="confirm: why, in the log")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_partition)


__all__ = ["register", "confirm", "partition_data"]
