"""The runtime model and the metric helpers, with answers worked out by hand."""

from __future__ import annotations

import pytest

from gpusched.core.model import TeamQuota
from gpusched.sim.engine import Cluster, default_quotas
from gpusched.sim.metrics import entitlements, jain, percentile, size_bucket
from gpusched.sim.runtime_model import IDEAL, REALISTIC
from gpusched.sim.traces import TraceJob


def test_speed_by_level_and_size():
    assert REALISTIC.speed(8, 8, "nvlink") == 1.0
    assert REALISTIC.speed(8, 8, "node") == 1.0
    assert REALISTIC.speed(16, 16, "rack") == pytest.approx(1 / 1.15)
    assert REALISTIC.speed(16, 16, "cluster") == pytest.approx(1 / 1.3)
    assert REALISTIC.speed(4, 8, "nvlink") == 0.5  # elastic: linear in the GPUs held
    assert IDEAL.speed(16, 16, "cluster") == 1.0
    assert IDEAL.lossless and IDEAL.checkpoint_s == 0 and IDEAL.restore_s == 0
    assert not REALISTIC.lossless and REALISTIC.checkpoint_interval_s > 0


def test_cluster_shape_and_best_level():
    c = Cluster.parse("2x32x8")
    assert c.total_gpus == 512
    assert [c.best_level(g) for g in (1, 2, 8, 9, 256, 257)] == ["nvlink", "nvlink", "nvlink", "rack", "rack", "cluster"]
    q = Cluster.parse("1x4x8", "pairs")
    assert [q.best_level(g) for g in (2, 3, 8, 16)] == ["nvlink", "node", "node", "rack"]
    regs = q.registrations()
    assert len(regs) == 4 and [g.nvlink_domain for g in regs[0].gpus] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="RxNxG"):
        Cluster.parse("512")


def test_percentile_and_jain():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert jain([1, 1, 1]) == 1.0
    assert jain([1, 0, 0, 0]) == 0.25
    assert jain([2, 1]) == pytest.approx(9 / 10)
    assert [size_bucket(g) for g in (1, 2, 4, 5, 8, 9)] == ["1", "2-4", "2-4", "5-8", "5-8", ">8"]


def test_entitlements_guarantee_then_water_filling():
    quotas = {"a": TeamQuota(guaranteed=6), "b": TeamQuota(guaranteed=2), "c": TeamQuota(guaranteed=0, limit=1)}
    # 14 GPUs. a asks 20: guaranteed 6; b asks 3: guaranteed 2; c asks 5 but its limit is 1.
    # Left 14 - 8 = 6, 2 each by weight: c is capped at 1, b needs only 1 more; a gets the other 4.
    got = entitlements(14, {"a": 20, "b": 3, "c": 5}, quotas)
    assert got == pytest.approx({"a": 10.0, "b": 3.0, "c": 1.0})
    # 10 GPUs: left 2, 2/3 each, nobody is capped.
    got = entitlements(10, {"a": 20, "b": 3, "c": 5}, quotas)
    assert got == pytest.approx({"a": 6 + 2 / 3, "b": 2 + 2 / 3, "c": 2 / 3})
    # A team without demand is entitled to nothing; its guarantee goes to the others.
    got = entitlements(10, {"a": 20, "b": 0, "c": 0}, quotas)
    assert got == {"a": 10.0}
    got = entitlements(12, {"a": 20, "b": 20}, {"a": TeamQuota(guaranteed=2), "b": TeamQuota(guaranteed=2, weight=3)})
    assert got == pytest.approx({"a": 4.0, "b": 8.0})


def test_default_quotas_proportional_to_demand():
    jobs = [TraceJob("1", 0, 100, 1, "x"), TraceJob("2", 0, 100, 3, "y")]
    q = default_quotas(jobs, 16)
    assert q["x"] == TeamQuota(guaranteed=4, weight=1.0, limit=None)
    assert q["y"].guaranteed == 12
