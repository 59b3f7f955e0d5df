"""Placement takes its start-up fold out of the cyclic collector's sight."""

import gc

from gpusched.services import placement


def test_settle_heap_freezes_what_exists_and_collects_young_objects_less_often():
    kept = [{"fold": i} for i in range(1000)]  # long-lived containers, like the fold's
    threshold = gc.get_threshold()
    try:
        placement.settle_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold() == (placement.GC_YOUNG, threshold[1], threshold[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
