"""Trace loaders: real slices of every shared trace, the bundled week, and the csv format."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gpusched.sim.traces import (
    DEFAULT_TRACE,
    TraceError,
    burst_jobs,
    default_class,
    guess_format,
    jittered,
    load_trace,
    parse_burst,
)

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
needs_shared = pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces not present")


def head(src: Path, dst: Path, n: int) -> Path:
    """The header and first n data rows of a real trace."""
    with open(src) as f:
        dst.write_text("".join(itertools.islice(f, n + 1)))
    return dst


def test_bundled_week_has_teams_from_the_vc_file():
    jobs = load_trace()
    assert len(jobs) == 7748
    assert jobs[0].job_id == "0" and jobs[0].team == "6214e9" and jobs[0].gpus == 1
    assert jobs[0].duration_s == 826952 and jobs[0].submit_s == 0
    assert jobs[1].team == "11cb48" and jobs[1].submit_s == 16
    assert sum(j.gpu_s for j in jobs) / 3600 == pytest.approx(124066, abs=1)
    assert len({j.team for j in jobs}) == 11
    assert all(a.submit_s <= b.submit_s for a, b in zip(jobs, jobs[1:]))


def test_jitter_moves_each_submission_later_by_under_a_second_the_same_way_per_seed():
    jobs = load_trace(limit=500)
    one, again, other = jittered(jobs, 1), jittered(jobs, 1), jittered(jobs, 2)
    assert one == again and one != other
    assert all(a.submit_s <= b.submit_s for a, b in zip(one, one[1:]))
    moved = {j.job_id: j.submit_s for j in one}
    assert all(0 <= moved[j.job_id] - j.submit_s < 1 for j in jobs)
    assert len({round(moved[j.job_id] - j.submit_s, 6) for j in jobs}) > 400  # not one shift for all
    assert [j.duration_s for j in sorted(one, key=lambda j: int(j.job_id))] == \
        [j.duration_s for j in sorted(jobs, key=lambda j: int(j.job_id))]


def test_limit_and_time_zero():
    jobs = load_trace(limit=50)
    assert len(jobs) == 50 and jobs[0].submit_s == 0


@needs_shared
def test_philly_csv_sorted_and_rebased(tmp_path):
    path = head(TRACES / "philly" / "philly.csv", tmp_path / "philly.csv", 200)
    jobs = load_trace(path, "philly")
    assert len(jobs) == 200
    assert jobs[0].submit_s == 0
    assert all(a.submit_s <= b.submit_s for a, b in zip(jobs, jobs[1:]))
    # the first data row: 2017-10-09 07:01:55, 66 s, 1 GPU, VC 11cb48 -> job id "1" (its line - 1)
    first = next(j for j in jobs if j.job_id == "1")
    assert (first.duration_s, first.gpus, first.team) == (66.0, 1, "11cb48")
    assert guess_format(path) == "philly"


@needs_shared
def test_tiresias_sample_has_one_team():
    jobs = load_trace(TRACES / "tiresias-sample" / "60_job.csv")
    assert len(jobs) == 60
    assert {j.team for j in jobs} == {"default"}
    assert sorted({j.gpus for j in jobs}) == [1, 2, 4, 8]
    assert jobs[1].gpus == 8 and jobs[1].duration_s == 147 and jobs[1].submit_s == 30


@needs_shared
def test_derived_week_in_shared_matches_bundled_copy():
    shared = load_trace(TRACES / "philly" / "derived" / "philly_2017-10-23_7d_tiresias.csv", "tiresias", limit=300)
    assert shared == load_trace(DEFAULT_TRACE, limit=300)


@needs_shared
def test_alibaba_mapping(tmp_path):
    path = head(TRACES / "alibaba-gpu-v2023" / "openb_pod_list_default.csv", tmp_path / "openb_pod_list_x.csv", 400)
    jobs = load_trace(path)
    assert guess_format(path) == "alibaba"
    assert jobs and all(j.gpus >= 1 for j in jobs)  # CPU-only pods are skipped
    first = jobs[0]  # openb-pod-0000: LS, 1 GPU, scheduled 0, deleted 12537496
    assert (first.job_id, first.team, first.priority, first.preemptible) == ("openb-pod-0000", "LS", "high", False)
    assert first.duration_s == 12537496
    shared = next(j for j in jobs if j.job_id == "openb-pod-0001")  # gpu_milli 460: a share of one GPU
    assert (shared.gpus, shared.gpu_milli, shared.fraction) == (1, 460, 0.46)
    assert first.fraction is None  # openb-pod-0000 asks a whole GPU
    assert {j.team for j in jobs} <= {"LS", "BE", "Burstable", "Guaranteed"}


def test_default_class_is_deterministic_and_mostly_normal():
    classes = [default_class(str(i)) for i in range(2000)]
    assert classes == [default_class(str(i)) for i in range(2000)]
    normal = sum(1 for p, _ in classes if p == "normal") / len(classes)
    assert 0.8 < normal < 0.9
    assert all(pre for p, pre in classes if p in ("normal", "low"))
    assert not any(pre for p, pre in classes if p == "high")


def test_csv_format_full(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "job_id,submit_time_s,duration_s,num_gpus,team,priority,preemptible,min_gpus,max_gpus,time_limit_s\n"
        "b,10,100,4,vision,high,false,2,8,3600\n"
        "a,5,50,1,nlp,,,,,\n"
    )
    jobs = load_trace(path, "csv")
    assert [j.job_id for j in jobs] == ["a", "b"]
    a, b = jobs
    assert a.submit_s == 0 and b.submit_s == 5  # rebased on the first submission
    assert (b.gpus, b.team, b.priority, b.preemptible, b.min_gpus, b.max_gpus, b.time_limit_s) == (
        4, "vision", "high", False, 2, 8, 3600.0)
    assert (a.priority, a.preemptible) == default_class("a")


@pytest.mark.parametrize(
    "row, message",
    {
        "bad number": ("x,abc,10,1,t", "2: column submit_time_s: 'abc' is not a valid float"),
        "zero gpus": ("x,0,10,0,t", "2: column num_gpus: 0 is below the minimum 1"),
        "zero duration": ("x,0,0,1,t", "2: column duration_s: must be > 0"),
        "no team": ("x,0,10,1,", "2: empty team"),
        "bad priority": ("x,0,10,1,t,urgent", "2: column priority: 'urgent' is not one of"),
        "bad bool": ("x,0,10,1,t,,maybe", "2: column preemptible: 'maybe' is not a boolean"),
        "min above size": ("x,0,10,2,t,,,4", "2: min_gpus 4 > num_gpus 2"),
    }.values(),
    ids=["bad number", "zero gpus", "zero duration", "no team", "bad priority", "bad bool", "min above size"],
)
def test_csv_bad_row_names_the_line(tmp_path, row, message):
    path = tmp_path / "bad.csv"
    path.write_text("job_id,submit_time_s,duration_s,num_gpus,team,priority,preemptible,min_gpus\n" + row + "\n")
    with pytest.raises(TraceError, match=str(path).replace(".", r"\.") + ":" + _re(message)):
        load_trace(path, "csv")


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_csv_later_line_and_duplicates(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("job_id,submit_time_s,duration_s,num_gpus,team\na,0,1,1,t\nb,0,1,1,t\na,0,1,1,t\n")
    with pytest.raises(TraceError, match=r"dup\.csv:4: duplicate job_id 'a'"):
        load_trace(path, "csv")


def test_csv_missing_column(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("job_id,submit_time_s,duration_s,num_gpus\na,0,1,1\n")
    with pytest.raises(TraceError, match=r"m\.csv:1: missing column\(s\) team"):
        load_trace(path, "csv")


def test_interactive_burst():
    spec = parse_burst("team=nlp,at=86400,count=3,gpus=2,duration=600,every=10")
    jobs = burst_jobs(spec)
    assert [(j.submit_s, j.gpus, j.team, j.priority, j.preemptible) for j in jobs] == [
        (86400, 2, "nlp", "interactive", False), (86410, 2, "nlp", "interactive", False),
        (86420, 2, "nlp", "interactive", False)]
    with pytest.raises(TraceError, match="bad item 'colour=red'"):
        parse_burst("colour=red")


def test_sim_quotas_file_gives_real_terms(tmp_path):
    from gpusched.core.model import TeamQuota
    from gpusched.sim.traces import TraceError, load_quotas

    good = tmp_path / "q.csv"
    good.write_text("team,guaranteed,weight,limit\nvision,8,2,24\nnlp,4,,\n")
    assert load_quotas(good) == {"vision": TeamQuota(8, 2.0, 24), "nlp": TeamQuota(4, 1.0, None)}
    bad = tmp_path / "bad.csv"
    bad.write_text("team,guaranteed,weight,limit\nvision,-1,1,\n")
    with pytest.raises(TraceError, match=r"bad.csv:2: .*guaranteed"):
        load_quotas(bad)
    (tmp_path / "cols.csv").write_text("team,guaranteed\nx,1\n")
    with pytest.raises(TraceError, match="missing column"):
        load_quotas(tmp_path / "cols.csv")
