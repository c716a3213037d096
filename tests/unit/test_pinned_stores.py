"""PinnedStores on vLLM's own BlockPool: a store's source blocks stay pinned from
the step that plans them (or the finish of the request whose tail they are) until
every worker has reported the event, each block once, and nothing stays pinned."""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool

from umbp.core.plans import GroupBlocks, StorePlan
from umbp.core.stores.acks import StoreEventResult
from umbp.shell.pinned_stores import PinnedStores


def _batch(request_id: str, block_ids: list[int]) -> StorePlan:
    return StorePlan(request_id, (GroupBlocks(0, 16, tuple(block_ids),
                                             tuple(bytes([b]) for b in block_ids)),))


def test_a_finished_tail_stays_pinned_through_its_event_until_every_worker_reports() -> None:
    pool = BlockPool(8, True, 16)
    live = [block.block_id for block in pool.get_new_blocks(2)]
    finished_blocks = pool.get_new_blocks(2)
    finished = [block.block_id for block in finished_blocks]
    free_at_start = pool.get_num_free_blocks()
    pinned = PinnedStores()
    pinned.bind_pool(pool)

    def refs(ids: list[int]) -> list[int]:
        return [pool.blocks[i].ref_cnt for i in ids]

    tail = _batch("done", finished)
    pinned.hold_finished_tail("done", tail)
    pool.free_blocks(finished_blocks)  # vLLM cleans the finished request up
    assert refs(finished) == [1, 1], "only the tail's pins hold the pages"
    assert pinned.has_tail("done") and pinned.tails_waiting and not pinned.events_in_flight

    # Two plans of the step read the same block: it is pinned once.
    step = (_batch("live", live), _batch("other", live[:1]))
    plans, event_id = pinned.open_event(step)
    assert plans == (*step, tail) and event_id == 0
    assert refs(live) == [2, 2] and refs(finished) == [1, 1], "the event took the tail's pins"
    assert not pinned.tails_waiting and pinned.events_in_flight
    assert {(0, bytes([b])) for b in live + finished} <= set(pinned.reserved())

    assert pinned.acknowledge({event_id: StoreEventResult(1)}, 2) == ()
    assert refs(live) == [2, 2], "one worker of two reported: still pinned"
    done = pinned.acknowledge({event_id: StoreEventResult(1)}, 2)
    assert [event.event_id for event, _ in done] == [0]
    assert done[0][1].completed_workers == 2
    assert refs(live) == [1, 1] and refs(finished) == [0, 0]
    assert pool.get_num_free_blocks() == free_at_start + 2, "the tail's pages are free again"
    assert not pinned.events_in_flight and not set(pinned.reserved())
    assert pinned.acknowledge({event_id: StoreEventResult(1)}, 2) == (), "acknowledged once"

    assert pinned.open_event(()) == ((), None), "nothing to store: no event"
    assert not pinned.events_in_flight


def test_a_request_whose_shared_prefix_another_request_stores_waits_for_that_store() -> None:
    """Two requests of one batch share prefix blocks; only the first stores them. The
    second finishing before that store lands must wait for it too (a retention asked
    then would find the shared objects not stored yet), and not for unrelated stores."""
    pinned = PinnedStores()
    _, event_id = pinned.open_event((_batch("first", [1, 2, 3]),))
    assert event_id is not None
    assert pinned.stores_for("first", [bytes([1])])
    assert pinned.stores_for("second", [bytes([1]), bytes([9])]), "shares block 1"
    assert not pinned.stores_for("third", [bytes([7]), bytes([9])]), "shares nothing"
    pinned.acknowledge({event_id: StoreEventResult(1)}, 1)
    assert not pinned.stores_for("second", [bytes([1]), bytes([9])])
