"""Through a real node daemon: a secret file reaches the job's environment while the log holds
only its path; a checkpoint's checksum reaches the `CheckpointSaved` event."""

from __future__ import annotations

import hashlib
import json

from gpusched.core import events as ev
from gpusched.core.model import JobSpec

from .node_helpers import PY, Cluster

SECRET = "tok-7f3a9c-never-in-the-log"


async def _raw_log(c: Cluster) -> bytes:
    out = b""
    sub = await c.log.js.subscribe("gpusched.evt.>", ordered_consumer=True)
    last = await c.log.last_seq()
    while True:
        msg = await sub.next_msg(timeout=5)
        out += msg.data
        if msg.metadata.sequence.stream >= last:
            break
    await sub.unsubscribe()
    return out


async def test_secret_env_reaches_the_job_but_not_the_log(nats_url, tmp_path, capfd):
    secret = tmp_path / "token"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    out = tmp_path / "seen.json"
    script = f"import os, json; json.dump({{'t': os.environ.get('API_TOKEN')}}, open({str(out)!r}, 'w'))"
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["s0"], gpus=1)
        await c.submit("sec", JobSpec(team="t", gpus=1, command=[PY, "-c", script],
                                      secret_env={"API_TOKEN": str(secret)}))
        await c.grant("sec", ["s0/0"])
        await c.wait(lambda s: s.jobs["sec"].state == "completed", "job completed")
        assert json.loads(out.read_text()) == {"t": SECRET}
        raw = await _raw_log(c)
        assert str(secret).encode() in raw and SECRET.encode() not in raw
    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err  # nor in the agent's own log


async def test_a_missing_secret_fails_the_start_precisely(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["s1"], gpus=1)
        await c.submit("nosec", JobSpec(team="t", gpus=1, command=[PY, "-c", "pass"], on_failure="fail",
                                        secret_env={"API_TOKEN": str(tmp_path / "absent")}))
        await c.grant("nosec", ["s1/0"])
        job = await c.wait(lambda s: s.jobs["nosec"].state == "failed" and s.jobs["nosec"], "job failed")
        assert job.state == "failed"
        log = next((tmp_path / "work" / "logs" / "nosec").glob("*.log")).read_text()
        assert "secret API_TOKEN: cannot open" in log


async def test_checkpoint_checksum_is_recorded_in_the_log(nats_url, tmp_path):
    ckdir = tmp_path / "ck"
    script = "from gpusched.job import context; context().checkpoint({'w': [1, 2]}, step=4)"
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["k0"], gpus=1)
        await c.submit("ck", JobSpec(team="t", gpus=1, command=[PY, "-c", script], checkpoint_dir=str(ckdir)))
        await c.grant("ck", ["k0/0"])
        job = await c.wait(lambda s: s.jobs["ck"].checkpoint is not None and s.jobs["ck"], "checkpoint")
        assert job.checkpoint.path.endswith(".msgpack")
        with open(job.checkpoint.path, "rb") as f:
            assert job.checkpoint.sha256 == hashlib.sha256(f.read()).hexdigest()
        await c.refold()
        (saved,) = c.events(ev.CheckpointSaved)
        assert saved.sha256 == job.checkpoint.sha256


async def test_a_one_megabyte_checkpoint_ack_hurts_nobody(nats_url, tmp_path):
    """Issue 9: one 1 MB acknowledgement made the agent's event exceed the server's max payload;
    the server closed its connection and all nodes were lost. Now the event is refused before
    publishing and the agent goes on (the job still completes)."""
    script = ("import os, json, time; d = os.environ['GPUSCHED_CONTROL_DIR']; "
              "json.dump({'path': '/' + 'x' * 1_048_450, 'step': 1, 'request': None}, open(d + '/.t', 'w')); "
              "os.replace(d + '/.t', d + '/ack-big.json'); time.sleep(1.0)")
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["m0"], gpus=1)
        await c.submit("big", JobSpec(team="t", gpus=1, command=[PY, "-c", script]))
        await c.grant("big", ["m0/0"])
        await c.wait(lambda s: s.jobs["big"].state == "completed", "job completed despite the 1 MB ack")
        assert c.log.nc.is_connected and all(h.nc.is_connected for h in c.hosts)
        await c.refold()
        assert c.events(ev.CheckpointSaved) == []
