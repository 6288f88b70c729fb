"""PrefixIndex: KV events in, per-holder contiguous overlap out; order, duplicates, epochs, gaps,
snapshots. ChunkEvents (the engine side) on a bare BlockManager. chunk_keys_from_seed."""

from __future__ import annotations

import orjson
import pytest

from kvpool.keys import KeyScope, chunk_keys, chunk_keys_from_seed
from services.prefix_index import REORDER_WINDOW, PrefixIndex
from shared import subjects
from shared.engine.kv_cache import BlockManager, ChunkEvents
from shared.schemas import KVEvent

K = [f"{i:064x}" for i in range(1, 9)]   # a prompt's chunk keys, in order


def ev(holder, seq, stored=(), evicted=(), epoch=1, role=subjects.CPU_DECODE):
    return KVEvent(holder=holder, role=role, epoch=epoch, seq=seq, stored=list(stored), evicted=list(evicted))


def state(index: PrefixIndex) -> dict:
    """A comparable view of an index: holder -> (role, epoch, seq, keys, pending seqs)."""
    return {n: (h.role, h.epoch, h.seq, frozenset(h.keys), tuple(sorted(h.pending)))
            for n, h in index.holders.items()}


def test_overlap_counts_leading_chunks_held_contiguously():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:4]))
    ix.apply(ev("b", 1, [K[0], K[1], K[3], K[4]]))          # a gap at K[2]
    ix.apply(ev("c", 1, K[1:5]))                            # lacks the first chunk
    ix.apply(ev("pool", 1, K, role=subjects.KVPOOL))
    assert ix.overlap(K[:6]) == {"a": 4, "b": 2, "pool": 6}
    assert ix.overlap(K[1:5]) == {"a": 3, "b": 1, "c": 4, "pool": 4}
    assert ix.overlap([]) == {} and ix.overlap(["f" * 64]) == {}
    assert ix.role("pool") == subjects.KVPOOL and ix.role("nobody") is None


def test_evicted_cuts_the_run():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:5]))
    ix.apply(ev("a", 2, evicted=[K[2]]))
    assert ix.overlap(K) == {"a": 2}
    ix.apply(ev("a", 3, stored=[K[2]], evicted=[K[0]]))
    assert ix.overlap(K) == {}
    assert ix.overlap(K[1:]) == {"a": 4}
    ix.apply(ev("a", 4, evicted=[K[7]]))                    # evicting what it never had: no-op
    assert ix.keys_of("a") == set(K[1:5]) and len(ix) == 4


def test_duplicates_and_older_epochs_are_ignored():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:2]))
    ix.apply(ev("a", 2, evicted=[K[1]]))
    ix.apply(ev("a", 2, evicted=[K[1]]))                    # duplicate
    ix.apply(ev("a", 1, K[:2]))                             # replayed old event: must not re-store K[1]
    assert ix.overlap(K) == {"a": 1} and ix.ignored == 2
    ix.apply(ev("a", 1, K[:3], epoch=2))                    # restarted: starts empty, then its events
    assert ix.overlap(K) == {"a": 3}
    ix.apply(ev("a", 3, evicted=K[:3], epoch=1))            # a late event of the old epoch
    assert ix.overlap(K) == {"a": 3} and ix.ignored == 3


def test_a_new_epoch_empties_the_holder_even_without_keys():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:3]))
    ix.apply(ev("a", 1, epoch=5))                           # the hello of a restarted worker
    assert ix.overlap(K) == {} and len(ix) == 0 and ix.holders["a"].epoch == 5


def test_out_of_order_events_wait_for_the_missing_one():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:2]))
    ix.apply(ev("a", 3, evicted=[K[2]]))                    # ahead of 2: held back
    ix.apply(ev("a", 4, stored=[K[3]]))
    assert ix.overlap(K) == {"a": 2} and sorted(ix.holders["a"].pending) == [3, 4]
    ix.apply(ev("a", 2, stored=[K[2]]))                     # 2 arrives: 2, 3, 4 apply in order
    assert ix.holders["a"].seq == 4 and not ix.holders["a"].pending
    assert ix.overlap(K) == {"a": 2} and ix.keys_of("a") == {K[0], K[1], K[3]}
    assert ix.gaps == 0


def test_a_lost_event_counts_as_a_gap_once_the_window_fills():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:1]))
    for seq in range(3, 3 + REORDER_WINDOW + 1):            # 2 never comes
        ix.apply(ev("a", seq, stored=[f"{seq:064x}"]))
    h = ix.holders["a"]
    assert ix.gaps == 1 and not h.pending and h.seq == 2 + REORDER_WINDOW + 1
    assert len(h.keys) == 1 + REORDER_WINDOW + 1


def test_first_seen_holder_mid_stream():
    ix = PrefixIndex()
    ix.apply(ev("a", 7, K[:2]))                             # the router started after 6 events
    assert ix.overlap(K) == {"a": 2} and ix.gaps == 6
    ix.apply(ev("a", 8, K[2:3]))
    assert ix.overlap(K) == {"a": 3}


def test_drop_holder():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:3]))
    ix.apply(ev("b", 1, K[:2]))
    assert ix.drop_holder("a") and not ix.drop_holder("a")
    assert ix.overlap(K) == {"b": 2} and set(ix.where) == set(K[:2])
    ix.apply(ev("a", 2, K[:1]))                             # it comes back: taken afresh
    assert ix.overlap(K) == {"b": 2, "a": 1}


def test_snapshot_restore_round_trip_then_same_future():
    a = PrefixIndex()
    a.apply(ev("w1", 1, K[:4]))
    a.apply(ev("w1", 2, evicted=[K[3]]))
    a.apply(ev("w1", 4, stored=[K[6]]))                     # pending: waits for 3
    a.apply(ev("pool", 1, K, role=subjects.KVPOOL, epoch=9))
    snap = orjson.loads(orjson.dumps(a.snapshot()))         # through JSON, as stored
    b = PrefixIndex()
    b.apply(ev("junk", 1, K))                               # replaced, not merged
    b.restore(snap)
    assert state(b) == state(a) and b.where == a.where
    for ix in (a, b):                                       # the same events afterwards: the same index
        ix.apply(ev("w1", 3, stored=[K[5]]))
        ix.apply(ev("w2", 1, K[:1], role=subjects.PREFILL))
    assert state(b) == state(a) and b.where == a.where
    assert b.keys_of("w1") == {K[0], K[1], K[2], K[5], K[6]}


def test_restore_rejects_garbage_and_keeps_the_state():
    ix = PrefixIndex()
    ix.apply(ev("a", 1, K[:2]))
    before = state(ix)
    for bad in ({}, {"version": 99, "holders": {}}, {"version": 1, "holders": {"x": {"role": "r"}}},
                {"version": 1, "holders": {"x": {"role": "r", "epoch": 1, "seq": 1, "keys": [],
                                                 "pending": [{"holder": 3}]}}}):
        with pytest.raises(ValueError):
            ix.restore(bad)
    assert state(ix) == before


def test_chunk_keys_from_seed_matches_chunk_keys():
    scope = KeyScope("model-x", {"version": 1, "block_size": 16}, 32, tenant="t")
    toks = list(range(1000, 1100))
    assert chunk_keys_from_seed(scope.seed().hex(), 32, toks) == chunk_keys(scope, toks)
    assert chunk_keys_from_seed(scope.seed().hex(), 32, toks, 70) == chunk_keys(scope, toks, 70)
    assert len(chunk_keys(scope, toks, 70)) == 2
    for bad in ("", "zz" * 32, "ab" * 31):
        with pytest.raises(ValueError, match="key scope seed"):
            chunk_keys_from_seed(bad, 32, toks)
    with pytest.raises(ValueError):
        chunk_keys_from_seed(scope.seed().hex(), 0, toks)


def _fill(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocate and register blocks for ``tokens`` the way Scheduler.commit does."""
    n = len(tokens) // bm.block_size
    blocks = bm.allocate(n)
    hashes, parent = [], None
    for i, b in enumerate(blocks):
        parent = bm.register_full(b, parent, tokens[i * bm.block_size:(i + 1) * bm.block_size])
        hashes.append(parent)
    return blocks, hashes


def test_chunk_events_follow_the_block_cache():
    scope = KeyScope("model-x", {"version": 1, "block_size": 4}, 8)
    bm = BlockManager(num_blocks=8, block_size=4)
    ce = ChunkEvents(bm, scope.seed(), 8)
    toks = list(range(20))                                  # 5 blocks: chunks 0 and 1 whole
    blocks, hashes = _fill(bm, toks)
    assert ce.note(toks, hashes) == 2
    assert ce.take() == (chunk_keys(scope, toks), []) and ce.take() == ([], [])
    assert ce.note(toks, hashes) == 2 and ce.take() == ([], [])  # already held: nothing new
    bm.release(blocks)                                      # free but cached: still held
    other, _ = _fill(bm, list(range(100, 112)))             # 3 fresh blocks: no cached block reused
    assert ce.take() == ([], [])
    bm.release(other)
    bm.allocate(2)                                          # reuses the tail block, then the 2nd of chunk 1
    assert ce.take() == ([], [chunk_keys(scope, toks)[1]])
    bm.allocate(2)                                          # now a block of chunk 0 goes
    assert ce.take() == ([], [chunk_keys(scope, toks)[0]])
    assert not ce.held and not ce.chunk_of


def test_chunk_events_net_change_and_a_chunk_missing_a_block():
    scope = KeyScope("model-x", {"version": 1, "block_size": 4}, 8)
    bm = BlockManager(num_blocks=4, block_size=4)
    ce = ChunkEvents(bm, scope.seed(), 8)
    toks = list(range(16))
    blocks, hashes = _fill(bm, toks)
    ce.note(toks, hashes)
    bm.release(blocks)
    bm.allocate(4)                                          # everything evicted...
    bm.release(list(range(4)))
    blocks, hashes = _fill(bm, toks)                        # ...and computed again before anyone looked
    ce.note(toks, hashes)
    assert ce.take() == (chunk_keys(scope, toks), [])       # net: stored
    # a cache that lost a block of chunk 0 but has chunk 1 whole: chunk 1 is stored, keyed right
    ce2 = ChunkEvents(BlockManager(4, 4), scope.seed(), 8)
    ce2.blocks.block_of.update({h: i for i, h in enumerate(hashes[1:], 1)})
    ce2.note(toks, hashes)
    assert ce2.take() == ([chunk_keys(scope, toks)[1]], [])
