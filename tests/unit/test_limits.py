"""Issue 9's hostile specs, each a named row: before the bounds, every one was admitted (and
most left a job holding GPUs in `starting`, or the node agent crash-looping). Now each is
refused by admission's pure decision, with a reason that names the field."""

from __future__ import annotations

import json

import msgspec
import pytest

from gpusched.core import limits as L
from gpusched.core.commands import SubmitJob
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState
from gpusched.services.admission import AdmissionConfig, Capacity, admit, decode


def _submit(spec: dict, subject: str = "gpusched.cmd.submit") -> str | None:
    """The reply error for a submit sent as raw JSON, as a web page would (None: admitted)."""
    raw = json.dumps({"type": "SubmitJob", "request_id": "r1", "spec": spec}, ensure_ascii=False).encode()
    cmd = decode(subject, raw)
    if isinstance(cmd, str):
        return cmd
    d = admit(ClusterState(), cmd, 1.0, AdmissionConfig(auto_create_teams=True), Capacity())
    return None if d.reply.ok else d.reply.error


RUN = {"team": "a", "gpus": 1, "command": ["python", "train.py"]}

HOSTILE_SPECS: dict[str, tuple[dict, str]] = {
    "NUL byte in an argument": ({**RUN, "command": ["python", "a\x00b"]}, "without NUL bytes - at `$.spec.command[1]`"),
    "= in an env key": ({**RUN, "env": {"A=B": "x"}}, "environment variable name"),
    "NUL in an env value": ({**RUN, "env": {"A": "x\x00y"}}, "without NUL bytes - at `$.spec.env[...]`"),
    "simulated duration not a number": ({**RUN, "env": {"GPUSCHED_SIM_DURATION_S": "abc"}},
                                        "spec.env[GPUSCHED_SIM_DURATION_S] must be seconds"),
    "simulated duration infinite": ({**RUN, "env": {"GPUSCHED_SIM_DURATION_S": "inf"}}, "must be seconds"),
    "simulated exit code not a number": ({**RUN, "env": {"GPUSCHED_SIM_EXIT_CODE": "x"}}, "integer exit code"),
    "scheduler variable in env": ({**RUN, "env": {"GPUSCHED_JOB_ID": "j-other"}}, "prefix is reserved"),
    "checkpoint dir under /proc": ({**RUN, "checkpoint_dir": "/proc/1/root"}, "must not be under /proc"),
    "image read as a runtime option": ({**RUN, "image": "--privileged"}, "an image reference"),
    "image with a space": ({**RUN, "image": "alpine --rm"}, "an image reference"),
    "image reference too long": ({**RUN, "image": "a" * (L.MAX_IMAGE_CHARS + 1)}, "length <= 512"),
    "checkpoint dir under /sys": ({**RUN, "checkpoint_dir": "/sys"}, "must not be under /sys"),
    "relative checkpoint dir": ({**RUN, "checkpoint_dir": "ckpt"}, "an absolute path without NUL bytes - at `$.spec.checkpoint_dir`"),
    "checkpoint dir escaping with ..": ({**RUN, "checkpoint_dir": "/data/../proc"}, "must not contain '..'"),
    "no command": ({"team": "a", "gpus": 1}, "spec.command is empty"),
    "empty program": ({**RUN, "command": [" "]}, "spec.command[0] (the program) is empty"),
    "time limit 1e-300": ({**RUN, "time_limit_s": 1e-300}, "`float` >= 1.0 - at `$.spec.time_limit_s`"),
    "time limit 1e308": ({**RUN, "time_limit_s": 1e308}, "at `$.spec.time_limit_s`"),
    "max_restarts 1e18": ({**RUN, "max_restarts": 10**18}, "`int` <= 1000 - at `$.spec.max_restarts`"),
    "gpus 2^64": ({**RUN, "gpus": 2**64}, "$.spec.gpus"),
    "team .": ({**RUN, "team": "."}, "at `$.spec.team`"),
    "team ..": ({**RUN, "team": ".."}, "at `$.spec.team`"),
    "team a.b": ({**RUN, "team": "a.b"}, "at `$.spec.team`"),
    "team null": ({**RUN, "team": "null"}, "not null/none"),
    "team NULL": ({**RUN, "team": "NULL"}, "at `$.spec.team`"),
    "team None": ({**RUN, "team": "None"}, "at `$.spec.team`"),
    "too many arguments": ({**RUN, "command": ["x"] * (L.MAX_ARGS + 1)}, "at `$.spec.command`"),
    "one argument too long": ({**RUN, "command": ["x" * (L.MAX_ARG_CHARS + 1)]}, "at `$.spec.command[0]`"),
    "command too many bytes": ({**RUN, "command": ["é" * 8000] * 5}, "spec.command holds"),
    "too many env entries": ({**RUN, "env": {f"K{i}": "v" for i in range(L.MAX_ENV + 1)}}, "at `$.spec.env`"),
    "env too many bytes": ({**RUN, "env": {f"K{i}": "é" * 8000 for i in range(5)}}, "spec.env holds"),
    "secret path relative": ({**RUN, "secret_env": {"TOKEN": "token.txt"}}, "$.spec.secret_env"),
    "secret under /proc": ({**RUN, "secret_env": {"TOKEN": "/proc/self/environ"}}, "must not be under /proc"),
    "secret also in env": ({**RUN, "env": {"TOKEN": "x"}, "secret_env": {"TOKEN": "/run/t"}},
                           "in both spec.env and spec.secret_env"),
}


@pytest.mark.parametrize("name", list(HOSTILE_SPECS))
def test_hostile_spec_is_refused_with_a_precise_reason(name):
    spec, fragment = HOSTILE_SPECS[name]
    error = _submit(spec)
    assert error is not None, f"{name}: admitted"
    assert fragment in error, error


def test_a_one_megabyte_submit_is_refused_before_decoding():
    spec = {**RUN, "env": {"BLOB": "x" * 1_000_000}}
    error = _submit(spec)
    assert error is not None and "bytes; at most" in error


def test_sane_specs_still_pass():
    ok = {**RUN, "env": {"GPUSCHED_SIM_DURATION_S": "2.5", "GPUSCHED_SIM_CHECKPOINT_S": "never", "A": "b=c"},
          "checkpoint_dir": "/data/ckpt", "time_limit_s": 3600, "max_restarts": 5, "team": "ml-research_2",
          "secret_env": {"HF_TOKEN": "/run/secrets/hf"}, "name": "llama fine-tune"}
    assert _submit(ok) is None


@pytest.mark.parametrize("mode, spec, ok", [
    ("refuse", {"team": "a", "gpus": 1, "time_limit_s": 60}, False),
    ("bounded", {"team": "a", "gpus": 1}, False),
    ("bounded", {"team": "a", "gpus": 1, "time_limit_s": 60}, True),
    ("bounded", {"team": "a", "gpus": 1, "env": {"GPUSCHED_SIM_DURATION_S": "5"}}, True),
    ("any", {"team": "a", "gpus": 1}, True),
])
def test_placeholder_jobs_only_where_allowed(mode, spec, ok):
    cmd = SubmitJob(request_id="r", spec=msgspec.convert(spec, JobSpec))
    d = admit(ClusterState(), cmd, 1.0, AdmissionConfig(auto_create_teams=True, placeholders=mode), Capacity())
    assert d.reply.ok is ok, d.reply.error


@pytest.mark.parametrize("quota, fragment", [
    ({"guaranteed": 2**64}, "$.quota.guaranteed"),
    ({"weight": 1e-300}, "$.quota.weight"),
    ({"weight": 0}, "$.quota.weight"),
    ({"limit": -1}, "$.quota.limit"),
])
def test_hostile_quotas_are_refused(quota, fragment):
    raw = json.dumps({"type": "SetTeamQuota", "request_id": "r", "team": "a", "quota": quota}).encode()
    error = decode("gpusched.cmd.quota", raw)
    assert isinstance(error, str) and fragment in error


@pytest.mark.parametrize("node", [".", "..", "null", "a..b", "x" * 64, "a/b", "a b"])
def test_drain_of_a_malformed_node_name_is_refused(node):
    raw = json.dumps({"type": "DrainNode", "request_id": "r", "node": node}).encode()
    error = decode("gpusched.cmd.drain", raw)
    assert isinstance(error, str) and "$.node" in error


@pytest.mark.parametrize("info, fragment", [
    ({"version": "2.11.9", "max_payload": 1048576}, "nats-server 2.11.9 is too old: gpusched needs >= 2.12.0"),
    ({"version": "2.9.25", "max_payload": 1048576}, "2.9.25"),
    ({"version": "2.12.0", "max_payload": 65536}, "max_payload is 65536"),
])
def test_unsuitable_servers_are_named(info, fragment):
    problem = L.server_problem(info)
    assert problem is not None and fragment in problem and "\n" not in problem


def test_suitable_server_passes():
    assert L.server_problem({"version": "2.15.1", "max_payload": 1048576}) is None


def test_the_largest_admissible_spec_fits_an_event():
    """Every field at its maximum: the JobSubmitted stays under MAX_EVENT_BYTES (and so under
    the server's max_payload), because admission checks the whole spec's size too."""
    big = {**RUN, "command": ["x" * L.MAX_ARG_CHARS] * 7, "env": {f"K{i}": "v" * L.MAX_ENV_VALUE_CHARS for i in range(7)},
           "name": "n" * L.MAX_JOB_NAME_CHARS}
    assert _submit(big) is None
    from gpusched.core import events as ev

    spec = msgspec.convert(big, JobSpec)
    payload = ev.encode_event(ev.JobSubmitted(at=1.0, job_id="j-00000000", spec=spec, request_id="r" * 128))
    assert len(payload) < L.MAX_EVENT_BYTES - 4096
