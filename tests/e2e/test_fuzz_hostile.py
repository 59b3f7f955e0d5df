"""Generated hostile input against LIVE services (issue 9): commands to admission and heartbeats
to the reconciler, each a real message over real NATS. Every command is answered, with a
precise rejection or a valid job; no service crashes or goes deaf.

A few hundred examples in the default suite; `-m slow` runs 10,000 commands and 10,000
heartbeats."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.bus import subjects
from gpusched.bus.control_client import Client
from gpusched.bus.servers import start_nats, start_redis
from gpusched.cli.stack import register_simulated_nodes, spawn_service, stop_processes
from gpusched.core import limits as L
from gpusched.core.commands import CommandReply
from gpusched.core.model import JobSpec, TeamQuota

# --- strategies -------------------------------------------------------------------------------

HOSTILE_TEXT = [".", "..", "a.b", "null", "NULL", "None", "true", "", " ", "a\x00b", "x" * 9000, "é" * 70,
                "../../etc", "*", ">", "a b", "=", "GPUSCHED_JOB_ID"]
texts = st.one_of(st.text(max_size=40), st.sampled_from(HOSTILE_TEXT))
names = st.one_of(st.sampled_from(["a", "team-1", "ml_research", "x" * 63, "x" * 64]), texts)
numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, 1, 4, -1, 2**64, 1e-300, 1e308, 3.5]))
anything = st.one_of(texts, numbers, st.booleans(), st.none(), st.lists(texts, max_size=3))
env_keys = st.one_of(texts, st.sampled_from(["A=B", "PATH", "GPUSCHED_SIM_DURATION_S", "GPUSCHED_SIM_EXIT_CODE",
                                             "GPUSCHED_RESUME_FROM", "OK_KEY"]))
env_values = st.one_of(texts, st.sampled_from(["abc", "inf", "-1", "1e400", "2", "never", "v" * 8193]))
paths = st.one_of(texts, st.sampled_from(["/proc/1", "/sys", "/dev/null", "rel/dir", "/data/ck", "/a/../proc",
                                          "/" + "p" * 1100]))
spec = st.fixed_dictionaries(
    {"team": names, "gpus": numbers},
    optional={
        "min_gpus": numbers, "priority": st.sampled_from(["interactive", "high", "normal", "low", "urgent"]),
        "preemptible": anything, "time_limit_s": numbers, "max_restarts": numbers, "name": texts,
        "command": st.one_of(st.lists(texts, max_size=4), st.just(["x"] * 1100), anything),
        "env": st.one_of(st.dictionaries(env_keys, env_values, max_size=4), anything),
        "checkpoint_dir": paths, "secret_env": st.dictionaries(env_keys, paths, max_size=2),
        "on_failure": st.sampled_from(["requeue", "fail", "explode"]),
        "topology": st.fixed_dictionaries({}, optional={"required": st.sampled_from(["node", "rack", "row"])}),
        "colour": anything,
    })
request_ids = st.text(min_size=1, max_size=24)
# Near-valid specs: sane fields with, now and then, one hostile value: the admitted ones must be
# valid jobs, the others precise rejections.
args = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=30)
near_valid_spec = st.fixed_dictionaries(
    {"team": st.one_of(st.sampled_from(["a", "b", "team-1"]), names), "gpus": st.integers(1, 4),
     "command": st.lists(args, min_size=1, max_size=4)},
    optional={"env": st.dictionaries(st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,8}\Z"), st.one_of(args, env_values),
                                     max_size=3),
              "time_limit_s": st.one_of(st.floats(1, 1e5), numbers), "max_restarts": st.integers(0, 1001),
              "checkpoint_dir": st.one_of(st.just("/data/ck"), paths), "name": texts,
              "priority": st.sampled_from(["high", "low"]), "preemptible": st.booleans()})
commands = st.one_of(
    st.tuples(st.just(subjects.CMD_SUBMIT),
              st.fixed_dictionaries({"type": st.just("SubmitJob"), "request_id": request_ids, "spec": near_valid_spec})),
    st.tuples(st.just(subjects.CMD_SUBMIT),
              st.fixed_dictionaries({"type": st.just("SubmitJob"), "request_id": request_ids, "spec": spec})),
    st.tuples(st.just(subjects.CMD_QUOTA),
              st.fixed_dictionaries({"type": st.just("SetTeamQuota"), "request_id": request_ids, "team": names,
                                     "quota": st.fixed_dictionaries({}, optional={
                                         "guaranteed": numbers, "weight": numbers, "limit": numbers})})),
    st.tuples(st.just(subjects.CMD_CANCEL),
              st.fixed_dictionaries({"type": st.just("CancelJob"), "request_id": request_ids, "job_id": texts},
                                    optional={"reason": texts})),
    st.tuples(st.just(subjects.CMD_DRAIN),
              st.fixed_dictionaries({"type": st.just("DrainNode"), "request_id": request_ids, "node": names},
                                    optional={"drain": anything, "reason": texts})),
    st.tuples(st.sampled_from([subjects.CMD_SUBMIT, subjects.CMD_QUOTA, "gpusched.cmd.reboot"]), st.binary(max_size=300)),
)
gpu_samples = st.fixed_dictionaries({"index": numbers, "uuid": texts},
                                    optional={"pids": st.lists(numbers, max_size=3), "healthy": anything,
                                              "utilization_pct": numbers, "health": texts})
heartbeats = st.one_of(
    st.fixed_dictionaries({"node": names, "at": numbers, "agent_id": texts, "seq": numbers, "backend": texts,
                           "gpus": st.lists(gpu_samples, max_size=3)},
                          optional={"jobs": st.lists(anything, max_size=2), "extra": anything}),
    st.binary(max_size=300),
)


def _encode(body) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


# --- the live stack -----------------------------------------------------------------------------


class Live:
    """Real nats-server, redis-server, admission and reconciler processes, and a client on an
    event loop in a thread (hypothesis drives plain functions)."""

    def __init__(self, tmp):
        self.nats, self.redis = start_nats(), start_redis()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client: Client = self.call(Client.connect(self.nats.url, timeout=10.0))
        self.call(self._nodes())
        self.procs = {name: spawn_service(name, self.nats.url, self.redis.url, [], log_path=tmp / f"{name}.log")
                      for name in ("admission", "reconciler")}
        self.tmp = tmp
        self.answered = self.rejected = self.admitted = self.beats = 0
        self.wait_ready()

    async def _nodes(self):
        from gpusched.bus.log import EventLog

        log = await EventLog.open(self.nats.url, name="fuzz-setup")
        await register_simulated_nodes(log, 2, 4, 2, "all")
        await log.close()

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        for name in self.procs:
            while f'"{name}_ready"' not in (self.tmp / f"{name}.log").read_text(errors="replace"):
                assert self.procs[name].poll() is None, (self.tmp / f"{name}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{name} not ready"
                time.sleep(0.05)

    def alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} died:\n" + (self.tmp / f"{name}.log").read_text()[-3000:]

    def close(self) -> None:
        stop_processes(list(self.procs.values()), timeout=10)
        self.call(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.nats.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    stack = Live(tmp_path_factory.mktemp("fuzz"))
    yield stack
    stack.close()


def _check_command(live: Live, subject: str, body) -> None:
    data = _encode(body)
    raw = live.call(live.client.request_raw(subject, data, timeout=10))  # raises when nobody answers: deaf
    reply = msgspec.json.decode(raw, type=CommandReply)
    live.answered += 1
    if not reply.ok:
        assert reply.error and not reply.error.startswith("internal error"), reply.error
        assert len(reply.error) < 4096, "a rejection must be short"
        live.rejected += 1
        return
    if subject == subjects.CMD_SUBMIT and reply.duplicate:  # a repeated request id names the job it made
        assert reply.job_id
    elif subject == subjects.CMD_SUBMIT:  # admitted: a valid job, inside every bound
        sent = msgspec.convert(body["spec"], JobSpec)
        assert reply.job_id and L.spec_problem(sent) is None and sent.command
        live.admitted += 1


def _check_heartbeat(live: Live, body) -> None:
    node = body.get("node") if isinstance(body, dict) else None
    # a subject over the server's control-line limit would only close this (the sender's) connection
    subject = subjects.heartbeat_subject(node[:200] if isinstance(node, str) and node else "x")
    live.call(live.client.nc.publish(subject, _encode(body)))
    live.beats += 1


def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@fuzz(300)
@given(commands)
def test_fuzzed_commands_are_answered_precisely(live, command):
    _check_command(live, *command)


@fuzz(200)
@given(heartbeats)
def test_fuzzed_heartbeats_hurt_nobody(live, heartbeat):
    _check_heartbeat(live, heartbeat)


def test_after_the_fuzz_every_service_is_alive_and_answers(live):
    live.call(live.client.nc.flush())
    time.sleep(1.5)  # a reconciler tick over whatever it kept
    live.alive()
    # team a exists whatever the fuzz drew (a random draw without a valid SetTeamQuota for it
    # left the submit refused: "unknown team 'a'"), with terms the fuzz may have made anything
    quota = live.call(live.client.set_quota("a", TeamQuota()))
    assert quota.ok, quota.error
    reply = live.call(live.client.submit(JobSpec(team="a", gpus=1, command=["true"])))
    assert reply.ok, reply.error
    one_mb = {"type": "SubmitJob", "request_id": "big", "spec": {"team": "a", "gpus": 1, "command": ["x" * 1_000_000]}}
    _check_command(live, subjects.CMD_SUBMIT, one_mb)
    live.alive()
    print(f"fuzz: {live.answered} commands answered ({live.rejected} rejected, {live.admitted} admitted), "
          f"{live.beats} heartbeats; services alive")


@pytest.mark.slow
@fuzz(10_000)
@given(commands)
def test_ten_thousand_fuzzed_commands(live, command):
    _check_command(live, *command)


@pytest.mark.slow
@fuzz(10_000)
@given(heartbeats)
def test_ten_thousand_fuzzed_heartbeats(live, heartbeat):
    _check_heartbeat(live, heartbeat)


@pytest.mark.slow
def test_after_the_slow_fuzz_every_service_is_alive(live):
    test_after_the_fuzz_every_service_is_alive_and_answers(live)
