"""launch/data_parallel/routing.py: the block-hash index fed by KV events, the router's hashes, the three policies."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.data_parallel.routing import PrefixIndex, RequestHasher, Router
from protocol.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from tests.engine_core.scheduler_support import BLOCK_SIZE, make_core, make_request, prompt_of, run


def stored(*hashes: int, group: int | None = 0) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BLOCK_SIZE,
                       lora_id=None, medium=MEDIUM_GPU, lora_name=None, group_idx=group)


def removed(*hashes: int, group: int | None = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=MEDIUM_GPU, group_idx=group)


# ---- the router hashes what the ledger hashes -----------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_router_hashes_equal_the_ledgers_stored_hashes(algo, salt):
    core, executor = make_core(prefix_caching_hash_algo=algo, kv_events_endpoint="inproc://unused")
    prompt = prompt_of(3, 5 * BLOCK_SIZE + 7)
    core.add_request(make_request("r", prompt, max_tokens=1, cache_salt=salt))
    run(core, executor)
    events = core.take_kv_events()
    ledger = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert ledger == RequestHasher(BLOCK_SIZE, algo)(prompt, salt)
    assert len(ledger) == 5
    assert RequestHasher(BLOCK_SIZE, algo)(prompt, "other")[0] != ledger[0]


def test_an_engines_events_route_its_prefix_back_to_it():
    """Two real engine cores; the second request with a shared prefix goes where the first one ran."""
    cores = [make_core(kv_events_endpoint="inproc://unused") for _ in range(2)]
    router = Router(2, "prefix", BLOCK_SIZE, "sha256")
    shared = prompt_of(1, 4 * BLOCK_SIZE)
    router.route(prompt_of(9, 40))  # engine 0 (least load) gets an unrelated request and keeps it
    first = router.route(shared + prompt_of(2, 20))
    assert first == 1
    core, executor = cores[first]
    core.add_request(make_request("a", shared + prompt_of(2, 20), max_tokens=2))
    run(core, executor)
    router.on_events(first, core.take_kv_events())
    assert router.loads == [1, 1]
    assert router.route(shared + prompt_of(3, 20)) == 1  # equal loads: without the prefix, engine 0


# ---- the index ----------------------------------------------------------------------------------


def test_index_counts_duplicate_stores_and_forgets_on_clear():
    index = PrefixIndex(2)
    index.apply(0, [stored(1, 2, 3), stored(2)])
    index.apply(1, [stored(1)])
    assert index.matched_blocks([1, 2, 3, 4]) == [3, 1]
    index.apply(0, [removed(2)])
    assert index.matched_blocks([1, 2, 3]) == [3, 1]  # one copy of 2 is still stored
    index.apply(0, [removed(2)])
    assert index.matched_blocks([1, 2, 3]) == [1, 1]  # a chain breaks at its first missing block
    index.apply(0, [removed(99)])  # unknown: ignored
    index.apply(1, [AllBlocksCleared()])
    assert index.matched_blocks([1]) == [1, 0]
    assert index.num_blocks(1) == 0 and 2 not in index.holders


def test_index_ignores_other_kv_cache_groups():
    index = PrefixIndex(1)
    index.apply(0, [stored(5, group=1), stored(6, group=None)])
    assert index.matched_blocks([5]) == [0]
    assert index.matched_blocks([6]) == [1]
    index.apply(0, [removed(6, group=1)])
    assert index.matched_blocks([6]) == [1]


EVENT = st.one_of(
    st.tuples(st.just("store"), st.lists(st.integers(0, 7), min_size=1, max_size=4)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 7), min_size=1, max_size=4)),
    st.tuples(st.just("clear"), st.just([])),
)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 2), EVENT), max_size=40), st.lists(st.integers(0, 7), max_size=6))
def test_index_equals_a_multiset_model(steps, chain):
    """After any event sequence, the index agrees with per-engine multisets, and matched_blocks with a scan."""
    index = PrefixIndex(3)
    model: list[dict[int, int]] = [{}, {}, {}]
    for engine, (kind, hashes) in steps:
        if kind == "store":
            index.apply(engine, [stored(*hashes)])
            for h in hashes:
                model[engine][h] = model[engine].get(h, 0) + 1
        elif kind == "remove":
            index.apply(engine, [removed(*hashes)])
            for h in hashes:
                if model[engine].get(h, 0) > 1:
                    model[engine][h] -= 1
                else:
                    model[engine].pop(h, None)
        else:
            index.apply(engine, [AllBlocksCleared()])
            model[engine] = {}
    assert index.counts == model
    assert index.holders == {h: {e for e in range(3) if h in model[e]} for m in model for h in m}
    expected = []
    for e in range(3):
        n = 0
        while n < len(chain) and chain[n] in model[e]:
            n += 1
        expected.append(n)
    assert index.matched_blocks(chain) == expected


# ---- the policies -------------------------------------------------------------------------------


def test_round_robin_takes_engines_in_turn_and_skips_dead_ones():
    router = Router(3, "round-robin", BLOCK_SIZE, "sha256")
    assert [router.route([1]) for _ in range(4)] == [0, 1, 2, 0]
    router.engine_dead(1)
    assert [router.route([1]) for _ in range(3)] == [2, 0, 2]
    assert router.num_routed == [3, 1, 3]


def test_least_load_follows_the_loads():
    router = Router(2, "least-load", BLOCK_SIZE, "sha256")
    assert [router.route([1]) for _ in range(3)] == [0, 1, 0]
    router.finished(0)
    router.finished(0)
    assert router.loads == [0, 1]
    assert router.route([1]) == 0


def test_prefix_prefers_the_longest_held_prefix_then_the_least_load():
    router = Router(3, "prefix", BLOCK_SIZE, "sha256")
    prompt = prompt_of(5, 3 * BLOCK_SIZE + 1)
    h = router.hasher(prompt)
    router.on_events(1, [stored(h[0])])
    router.on_events(2, [stored(*h)])
    assert router.route(prompt) == 2
    assert router.route(prompt) == 2  # a longer prefix beats a lower load
    router.on_events(1, [stored(h[1], h[2])])
    assert router.route(prompt) == 1  # a tie at 3 blocks: the lower load
    assert router.route(prompt_of(6, 40)) == 0  # nothing held anywhere: the least-loaded engine
    router.engine_dead(2)
    assert router.index.num_blocks(2) == 0
    assert router.route(prompt) == 1
    router.engine_dead(0)
    router.engine_dead(1)
    with pytest.raises(ValueError, match="no engine core"):
        router.route(prompt)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        Router(2, "random", BLOCK_SIZE, "sha256")  # type: ignore[arg-type]


@settings(max_examples=200)
@given(st.lists(st.lists(st.integers(0, 5), max_size=6), min_size=3, max_size=3),
       st.lists(st.integers(0, 4), min_size=3, max_size=3), st.integers(1, 6))
def test_prefix_picks_a_longest_holder_and_the_least_loaded_among_them(held_blocks, loads, prompt_blocks):
    """Whatever each engine holds of the prompt's chain and whatever its load, the pick is optimal."""
    router = Router(3, "prefix", BLOCK_SIZE, "xxhash")
    prompt = prompt_of(11, prompt_blocks * BLOCK_SIZE)
    chain = router.hasher(prompt)
    for engine, held in enumerate(held_blocks):
        router.on_events(engine, [stored(*(chain[i] for i in held if i < len(chain)))] if held else [])
    router.loads = list(loads)
    matched = router.index.matched_blocks(chain)
    engine = router.route(prompt)
    assert matched[engine] == max(matched)
    assert loads[engine] == min(loads[e] for e in range(3) if matched[e] == max(matched))
    assert router.loads[engine] == loads[engine] + 1
