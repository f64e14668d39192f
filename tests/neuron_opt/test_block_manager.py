"""Block manager property test: random admit (with prefix hits) / grow / free sequences, checked against a
simulated KV pool.

The oracle writes each token id into the (block, offset) the manager's table gives for its position, as a graph
would write K/V. Then: a prefix hit must hand out blocks that hold exactly the prompt's tokens; no block is
written while another sequence holds it; reference counts equal the number of tables holding a block; the free
queue is exactly the unreferenced blocks; nothing leaks (every block is free once all sequences are freed).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_opt.runtime.block_manager import NULL_BLOCK, BlockManager, WindowedBlockManager, hash_block

BS = 4
PREFIXES = [[7, 7, 1, 2, 3, 4, 5, 6, 9], [7, 7, 1, 2, 8, 8], [3] * 10, []]

ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(0, 5), max_size=9)),
    st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 9)),
    st.tuples(st.just("free"), st.integers(0, 7), st.just(0)),
), max_size=60)


def check(bm: BlockManager, pool: dict[int, dict[int, int]], seqs: dict[str, list[int]],
          visible: dict[str, int] | None = None) -> None:
    """`visible`: a window group's first logical block each sequence still holds (the null block before it)."""
    visible = visible or {}
    held = [0] * bm.num_blocks
    for sid, t in bm.tables.items():
        assert all(b == NULL_BLOCK for b in t[:visible.get(sid, 0)])
        assert NULL_BLOCK not in t[visible.get(sid, 0):]
        for b in t:
            if b != NULL_BLOCK:
                held[b] += 1
    assert held == bm.ref and held[NULL_BLOCK] == 0
    assert set(bm.free) == {b for b in range(1, bm.num_blocks) if bm.ref[b] == 0}
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h
    for sid, table in bm.tables.items():  # every computed token it still holds sits where the table says
        for p, tok in enumerate(seqs[sid][: len(bm.hashes[sid]) * BS]):
            if p // BS >= visible.get(sid, 0):
                assert pool[table[p // BS]][p % BS] == tok


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(6, 24), st.booleans())
def test_random_alloc_free_and_prefix_hits_keep_the_pool_consistent(script, num_blocks, caching):
    bm = BlockManager(num_blocks, BS, caching)
    pool: dict[int, dict[int, int]] = {}  # block -> offset -> token id written there
    seqs: dict[str, list[int]] = {}  # live sequence -> its computed tokens
    n = 0

    def write(sid: str, start: int, tokens: list[int]) -> None:
        for p in range(start, start + len(tokens)):
            b = bm.table(sid)[p // BS]
            assert bm.ref[b] == 1, "a block is written while another sequence holds it"
            pool.setdefault(b, {})[p % BS] = tokens[p - start]

    for op, a, extra in script:
        live = sorted(seqs)
        if op == "admit":
            tokens = PREFIXES[a] + extra
            if not tokens:
                continue
            prefix = bm.cached_prefix(tokens)
            for i, b in enumerate(prefix):  # the hit holds exactly this prompt's tokens
                assert [pool[b][o] for o in range(BS)] == tokens[i * BS:(i + 1) * BS]
            assert len(prefix) * BS < len(tokens)  # the last token is always computed
            sid = f"s{n}"
            n += 1
            if bm.allocate(sid, len(tokens), prefix):
                start = len(prefix) * BS
                write(sid, start, tokens[start:])
                seqs[sid] = tokens
                bm.commit(sid, tokens, len(tokens))
            else:
                assert sid not in bm.tables
        elif op == "grow" and live:
            sid = live[a % len(live)]
            more = [(len(seqs[sid]) * 3 + i) % 6 for i in range(extra)]
            before = (list(bm.free), list(bm.ref))
            if bm.allocate(sid, len(seqs[sid]) + len(more)):
                write(sid, len(seqs[sid]), more)
                seqs[sid] += more
                bm.commit(sid, seqs[sid], len(seqs[sid]))
            else:  # all or nothing
                assert (list(bm.free), list(bm.ref)) == before
        elif op == "free" and live:
            sid = live[a % len(live)]
            bm.free_sequence(sid)
            del seqs[sid]
        check(bm, pool, seqs)
    for sid in list(seqs):
        bm.free_sequence(sid)
    check(bm, pool, {})
    assert bm.num_free_blocks == num_blocks - 1  # nothing leaked
    if not caching:
        assert not bm.cached


def test_hashes_chain_over_the_whole_prefix():
    a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [9, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b, [5, 6, 7, 8])  # same block, different prefix
    assert hash_block(a, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_lru_evicts_the_oldest_free_block_and_forgets_its_prefix():
    bm = BlockManager(4, BS)  # 3 usable blocks
    assert bm.allocate("a", 8) and bm.allocate("b", 4)
    bm.commit("a", list(range(8)), 8)
    bm.commit("b", [9, 9, 9, 9], 4)
    bm.free_sequence("b")
    bm.free_sequence("a")  # tail first: a's second block, then its first
    assert list(bm.free) == [3, 2, 1]
    assert bm.cached_prefix(list(range(8)) + [0]) == [1, 2]
    assert bm.allocate("c", 4)  # takes block 3 (b's): b's prefix is gone, a's stays
    assert bm.cached_prefix([9, 9, 9, 9, 1]) == [] and bm.cached_prefix(list(range(8)) + [0]) == [1, 2]
    assert bm.allocate("d", 12, bm.cached_prefix(list(range(8)) + [0])) is False  # a's 2 + 1 new > 2 free
    assert bm.allocate("d", 9, bm.cached_prefix(list(range(8)) + [0])) is False
    assert bm.allocate("d", 8, bm.cached_prefix(list(range(8)) + [0])) and bm.table("d") == [1, 2]


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(6, 24), st.integers(6, 24), st.integers(1, 9), st.booleans())
def test_window_group_holds_what_the_window_sees_and_nothing_leaks(script, num_blocks, window_blocks, window,
                                                                     caching):
    """WindowedBlockManager: the full group behaves as one BlockManager; the window group holds a sequence's blocks
    from the first one its next query sees (positions > next - window) and the null block before it; a prefix hit
    hands out window blocks that hold exactly the prompt's tokens; both groups are all or nothing together."""
    wm = WindowedBlockManager(num_blocks, window_blocks, BS, window, caching)
    pools: dict[str, dict[int, dict[int, int]]] = {"full": {}, "window": {}}
    seqs: dict[str, list[int]] = {}
    n = 0

    def groups() -> list[tuple[str, BlockManager]]:
        return [("full", wm.full), ("window", wm.window)]

    def write(sid: str, start: int, tokens: list[int]) -> None:
        for name, bm in groups():
            for p in range(start, start + len(tokens)):
                b = bm.table(sid)[p // BS]
                assert b != NULL_BLOCK and bm.ref[b] == 1, "a block is written while another sequence holds it"
                pools[name].setdefault(b, {})[p % BS] = tokens[p - start]

    def checks() -> None:
        check(wm.full, pools["full"], seqs)
        check(wm.window, pools["window"], seqs, {s: wm.first_visible_block(len(t) - 1) for s, t in seqs.items()})

    for op, a, extra in script:
        live = sorted(seqs)
        if op == "admit":
            tokens = PREFIXES[a] + extra
            if not tokens:
                continue
            prefix = wm.cached_prefix(tokens)
            sid = f"s{n}"
            n += 1
            if wm.allocate(sid, len(tokens), prefix):
                start = len(prefix) * BS
                for i in range(wm.first_visible_block(start), len(prefix)):  # the hit's visible window blocks
                    b = wm.window.table(sid)[i]
                    assert [pools["window"][b][o] for o in range(BS)] == tokens[i * BS:(i + 1) * BS]
                write(sid, start, tokens[start:])
                seqs[sid] = tokens
                wm.commit(sid, tokens, len(tokens))
                wm.slide(sid, len(tokens) - 1)  # the last token's query is next (the scheduler's update)
            else:
                assert sid not in wm.full.tables and sid not in wm.window.tables
        elif op == "grow" and live:
            sid = live[a % len(live)]
            more = [(len(seqs[sid]) * 3 + i) % 6 for i in range(extra)]
            before = [(list(bm.free), list(bm.ref)) for _, bm in groups()]
            if wm.allocate(sid, len(seqs[sid]) + len(more)):
                write(sid, len(seqs[sid]), more)
                seqs[sid] += more
                wm.commit(sid, seqs[sid], len(seqs[sid]))
                wm.slide(sid, len(seqs[sid]) - 1)
            else:  # all or nothing, in both groups
                assert [(list(bm.free), list(bm.ref)) for _, bm in groups()] == before
        elif op == "free" and live:
            sid = live[a % len(live)]
            wm.free_sequence(sid)
            del seqs[sid]
        checks()
    for sid in list(seqs):
        wm.free_sequence(sid)
    checks()
    assert wm.full.num_free_blocks == num_blocks - 1 and wm.window.num_free_blocks == window_blocks - 1
    assert not wm.released
