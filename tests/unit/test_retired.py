"""`RetiredIds` answers membership exactly as a set would, in 4 bytes per admission-made id."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gpusched.core.retired import RetiredIds

compact = st.integers(0, 2**32 - 1).map(lambda v: f"j-{v:08x}")
ids = st.one_of(compact, compact.map(lambda i: i.upper()), st.text(max_size=12))


@given(st.lists(ids, max_size=300), st.lists(ids, max_size=50))
def test_membership_is_a_sets_and_survives_a_snapshot(added, probes):
    retired = RetiredIds()
    for job_id in added:
        retired.add(job_id)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(retired), type=RetiredIds)
    for job_id in added + probes:
        assert (job_id in retired) == (job_id in again) == (job_id in set(added))


def test_runs_stay_few_and_sorted():
    retired = RetiredIds()
    for v in range(5000):
        retired.add(f"j-{v * 2654435761 % 2**32:08x}")
    assert len(retired) == 5000 and len(retired.runs) <= 13 and not retired.other
    assert sum(map(len, retired.runs)) == 4 * 5000
    for run in retired.runs:
        values = memoryview(run).cast("I").tolist()
        assert values == sorted(values)
