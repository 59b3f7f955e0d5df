"""A log that lives for years: sealed segments exported (`log export --from/--until`), the live
stream bounded (`log retention`), and the whole history still verified and rebuilt from the
segments plus what the stream still holds (`replay --from-file SEG ... --and-stream --verify`)."""

from __future__ import annotations

import json
import subprocess
import sys

from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.store import SnapshotStore, fold_log


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


async def test_segments_plus_the_bounded_stream_rebuild_and_verify_the_whole_history(event_log, nats_url, tmp_path):
    for i in range(30):
        await event_log.append(ev.JobSubmitted(at=float(i), job_id=f"j-{i}", spec=JobSpec(team="t", gpus=1)))
    whole = (await fold_log(event_log)).summary()
    first = cli("log", "export", "--nats", nats_url, "--until", "12")
    second = cli("log", "export", "--nats", nats_url, "--from", "13", "--until", "24")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    seg1, seg2 = tmp_path / "seg1.jsonl", tmp_path / "seg2.jsonl"
    seg1.write_text(first.stdout)
    seg2.write_text(second.stdout)
    assert json.loads(second.stdout.splitlines()[0])["first_seq"] == 13

    await SnapshotStore(event_log).save(await fold_log(event_log))  # seq 30, sealed at 31
    shown = cli("log", "retention", "--nats", nats_url, "--max-msgs", "7")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert json.loads(shown.stdout)["first_seq"] == 25 and json.loads(shown.stdout)["newest_snapshot_seq"] == 30

    # the live stream alone no longer holds the history: said, not silently folded short
    short = cli("replay", "--nats", nats_url, "--json")
    assert short.returncode != 0 and "starts at seq 25" in short.stderr
    full = cli("replay", "--nats", nats_url, "--from-file", str(seg1), "--from-file", str(seg2), "--and-stream",
               "--verify", "--json")
    assert full.returncode == 0, full.stdout + full.stderr
    summary = json.loads(full.stdout)
    assert summary["trust"]["first"] is None and summary["trust"]["messages"] == 31
    assert summary["jobs"] == whole["jobs"]
    # a missing segment: the stream does not start where the files end, and it says so
    gap = cli("replay", "--nats", nats_url, "--from-file", str(seg1), "--and-stream", "--verify", "--json")
    assert gap.returncode != 0 and "starts at seq 25" in gap.stderr
    # segments out of order: the audit names the break
    swapped = cli("replay", "--from-file", str(seg2), "--from-file", str(seg1), "--verify", "--json")
    assert swapped.returncode == 1 and json.loads(swapped.stdout)["trust"]["first"]["rule"] == "missing"


def test_a_segment_cut_short_or_edited_is_refused_before_any_fact_is_believed(tmp_path):
    from gpusched.bus.export import ExportError, read_export

    head = {"format": "gpusched-log-export", "version": 2, "stream": "GPUSCHED", "first_seq": 1, "last_seq": 1}
    line = json.dumps({"seq": 1, "time": 1.0, "subject": "gpusched.evt.info.X.s00", "headers": {}, "data": "{}"})
    import hashlib

    seal = {"end": True, "messages": 1, "sha256": hashlib.sha256((line + "\n").encode()).hexdigest()}
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join([json.dumps(head), line, json.dumps(seal)]) + "\n")
    assert [m.seq for m in read_export(str(good))[1]] == [1]
    for name, text in (("cut", [json.dumps(head), line]),
                       ("edited", [json.dumps(head), line.replace("{}", "{ }"), json.dumps(seal)])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(text) + "\n")
        try:
            read_export(str(path))
        except ExportError as err:
            assert "seal" in str(err)
        else:
            raise AssertionError(f"{name} segment accepted")


async def test_the_retention_command_warns_when_no_snapshot_covers_the_cut(nats_url):
    log = await EventLog.open(nats_url)
    try:
        for i in range(10):
            await log.append(ev.JobSubmitted(at=float(i), job_id=f"j-{i}", spec=JobSpec(team="t", gpus=1)))
    finally:
        await log.close()
    shown = cli("log", "retention", "--nats", nats_url, "--max-msgs", "3")
    assert shown.returncode == 1 and "no snapshot covers it" in shown.stderr
