"""How fast a job runs where it is placed, and what stopping it costs.

A trace duration is the run time alone, at the requested size, on the tightest placement. A
job's work is `duration_s` seconds at speed 1. Its speed is

    (GPUs held / GPUs requested) / slowdown[level spanned]

(linear scaling for elastic jobs; a job placed across racks runs slower). Preemption costs
wall time: saving a checkpoint on request (`checkpoint_s`, progress paused) and restoring it on
the next start (`restore_s`). A forced release loses the work done since the last checkpoint;
jobs save one every `checkpoint_interval_s` of running time. `IDEAL` turns all of this off.
"""

from __future__ import annotations

from msgspec import Struct, field

#: Defaults from published measurements (see docs/results.md): communication-heavy models lose
#: ~10-30% across servers on the same switch and more across racks (Gandiva OSDI'18, Tiresias
#: NSDI'19, Themis NSDI'20 report 1.1-2x); we pick modest values, below most measurements.
REALISTIC_SLOWDOWN: dict[str, float] = {"nvlink": 1.0, "node": 1.0, "rack": 1.15, "block": 1.2, "cluster": 1.3}


class RuntimeModel(Struct, frozen=True, kw_only=True):
    name: str = "realistic"
    slowdown: dict[str, float] = field(default_factory=lambda: dict(REALISTIC_SLOWDOWN))
    checkpoint_interval_s: float = 1800.0  # periodic checkpoints while running
    checkpoint_s: float = 30.0  # time to save a checkpoint when asked to yield
    restore_s: float = 60.0  # time to load it again on the next start
    lossless: bool = False  # ideal: a preempted job keeps every second of progress

    def speed(self, held: int, requested: int, level: str) -> float:
        """Work seconds done per wall second."""
        return (held / requested) / self.slowdown.get(level, 1.0)


REALISTIC = RuntimeModel()
IDEAL = RuntimeModel(name="ideal", slowdown={}, checkpoint_interval_s=0.0, checkpoint_s=0.0, restore_s=0.0,
                     lossless=True)
RUNTIME_MODELS = {"realistic": REALISTIC, "ideal": IDEAL}
