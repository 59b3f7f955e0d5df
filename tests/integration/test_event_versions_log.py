"""An older reader and a newer writer on one stream (real JetStream): the reader folds the
writer's facts by the fields it knows, and the older shapes stored before them, with nothing
dead-lettered."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo
from gpusched.services.runtime import FoldedLog

#: As a newer writer appends them: fields (and versions) this reader does not know.
NEWER = [
    b'{"type":"JobSubmitted","at":1,"v":3,"job_id":"new","spec":{"team":"a","gpus":2,"cpus":16,'
    b'"prefer":{"gpu_type":"H100","nearby":"rack"}},"request_id":"r-new","tenant":"x"}',
    b'{"type":"GpusGranted","at":2,"v":3,"job_id":"new","attempt":1,"gpus":["n0/0","n0/1"],"level":"nvlink",'
    b'"pool":"shared"}',
]
#: As an older writer appended them (GpusGranted v1, before `handover`).
OLDER = [
    b'{"type":"JobSubmitted","at":1,"v":1,"job_id":"old","spec":{"team":"a","gpus":1},"request_id":"r-old"}',
    b'{"type":"GpusGranted","at":2,"v":1,"job_id":"old","attempt":1,"gpus":["n0/2"],"backfill":false}',
]


async def test_an_older_reader_folds_a_newer_writers_facts(event_log, nats_url):
    reader = FoldedLog(await EventLog.open(nats_url, name="older-reader"))
    await reader.start()
    await event_log.append(ev.NodeRegistered(at=0, node="n0", rack="r0",
                                             gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(4)]))
    for raw in OLDER + NEWER:  # one stream, both writers, each on its event's own subject
        await event_log.js.publish(subjects.event_subject(ev.decode_event(raw)), raw)
    await reader.catch_up()
    st = reader.state
    assert reader.seen_seq == 5
    assert st.jobs["new"].gpus == ["n0/0", "n0/1"] and st.jobs["old"].gpus == ["n0/2"]
    assert list(st.nodes["n0"].free) == ["n0/3"]
    assert await event_log.dead_letters_list() == []
    for raw in NEWER:  # the strict decoding readers used before: these were dead letters
        with pytest.raises(msgspec.ValidationError, match="unknown field"):
            msgspec.json.decode(raw, type=ev.AnyEvent)
    await reader.stop()
    await reader.log.close()
