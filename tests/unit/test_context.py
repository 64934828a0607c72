"""The per-rollout context trie: parent choice, deltas, reconstruction, speed."""

from __future__ import annotations

import ast
import gc
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.producers.sdk.context import ContextError, ContextTrie, _Node, common_prefix

U32 = np.uint32


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=U32)


def test_first_call_has_no_parent() -> None:
    trie = ContextTrie()
    m = trie.add("a", arr(1, 2, 3), arr(4))
    assert m.parent_call_id is None and m.prefix_len == 0
    assert m.prompt_delta.tolist() == [1, 2, 3]


def test_append_only_conversation_costs_only_new_tokens() -> None:
    trie = ContextTrie()
    rng = np.random.default_rng(1)
    convo = np.zeros(0, U32)
    wire = 0
    prev = None
    for turn in range(20):
        user = rng.integers(0, 50_000, 30, dtype=U32)
        prompt = np.concatenate((convo, user))
        completion = rng.integers(0, 50_000, 10, dtype=U32)
        m = trie.add(f"c{turn}", prompt, completion)
        assert m.parent_call_id == prev
        assert m.prefix_len == len(convo)
        assert np.array_equal(m.prompt_delta, user)
        wire += len(m.prompt_delta) + len(completion)
        convo = np.concatenate((prompt, completion))
        prev = f"c{turn}"
    assert wire == len(convo)  # unique tokens only, not O(turns x context)
    assert np.array_equal(trie.sequence("c19"), convo)


def test_edited_context_is_a_rewind() -> None:
    trie = ContextTrie()
    trie.add("a", arr(1, 2, 3, 4), arr(5, 6))
    # the harness summarised: keeps 1 2, replaces the rest
    m = trie.add("b", arr(1, 2, 9, 9), arr(7))
    assert (m.parent_call_id, m.prefix_len) == ("a", 2)
    assert m.prompt_delta.tolist() == [9, 9]
    assert m.prefix_len < trie.sequence_len("a")


def test_an_explicit_branch_point_anchors_the_next_call() -> None:
    """After anchor = X (RolloutHandle.branch), the next call continuing X's sequence goes on
    the wire under X, not under the later call that shares a longer prefix; the anchor is
    one-shot, and a call that does not continue X keeps the longest-prefix match."""
    ctx = ContextTrie()
    ctx.add("x", [1, 2, 3], [4, 5])  # X: sequence 1 2 3 4 5
    ctx.add("y", [1, 2, 3, 4, 5, 6, 7], [8])  # Y continues X with 6 7
    rewind = [1, 2, 3, 4, 5, 6, 9]  # from X again: shares 6 with Y
    assert ctx.match(rewind)[:2] == ("y", 6)  # the longest prefix alone: inside Y
    ctx.anchor = "x"
    got = ctx.add("z", rewind, [10])
    assert (got.parent_call_id, got.prefix_len, got.prompt_delta.tolist()) == ("x", 5, [6, 9])
    assert ctx.anchor is None
    assert ctx.add("w", [1, 2, 3, 4, 5, 6, 11], [12])[:2] == ("z", 6)  # one-shot
    ctx.anchor = "x"  # the next call does not continue X: the trie's own match
    assert ctx.add("v", [1, 2, 7], [13])[:2] == ("w", 2) and ctx.anchor is None
    ctx.anchor = "y"  # already the longest match: unchanged
    assert ctx.add("u", [1, 2, 3, 4, 5, 6, 7, 8, 14], [15])[:2] == ("y", 8)
    ctx.anchor = "nope"  # not a call of this rollout: ignored
    assert ctx.add("t", [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 1], [2])[:2] == ("u", 10)
    full = ContextTrie()  # every reader rebuilds the same prompts from the wire deltas
    for call_id, parent, prefix, delta, completion in (
        ("x", None, 0, [1, 2, 3], [4, 5]),
        ("y", "x", 5, [6, 7], [8]),
        ("z", "x", 5, [6, 9], [10]),
    ):
        full.add_delta(call_id, parent, prefix, delta, completion)
    assert full.sequence("z").tolist() == [*rewind, 10]


def test_prompt_ending_inside_a_completion() -> None:
    trie = ContextTrie()
    trie.add("a", arr(1, 2), arr(3, 4, 5))
    m = trie.match(arr(1, 2, 3))
    assert (m.parent_call_id, m.prefix_len, m.prompt_delta.tolist()) == ("a", 3, [])


def test_longest_shared_prefix_wins_over_recency() -> None:
    trie = ContextTrie()
    trie.add("long", arr(1, 2, 3, 4, 5), arr(6))
    trie.add("short", arr(1, 2, 9), arr(8))
    m = trie.match(arr(1, 2, 3, 4, 7))
    assert (m.parent_call_id, m.prefix_len) == ("long", 4)


def test_ties_go_to_the_most_recent_call() -> None:
    trie = ContextTrie()
    trie.add("a", arr(1, 2, 3), arr(4))
    trie.add("b", arr(1, 2, 5), arr(6))
    trie.add("c", arr(1, 2, 7), arr(8))
    m = trie.match(arr(1, 2, 0))
    assert (m.parent_call_id, m.prefix_len) == ("c", 2)
    # identical sequences: the later one
    trie.add("d", arr(1, 2, 3), arr(4))
    assert trie.match(arr(1, 2, 3, 4, 5)).parent_call_id == "d"


def test_no_shared_token_means_no_parent() -> None:
    trie = ContextTrie()
    trie.add("a", arr(1, 2), arr(3))
    m = trie.add("b", arr(7, 8), arr())
    assert m.parent_call_id is None and m.prefix_len == 0


def test_reused_call_id_and_unknown_call_raise() -> None:
    trie = ContextTrie()
    trie.add("a", arr(1), arr(2))
    with pytest.raises(ContextError):
        trie.add("a", arr(1), arr(2))
    with pytest.raises(ContextError):
        trie.sequence("zz")
    with pytest.raises(ContextError):
        trie.full_prompt("a", 5, arr())
    with pytest.raises(ContextError):
        trie.add("b", np.zeros((2, 2), U32))


def test_add_delta_rebuilds_the_same_tree() -> None:
    src, dst = ContextTrie(), ContextTrie()
    prompts = [arr(1, 2, 3), arr(1, 2, 3, 4, 9), arr(1, 2, 8), arr(1, 2, 3, 4, 9, 5, 6)]
    completions = [arr(4), arr(5), arr(7), arr()]
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        m = src.add(f"c{i}", p, c)
        rebuilt = dst.add_delta(f"c{i}", m.parent_call_id, m.prefix_len, m.prompt_delta, c)
        assert np.array_equal(rebuilt, p)
        assert np.array_equal(dst.sequence(f"c{i}"), np.concatenate((p, c)))


def test_accepts_lists_and_packed_bytes() -> None:
    trie = ContextTrie()
    trie.add("a", [1, 2, 3], [4])
    m = trie.match(arr(1, 2, 3, 4, 5).tobytes())
    assert (m.parent_call_id, m.prefix_len, m.prompt_delta.tolist()) == ("a", 4, [5])


def test_common_prefix_long_arrays() -> None:
    a = np.arange(100_000, dtype=U32)
    b = a.copy()
    assert common_prefix(a, b) == len(a)
    b[70_000] = 0
    assert common_prefix(a, b) == 70_000
    b[10] = 0
    assert common_prefix(a, b) == 10
    assert common_prefix(a[:5], b) == 5


def _brute(calls: list[tuple[str, np.ndarray]], prompt: np.ndarray) -> tuple[str | None, int]:
    best: tuple[str | None, int] = (None, 0)
    for cid, seq in calls:  # in order: a later tie replaces an earlier one
        k = common_prefix(seq, prompt)
        if k > 0 and k >= best[1]:
            best = (cid, k)
    return best


token_lists = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(token_lists, token_lists, st.integers(0, 12)), min_size=1, max_size=12))
def test_matches_brute_force_and_reconstructs(
    ops: list[tuple[list[int], list[int], int]],
) -> None:
    """Random edits of earlier sequences: parent = brute-force longest/most recent, and the
    wire form rebuilds the exact prompt."""
    trie = ContextTrie()
    calls: list[tuple[str, np.ndarray]] = []
    for i, (new, completion, cut) in enumerate(ops):
        base = calls[-1 - cut % len(calls)][1] if calls else arr()
        prompt = np.concatenate((base[: cut * 2], np.array(new, U32)))
        expect = _brute(calls, prompt)
        m = trie.add(f"c{i}", prompt, np.array(completion, U32))
        assert (m.parent_call_id, m.prefix_len) == expect
        parent = dict(calls)[m.parent_call_id] if m.parent_call_id else arr()
        assert np.array_equal(np.concatenate((parent[: m.prefix_len], m.prompt_delta)), prompt)
        calls.append((f"c{i}", np.concatenate((prompt, np.array(completion, U32)))))
    for cid, seq in calls:
        assert np.array_equal(trie.sequence(cid), seq)


def test_million_token_rollout_is_fast() -> None:
    """300 appended turns up to ~1M tokens: each call is one vectorised compare, not a loop."""
    trie = ContextTrie()
    rng = np.random.default_rng(0)
    convo = rng.integers(0, 150_000, 1_000_000, dtype=U32)
    step = len(convo) // 300
    t0 = time.perf_counter()
    for i in range(300):
        end = (i + 1) * step
        m = trie.add(f"c{i}", convo[: end - 100], convo[end - 100 : end])
        assert len(m.prompt_delta) == step - 100
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"{elapsed:.2f}s for 300 calls"
    assert len(trie) == 300


def test_context_module_is_pure() -> None:
    tree = ast.parse((Path(__file__).parents[2] / "producers" / "sdk" / "context.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # the package's error classes (no imports of their own) are the one module of ours
            name = node.module
            imported.add(name if name == "rollstream.producers.errors" else name.split(".")[0])
    allowed = {"__future__", "collections", "threading", "typing", "numpy"}
    assert imported <= allowed | {"rollstream.producers.errors"}, imported


@pytest.mark.parametrize(("scale", "trials"), [(1, 100), (700, 6)])
def test_mixed_appends_and_rewinds_match_brute_force(scale: int, trials: int) -> None:
    """Mostly appends to the last call (the fast path) mixed with rewinds into any earlier call,
    over a tiny alphabet so prefixes collide often. At scale 700 turns run to thousands of
    tokens: the sequence buffer grows while appended labels view it, and rewinds rewrite it
    (a label left viewing it would change an earlier call's sequence)."""
    rng = np.random.default_rng(5)

    def noise(hi: int) -> np.ndarray:
        return rng.integers(0, 3, rng.integers(0, hi * scale), dtype=U32)

    for _ in range(trials):
        trie = ContextTrie()
        calls: list[tuple[str, np.ndarray]] = []
        for i in range(25):
            if calls and rng.random() < 0.5:
                prompt = np.concatenate((calls[-1][1], noise(4)))
            elif calls:
                base = calls[rng.integers(len(calls))][1]
                prompt = np.concatenate((base[: rng.integers(0, len(base) + 1)], noise(4)))
            else:
                prompt = noise(4)
            completion = noise(3)
            expect = _brute(calls, prompt)
            m = trie.add(f"c{i}", prompt, completion)
            assert (m.parent_call_id, m.prefix_len) == expect
            calls.append((f"c{i}", np.concatenate((prompt, completion))))
        for cid, seq in calls:
            assert np.array_equal(trie.sequence(cid), seq)


def test_strided_and_reused_caller_arrays() -> None:
    """A harness may pass strided views and reuse (overwrite) its own buffers between calls:
    the trie reads them as values and keeps its own copies."""
    rng = np.random.default_rng(11)
    convo = rng.integers(0, 50_000, 30_000, dtype=U32)
    wide = np.zeros(2 * len(convo), U32)
    wide[::2] = convo  # convo as a strided view: wide[::2]
    scratch = np.zeros(len(convo), U32)  # one buffer the harness refills for every call
    plain, odd = ContextTrie(), ContextTrie()
    step = 1_000
    for i in range(25):
        end = (i + 1) * step
        prompt, completion = convo[: end - 100], convo[end - 100 : end]
        scratch[: end - 100] = prompt
        mine = completion.copy()
        a = plain.add(f"c{i}", scratch[: end - 100], mine)
        b = odd.add(f"c{i}", wide[: 2 * (end - 100) : 2], wide[2 * (end - 100) : 2 * end : 2])
        assert (a.parent_call_id, a.prefix_len) == (b.parent_call_id, b.prefix_len)
        assert a.prefix_len == (end - step if i else 0)
        assert np.array_equal(a.prompt_delta, prompt[a.prefix_len :])
        assert np.array_equal(b.prompt_delta, prompt[b.prefix_len :])
        scratch[:] = 7  # the harness reuses its buffers: nothing recorded may change
        mine[:] = 7
    for i in range(25):
        expect = convo[: (i + 1) * step]
        assert np.array_equal(plain.sequence(f"c{i}"), expect)
        assert np.array_equal(odd.sequence(f"c{i}"), expect)
    # a changed token far inside the last sequence is a rewind, found despite the fast path
    edited = convo[: 25 * step].copy()
    edited[12_345] += 1
    m = plain.match(edited)
    assert (m.parent_call_id, m.prefix_len) == ("c24", 12_345)


def test_released_memory_is_reused_without_touching_live_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tries give their blocks back on release() and later tries take them: what a live trie
    holds never changes, a released trie is empty and usable, the pool keeps at most its cap."""
    from rollstream.producers.sdk import context

    pool = context._BlockPool(keep_bytes=1 << 20)
    monkeypatch.setattr(context, "_POOL", pool)
    rng = np.random.default_rng(7)
    convo = rng.integers(0, 50_000, 40_000, dtype=U32)
    live = ContextTrie()
    for i in range(10):
        end = (i + 1) * 4_000
        live.add(f"L{i}", convo[: end - 500], convo[end - 500 : end])
        other = ContextTrie()  # fills blocks that earlier tries released, then releases them
        noise = rng.integers(0, 50_000, 30_000, dtype=U32)
        for j in range(1, 6):
            other.add(f"o{j}", noise[: j * 6_000 - 100], noise[j * 6_000 - 100 : j * 6_000])
        other.add("rewind", noise[:777], noise[5:9])  # the general path keeps its label too
        assert np.array_equal(other.sequence("o5"), noise[:30_000])
        before = pool.kept_bytes
        other.release()
        assert len(other) == 0 and pool.kept_bytes > before
        assert pool.kept_bytes <= pool.keep_bytes
    for i in range(10):
        assert np.array_equal(live.sequence(f"L{i}"), convo[: (i + 1) * 4_000])
    live.release()
    assert len(live) == 0 and live.match(convo[:100]).parent_call_id is None
    m = live.add("again", convo[:100], convo[100:110])  # a released trie records afresh
    assert (m.parent_call_id, m.prefix_len) == (None, 0)
    assert np.array_equal(live.sequence("again"), convo[:110])


def test_release_frees_the_nodes_without_the_cyclic_gc() -> None:
    """A released trie's nodes (appended leaves, split edges, rewinds) are freed by their
    reference counts: the cyclic GC has nothing of it to find (it used to, every rollout)."""

    def nodes() -> int:
        return sum(type(o) is _Node for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = nodes()
        trie = ContextTrie()
        convo = np.arange(1, 200, dtype=np.uint32)
        for i in range(8):
            if i == 5:  # a rewind: splits an edge, leaves the spine
                convo = np.concatenate((convo[:150], [7, 7, 7]))
            trie.add(f"c{i}", convo, [9000 + i])
            convo = np.concatenate((convo, [9000 + i], np.arange(10, dtype=np.uint32)))
        assert nodes() - before > 8
        trie.release()
        assert nodes() - before == 1  # the new, empty root
        del trie
        assert nodes() == before
    finally:
        gc.enable()
