"""A tenant with nothing but the credential `gpusched user add` gave them: what the server
refuses is reported as a refusal (the subject and the role, exit 1), never as a server that
cannot be reached (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from gpusched.cli.main import main


def _gpusched(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *argv], capture_output=True, text=True,
                          timeout=60)


def test_a_refused_read_says_permission_denied_naming_subject_and_role(trust, nats_server, tmp_path):
    creds = tmp_path / "dana.nk"
    assert main(["user", "add", "dana", "--team", "nlp", "--out", str(creds), "--trust", str(trust.dir)]) == 0
    for _ in range(100):  # the reload (SIGHUP) lands within milliseconds
        proc = _gpusched("nodes", "--nats", nats_server.url, "--creds", str(creds), "--fold")  # not a tenant's read
        if "authorization violation" not in proc.stderr:
            break
        time.sleep(0.05)
    assert proc.returncode == 1, proc.stderr
    assert "cannot reach" not in proc.stderr
    assert "permission denied: dana (role tenant, teams nlp)" in proc.stderr
    assert "publish to \"$js.api.stream.info.gpusched\"" in proc.stderr.lower()  # the subject refused


def test_a_tenants_read_without_the_reader_service_names_it(trust, nats_server, tmp_path):
    creds = tmp_path / "erin.nk"
    assert main(["user", "add", "erin", "--team", "nlp", "--out", str(creds), "--trust", str(trust.dir)]) == 0
    for _ in range(100):
        proc = _gpusched("jobs", "--nats", nats_server.url, "--creds", str(creds))
        if "authorization violation" not in proc.stderr:
            break
        time.sleep(0.05)
    assert proc.returncode == 2, proc.stderr
    assert "cannot reach the reader service at gpusched.read.jobs.nlp.erin (no responders)" in proc.stderr


def test_creds_given_on_the_command_line_are_used_and_the_environment_is_left_as_it_was(trust, nats_server,
                                                                                       tmp_path):
    """`--creds` travels to the connection, not through `os.environ`: before, `main` wrote it into
    $GPUSCHED_CREDS, so the next command of the same process (a test, an embedding program) and
    every child it started acted as that identity."""
    gil, hal = tmp_path / "gil.nk", tmp_path / "hal.nk"
    for name, team, path in (("gil", "nlp", gil), ("hal", "cv", hal)):
        assert main(["user", "add", name, "--team", team, "--out", str(path), "--trust", str(trust.dir)]) == 0
    jobs = ["jobs", "--nats", nats_server.url, "--json"]
    code = ("import json, os, sys\nfrom gpusched.cli.main import main\n"
            "rc = main(%r)\nafter = os.environ.get('GPUSCHED_CREDS')\nagain = main(%r)\n"
            "print(json.dumps([rc, after, again]), file=sys.stderr)" % ([*jobs, "--creds", str(gil)], jobs))
    env = {**os.environ, "GPUSCHED_CREDS": str(hal)}
    for _ in range(100):  # the reload that admits gil and hal lands within milliseconds
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        if "authorization violation" not in proc.stderr:
            break
        time.sleep(0.05)
    rc, after, again = json.loads(proc.stderr.strip().splitlines()[-1])
    assert after == str(hal)  # untouched
    # no reader service runs: each read names the subject it asked on, so the identity it asked as
    assert rc == 2 and "cannot reach the reader service at gpusched.read.jobs.nlp.gil" in proc.stderr, proc.stderr
    assert again == 2 and "cannot reach the reader service at gpusched.read.jobs.cv.hal" in proc.stderr, proc.stderr


#: What a listing through the reader never needs: JetStream's client, the fold and its events, the
#: model's types (readmodel loads them only to build documents from a fold), importlib.metadata
#: (nats-py's version is read from its dist-info's name), rich (a pipe).
NOT_FOR_A_READER_LISTING = ("nats.js", "nats.js.api", "gpusched.core.state", "gpusched.core.events",
                            "gpusched.core.model", "gpusched.core.records", "importlib.metadata", "rich", "redis",
                            "gpusched.bus.log")


def _through_the_reader(trust, nats_server, redis_url, tmp_path, user: str, call) -> tuple:
    """(what `call(creds)` returned, the reader's log) for a new tenant `user` of team nlp, with
    a real reader service up: retried while the server's reload that admits the user is on its way."""
    from gpusched.cli.stack import spawn_service, stop_processes

    creds = tmp_path / f"{user}.nk"
    assert main(["user", "add", user, "--team", "nlp", "--out", str(creds), "--trust", str(trust.dir)]) == 0
    log_path = tmp_path / "reader.log"
    reader = spawn_service("reader", nats_server.url, redis_url, log_path=log_path, creds=trust.creds("reader"))
    try:
        deadline = time.monotonic() + 60
        while '"reader_ready"' not in (log_path.read_text() if log_path.exists() else ""):
            assert reader.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        for _ in range(100):  # the reload that admits the user lands within milliseconds
            proc = call(creds)
            if "authorization violation" not in proc.stderr:
                break
            time.sleep(0.05)
    finally:
        stop_processes([reader], timeout=5)
    return proc, log_path.read_text()


def test_a_tenants_jobs_through_the_reader_loads_no_jetstream_nor_fold(trust, nats_server, redis_url, tmp_path):
    def listing(creds):
        code = ("import json, sys\nfrom gpusched.cli.main import main\nrc = main(%r)\n"
                "print(json.dumps([rc, sorted(m for m in %r if m in sys.modules)]), file=sys.stderr)"
                % (["jobs", "--nats", nats_server.url, "--creds", str(creds), "--json"], NOT_FOR_A_READER_LISTING))
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    proc, _ = _through_the_reader(trust, nats_server, redis_url, tmp_path, "fay", listing)
    rc, loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    assert rc == 0, proc.stderr
    assert json.loads(proc.stdout) == []  # the reader answered: an empty log lists no jobs
    assert loaded == []


async def test_the_reader_reads_usage_through_one_redis_client(redis_url):
    """Running jobs' utilization comes from Redis through one client kept for the reader's life
    (not a connection per answer); jobs that hold no GPUs ask nothing."""
    import types

    import redis

    from gpusched.services.reader import Reader
    from gpusched.views import USAGE_KEY

    window = {"attempt": 1, "util_pct": 42.0, "memory_mb": 2048.0}
    r = redis.Redis.from_url(redis_url)
    r.hset(USAGE_KEY, "j-0000aaaa", json.dumps(window))
    r.close()
    reader = Reader(types.SimpleNamespace(listeners=[]), None, None, redis_url)  # type: ignore[arg-type]
    held = [{"job_id": "j-0000aaaa", "gpus": [{"gpu": "n1/0"}]}, {"job_id": "j-0000bbbb", "gpus": [{"gpu": "n1/1"}]}]
    try:
        assert await reader._usage([{"job_id": "j-0000aaaa", "gpus": []}]) == {}
        assert reader._views is None
        assert await reader._usage(held) == {"j-0000aaaa": window}
        client = reader._views
        assert await reader._usage(held) == {"j-0000aaaa": window} and reader._views is client
    finally:
        await reader.close()


def test_a_bad_cut_through_the_reader_is_a_one_line_refusal_and_no_traceback(trust, nats_server, redis_url,
                                                                             tmp_path):
    """`--at` is parsed where the log is folded, in the reader: a time it cannot read is the
    asker's mistake, answered as such, not a failure the reader logs with a traceback."""
    proc, logged = _through_the_reader(trust, nats_server, redis_url, tmp_path, "ida", lambda creds: _gpusched(
        "jobs", "--nats", nats_server.url, "--creds", str(creds), "--at", "soonish"))
    assert proc.returncode == 1, proc.stderr
    assert "--at 'soonish'" in proc.stderr and "UsageError" not in proc.stderr, proc.stderr
    assert "read_failed" not in logged
