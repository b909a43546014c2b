"""The front end's KV-aware routing without sockets: the index applies event batches in sequence
order (gaps held back, clears, restarts, media), the scorer weighs cached prefix against load,
the request router's decisions are a function of events and load alone, and engines must agree
on their hash parameters."""

import random

import pytest
from fake_executor import MakeHarness

from api_server.routing.engine_record import EngineLoad, EngineRecord, engine_records
from api_server.routing.kv_event_subscriber import subscribable_endpoint
from api_server.routing.kv_index import KVBlockIndex, Offer, index_key
from api_server.routing.kv_scorer import KVScorer, KVScoreWeights, predicted_hit_tokens
from api_server.routing.router import Decision, RequestHasher, Router, RoutingPolicy
from kv_hashing.block_hasher import BlockHasher, first_block_extra_keys
from kv_hashing.hash_params import (
    HashParams,
    decode_hash_params,
    hash_params,
    hash_params_mismatch,
)
from protocol.config import CacheConfig
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_removed,
    block_stored,
)

BLOCK_SIZE = 4
PARAMS = HashParams(True, "sha256", BLOCK_SIZE, "seed", BLOCK_SIZE, 1)


def stored(hashes: list[bytes], medium: str = "GPU") -> BlockStored:
    event = block_stored(hashes, None, [1] * BLOCK_SIZE * len(hashes), BLOCK_SIZE, 0)
    return BlockStored(
        event.block_hashes, None, event.token_ids, BLOCK_SIZE, None, medium, None, None, 0
    )


def records(num_engines: int) -> list[EngineRecord]:
    return engine_records([f"tcp://engine-{idx}:5555" for idx in range(num_engines)])


def outstanding(engines: list[EngineRecord]) -> list[int]:
    return [engine.load.outstanding_tokens for engine in engines]


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), 0)


def keys_of(hashes: list[bytes]) -> list[bytes]:
    return [index_key(block_hash, 0) for block_hash in hashes]


def prompt_hashes(prompt: list[int], salt: str | None = None) -> list[bytes]:
    return BlockHasher(BLOCK_SIZE, "sha256", "seed").hash_prefix(
        prompt, first_block_extra_keys(salt)
    )


def test_batches_apply_in_sequence_and_a_gap_waits_for_its_replay() -> None:
    index = KVBlockIndex(records(2))
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert index.offer(0, 0, batch(stored([a, b]))) is Offer.APPLIED
    assert index.offer(0, 2, batch(stored([c]))) is Offer.GAP  # batch 1 was lost
    assert index.engine_keys(0) == set(keys_of([a, b]))
    assert index.offer(0, 1, batch(block_removed([b], 0))) is Offer.APPLIED  # the replay
    assert index.offer(0, 2, batch(stored([c]))) is Offer.APPLIED
    assert index.offer(0, 1, batch(block_removed([b], 0))) is Offer.STALE  # live, late
    assert index.engine_keys(0) == set(keys_of([a, c]))
    assert [engine.kv_events.next_seq for engine in index.records] == [3, 0]
    assert index.engine_keys(1) == set()
    index.check_invariants()


def test_all_blocks_cleared_empties_only_that_engine() -> None:
    index = KVBlockIndex(records(2))
    a, b = b"a" * 32, b"b" * 32
    index.offer(0, 0, batch(stored([a, b])))
    index.offer(1, 0, batch(stored([a])))
    index.offer(0, 1, batch(AllBlocksCleared()))
    assert index.engine_keys(0) == set() and index.engine_keys(1) == set(keys_of([a]))
    assert index.prefix_hits(keys_of([a, b])) == [(0, 0.0), (1, 1.0)]
    index.offer(0, 2, batch(stored([a])))
    assert index.num_blocks(0) == 1
    assert [engine.kv_events.num_clears for engine in index.records] == [1, 0]
    index.check_invariants()


def test_a_restarted_publisher_is_forgotten_and_followed_from_seq_0() -> None:
    index = KVBlockIndex(records(1))
    index.offer(0, 0, batch(stored([b"a" * 32])))
    index.offer(0, 1, batch(stored([b"b" * 32])))
    index.restart(0)
    assert index.num_blocks(0) == 0 and index.records[0].kv_events.next_seq == 0
    assert index.offer(0, 0, batch(stored([b"c" * 32]))) is Offer.APPLIED
    assert index.engine_keys(0) == set(keys_of([b"c" * 32]))


def test_skipping_lost_batches_keeps_what_was_known_and_ignores_unknown_removals() -> None:
    index = KVBlockIndex(records(1))
    index.offer(0, 0, batch(stored([b"a" * 32])))
    index.skip_to(0, 5)
    assert index.offer(0, 5, batch(block_removed([b"z" * 32], 0))) is Offer.APPLIED
    assert index.records[0].kv_events.num_unknown_removals == 1 and index.num_blocks(0) == 1
    with pytest.raises(ValueError, match="back to seq 2"):
        index.skip_to(0, 2)


def test_prefix_hits_count_the_run_from_block_0_weighted_by_medium() -> None:
    index = KVBlockIndex(records(3))
    h = [bytes([i]) * 32 for i in range(4)]
    index.offer(0, 0, batch(stored(h[:3])))  # blocks 0-2 on the GPU
    index.offer(1, 0, batch(stored(h[:2], "CPU"), stored([h[3]])))  # 0-1 in host memory, 3
    index.offer(2, 0, batch(stored(h[1:])))  # no block 0: no usable prefix
    assert index.prefix_hits(keys_of(h)) == [(3, 3.0), (2, 1.0), (0, 0.0)]
    index.offer(1, 1, batch(stored([h[0]])))  # block 0 on the GPU too: the best medium counts
    assert index.prefix_hits(keys_of(h)) == [(3, 3.0), (2, 1.5), (0, 0.0)]
    index.offer(1, 2, batch(BlockRemoved([h[0]], "CPU", 0)))
    assert index.prefix_hits(keys_of(h))[1] == (2, 1.5)  # its GPU copy remains
    index.check_invariants()


def test_the_scorer_weighs_the_cached_prefix_against_waiting_prefill_and_decodes() -> None:
    engines = records(2)
    load = engines[0].load
    scorer = KVScorer(KVScoreWeights(prefill_weight=1.0, decode_weight=8.0), BLOCK_SIZE)
    prompt_len = 41  # 10 full blocks before the last token
    # engine 0 holds 8 blocks (32 tokens): cost 41 - 32 = 9, engine 1 costs 41
    assert scorer.costs([8.0, 0.0], prompt_len, engines) == [9.0, 41.0]
    assert scorer.choose([8.0, 0.0], prompt_len, engines, [0, 1], [8, 0]) == 0
    load.add(20, 20, 60)  # 20 prompt tokens waiting on engine 0: 29 still beats 41
    assert scorer.choose([8.0, 0.0], prompt_len, engines, [0, 1], [8, 0]) == 0
    load.start_decoding(20, 20)
    for _ in range(4):
        load.add(0, 4, 10)
        load.start_decoding(0, 4)
    assert scorer.costs([8.0, 0.0], prompt_len, engines) == [9.0 + 5 * 8.0, 41.0]
    assert scorer.choose([8.0, 0.0], prompt_len, engines, [0, 1], [8, 0]) == 1  # too busy now
    assert scorer.choose([8.0, 0.0], prompt_len, engines, [0], [8, 0]) == 0  # the only candidate
    load.check_invariants(0)
    with pytest.raises(LookupError):
        scorer.choose([0.0, 0.0], prompt_len, engines, [], [0, 0])
    with pytest.raises(ValueError, match="expected >= 0"):
        KVScoreWeights(decode_weight=-1.0)


def test_the_engines_reports_add_other_clients_work_to_the_front_ends_own() -> None:
    """A report counts the front end's own requests too (waiting ones by their whole prompts):
    only the rest is added, and what the front end sends or finishes after asking counts at once."""
    load, other = EngineLoad(), EngineLoad()
    load.add(8, 40, 60)  # waits on engine 0: 40-token prompt, 32 of them predicted cached
    asked = load.own_snapshot()
    assert asked == (40, 0)
    # engine 0 holds the request (40) and another client's 100 tokens waiting and 3 decodes
    load.on_report(140, 3, asked)
    assert (load.others_waiting_prefill_tokens, load.others_running_decodes) == (100, 3)
    assert (load.scored_waiting_prefill_tokens, load.scored_running_decodes) == (108, 3)
    load.add(30, 30, 40)  # a burst after the report counts before the next one
    assert load.scored_waiting_prefill_tokens == 138
    load.start_decoding(8, 40)
    assert (load.scored_waiting_prefill_tokens, load.scored_running_decodes) == (130, 4)
    # A report that already missed a request the front end still counts never goes negative.
    other.on_report(0, 0, (50, 2))
    assert (other.others_waiting_prefill_tokens, other.others_running_decodes) == (0, 0)
    load.forget_report()
    assert (load.scored_waiting_prefill_tokens, load.scored_running_decodes) == (30, 1)
    load.check_invariants(0)
    other.check_invariants(1)


def test_the_kv_policy_avoids_an_engine_busy_with_another_clients_work() -> None:
    """Two routers given the same events and reports decide alike; the engine another client
    keeps busy loses a request it would win on its cached prefix alone."""
    index = KVBlockIndex(records(2))
    prompt = list(range(3, 3 + 21))  # five blocks before the last token
    index.offer(0, 0, batch(stored(prompt_hashes(prompt[:20]))))
    routers = [Router(records(2), BLOCK_SIZE, RoutingPolicy.KV) for _ in range(3)]
    for router in routers:
        router.hasher = RequestHasher(PARAMS)

    def choose(router: Router) -> Decision:
        return router.choose(prompt, 30, None, [True, True], index, [True, True])

    assert choose(routers[0]).engine_idx == 0  # no report: its cached prefix wins
    for router in routers[1:]:
        busy, idle = (engine.load for engine in router.records)
        busy.on_report(16, 2, busy.own_snapshot())  # another client's work: 16 + 2 * 8 > 20 saved
        idle.on_report(0, 0, idle.own_snapshot())
    decisions = [choose(router) for router in routers[1:]]
    assert [d.engine_idx for d in decisions] == [1, 1]
    assert decisions[0] == decisions[1]
    for router in routers:
        router.check_invariants()


def test_ties_go_to_the_longer_hit_then_less_load_then_the_emptier_cache() -> None:
    engines = records(3)
    scorer = KVScorer(KVScoreWeights(prefill_weight=0.0, decode_weight=0.0), BLOCK_SIZE)
    assert scorer.choose([1.0, 2.0, 0.0], 20, engines, [0, 1, 2], [5, 5, 5]) == 1
    assert scorer.choose([0.0, 0.0, 0.0], 20, engines, [0, 1, 2], [5, 2, 3]) == 1
    engines[1].load.add(4, 4, 4)
    assert scorer.choose([0.0, 0.0, 0.0], 20, engines, [0, 1, 2], [5, 2, 3]) == 2


def test_a_predicted_hit_never_covers_the_last_prompt_token() -> None:
    assert predicted_hit_tokens(3.0, BLOCK_SIZE, 12) == 8  # the engine computes token 11
    assert predicted_hit_tokens(3.0, BLOCK_SIZE, 13) == 12
    assert predicted_hit_tokens(1.5, BLOCK_SIZE, 40) == 6


def test_requests_hash_as_the_engine_with_salt_and_larger_group_blocks() -> None:
    prompt = list(range(3, 3 + 17))  # four full blocks before the last token
    hasher = RequestHasher(PARAMS)
    assert hasher.keys(prompt, None) == keys_of(prompt_hashes(prompt[:16]))
    assert hasher.keys(prompt, "tenant") == keys_of(prompt_hashes(prompt[:16], "tenant"))
    assert hasher.keys(prompt, "tenant") != hasher.keys(prompt, None)
    wide = RequestHasher(HashParams(True, "sha256", BLOCK_SIZE, "seed", 2 * BLOCK_SIZE, 1))
    assert wide.keys(prompt, None) == keys_of(prompt_hashes(prompt[:16])[1::2])
    assert hasher.keys(prompt[:4], None) == []  # the only block holds the last token


def random_stream(rng: random.Random, num_engines: int) -> list[tuple[int, KVEventBatch]]:
    """Stores and removals of 12 hashes over the engines, with a clear now and then."""
    hashes = [bytes([i]) * 32 for i in range(12)]
    held: list[set[bytes]] = [set() for _ in range(num_engines)]
    stream = []
    for _ in range(60):
        engine = rng.randrange(num_engines)
        roll = rng.random()
        if roll < 0.05:
            held[engine].clear()
            stream.append((engine, batch(AllBlocksCleared())))
        elif roll < 0.7 or not held[engine]:
            new = [h for h in rng.sample(hashes, 3) if h not in held[engine]]
            held[engine].update(new)
            stream.append((engine, batch(stored(new))))
        else:
            gone = rng.sample(sorted(held[engine]), 1)
            held[engine].difference_update(gone)
            stream.append((engine, batch(block_removed(gone, 0))))
    return stream


@pytest.mark.parametrize("seed", range(5))
def test_decisions_are_a_function_of_the_events_and_the_load(seed: int) -> None:
    """Two routers fed the same events (one with its batches replayed out of order and late
    duplicates mixed in) make the same decisions for the same requests."""
    rng = random.Random(seed)
    stream = random_stream(rng, 3)
    indexes = [KVBlockIndex(records(3)), KVBlockIndex(records(3))]
    seqs = [0, 0, 0]
    numbered = []
    for engine, events in stream:
        numbered.append((engine, seqs[engine], events))
        seqs[engine] += 1
    for engine, seq, events in numbered:
        indexes[0].offer(engine, seq, events)
    shuffled = numbered + numbered[: len(numbered) // 2]
    rng.shuffle(shuffled)
    while any(
        indexes[1].records[e].kv_events.next_seq < seqs[e] for e in range(3)
    ):  # replays fill the gaps
        for engine, seq, events in shuffled:
            indexes[1].offer(engine, seq, events)
    assert [indexes[0].engine_keys(e) for e in range(3)] == [
        indexes[1].engine_keys(e) for e in range(3)
    ]
    routers = [Router(records(3), BLOCK_SIZE, RoutingPolicy.KV) for _ in range(2)]
    for router in routers:
        router.hasher = RequestHasher(PARAMS)
    prompts = [[rng.randrange(3, 50) for _ in range(rng.randrange(3, 30))] for _ in range(20)]
    choices: list[list[int]] = [[], []]
    for side, (router, index) in enumerate(zip(routers, indexes, strict=True)):
        for prompt in prompts:
            decision = router.choose(prompt, len(prompt) + 4, None, [True] * 3, index, [True] * 3)
            choices[side].append(decision.engine_idx)
            router.on_first_output(decision, decision.predicted_hit_tokens or 0)
        router.check_invariants()
    assert choices[0] == choices[1]
    predicted = [[engine.predicted_hit_tokens for engine in r.records] for r in routers]
    assert predicted[0] == predicted[1]


def test_the_kv_policy_follows_the_index_and_a_silent_engine_counts_by_load_alone() -> None:
    index = KVBlockIndex(records(2))
    router = Router(records(2), BLOCK_SIZE, RoutingPolicy.KV)
    router.hasher = RequestHasher(PARAMS)
    prompt = list(range(3, 3 + 21))  # five blocks before the last token
    index.offer(1, 0, batch(stored(prompt_hashes(prompt[:20]))))
    decision = router.choose(prompt, 30, None, [True, True], index, [True, True])
    assert (decision.engine_idx, decision.predicted_hit_tokens) == (1, 20)
    assert decision.num_prefill_tokens == 1
    router.release(decision, is_decoding=False)
    silent = router.choose(prompt, 30, None, [True, True], index, [True, False])
    assert (silent.engine_idx, silent.predicted_hit_tokens) == (0, 0)  # engine 0 holds nothing
    router.on_first_output(silent, 0)
    router.release(silent, is_decoding=True)
    # no stream answers: first-block's guess, which has seen this first block nowhere yet
    unknown = router.choose(prompt, 30, None, [True, True], index, [False, False])
    assert (unknown.engine_idx, unknown.predicted_hit_tokens) == (0, None)
    assert unknown.is_first_block and router.first_block.engine_of_prefix(prompt) == 0
    router.release(unknown, is_decoding=False)
    assert [engine.num_decisions for engine in router.records] == [2, 1]
    assert [engine.num_predicted for engine in router.records] == [1, 0]
    router.check_invariants()
    assert outstanding(router.records) == [0, 0]


def test_an_engines_record_holds_its_index_slice_load_and_counts() -> None:
    """The index and the router write into the records they were given; a request's tokens are
    counted once, in its engine's load, from the decision to its release."""
    engines = records(2)
    index = KVBlockIndex(engines)
    router = Router(engines, BLOCK_SIZE, RoutingPolicy.KV)
    router.hasher = RequestHasher(PARAMS)
    prompt = list(range(3, 3 + 21))  # five blocks before the last token
    index.offer(1, 0, batch(stored(prompt_hashes(prompt[:20]))))
    assert (engines[1].kv_events.next_seq, len(engines[1].kv_events.keys)) == (1, 5)
    assert (engines[0].kv_events.next_seq, engines[0].kv_events.keys) == (0, set())
    decision = router.choose(prompt, 30, None, [True, True], index, [True, True])
    load = engines[1].load
    assert decision.engine_idx == 1 and engines[1].num_decisions == 1
    assert (load.outstanding_tokens, load.waiting_prefill_tokens, load.num_waiting) == (30, 1, 1)
    router.on_first_output(decision, 20)
    assert (engines[1].num_predicted, engines[1].predicted_hit_tokens) == (1, 20)
    assert engines[1].actual_hit_tokens == 20 and (load.num_waiting, load.num_running) == (0, 1)
    router.release(decision, is_decoding=True)
    assert (load.outstanding_tokens, load.num_running) == (0, 0)
    assert not any(engine.is_indexed for engine in engines)  # no stream followed
    router.check_invariants()
    index.check_invariants()


def test_round_robin_least_loaded_and_first_block_keep_their_rules() -> None:
    robin = Router(records(3), BLOCK_SIZE, RoutingPolicy.ROUND_ROBIN)
    picks = [
        robin.choose([1] * 8, 8, None, [True, False, True], None, [False] * 3) for _ in range(4)
    ]
    assert [d.engine_idx for d in picks] == [0, 2, 0, 2]
    least = Router(records(2), BLOCK_SIZE, RoutingPolicy.LEAST_LOADED)
    first = least.choose([1] * 8, 100, None, [True, True], None, [False] * 2)
    assert least.choose([1] * 8, 10, None, [True, True], None, [False] * 2).engine_idx == 1
    least.release(first, is_decoding=False)
    assert least.choose([1] * 8, 10, None, [True, True], None, [False] * 2).engine_idx == 0
    affinity = Router(records(2), BLOCK_SIZE, RoutingPolicy.FIRST_BLOCK)
    a = affinity.choose([7] * 8, 10, None, [True, True], None, [False] * 2)
    b = affinity.choose([8] * 8, 10, None, [True, True], None, [False] * 2)
    again = affinity.choose([7] * 8 + [1], 10, None, [True, True], None, [False] * 2)
    assert (a.engine_idx, b.engine_idx, again.engine_idx) == (0, 1, 0)
    for decision in (a, b, again):
        affinity.release(decision, is_decoding=False)
    assert outstanding(affinity.records) == [0, 0]  # counted once, in the records


def test_engines_that_hash_differently_are_named_by_the_field() -> None:
    config = CacheConfig(block_size=16)
    mine = hash_params(config, [16])
    assert hash_params_mismatch(mine, hash_params(config, [16])) is None
    salted = hash_params(CacheConfig(block_size=16, hash_seed="other"), [16])
    assert hash_params_mismatch(mine, salted) == "hash_seed: 'kvserve' != 'other'"
    xx = hash_params(CacheConfig(block_size=16, prefix_caching_hash_algo="xxhash"), [16])
    assert hash_params_mismatch(mine, xx) == "algo: 'sha256' != 'xxhash'"
    assert hash_params_mismatch(mine, hash_params(config, [32])) == "group_block_size: 16 != 32"
    announced = {"algo": "sha256", "kv_events_endpoint": None} | {
        "is_prefix_caching": True,
        "block_size": 16,
        "hash_seed": "kvserve",
        "group_block_size": 16,
        "num_kv_cache_groups": 1,
    }
    assert decode_hash_params(announced, "engine B") == mine  # other keys are ignored
    with pytest.raises(ValueError, match="hash parameters of engine B"):
        decode_hash_params({"algo": "sha256"}, "engine B")


def test_a_wildcard_events_endpoint_takes_the_engines_host() -> None:
    assert subscribable_endpoint("tcp://*:5557", "tcp://10.0.0.7:5555") == "tcp://10.0.0.7:5557"
    assert subscribable_endpoint("tcp://0.0.0.0:5557", "ipc:///tmp/e.sock") == (
        "tcp://127.0.0.1:5557"
    )
    assert subscribable_endpoint("tcp://*:5557", "tcp://[fd00::1]:5555") == "tcp://[fd00::1]:5557"
    assert subscribable_endpoint("tcp://10.0.0.9:5557", "tcp://10.0.0.7:5555") == (
        "tcp://10.0.0.9:5557"
    )
    assert subscribable_endpoint("ipc:///tmp/kv.sock", "tcp://10.0.0.7:1") == "ipc:///tmp/kv.sock"


def test_an_engines_load_report_counts_prefill_still_to_compute_and_decodes(
    make_harness: MakeHarness,
) -> None:
    """get_load's figures: waiting requests by their whole prompt, a chunked prefill by what is
    left of it, and a request past its prompt as one decode."""
    harness = make_harness(max_num_batched_tokens=8, max_num_seqs=2, enable_chunked_prefill=True)
    assert harness.core.make_load() == {"waiting_prefill_tokens": 0, "running_decodes": 0}
    harness.add("a", list(range(1, 21)), max_tokens=20)  # 20 tokens: three chunks of 8
    harness.add("b", list(range(30, 42)), max_tokens=20)
    harness.add("c", list(range(50, 56)), max_tokens=20)  # waits: max_num_seqs is 2
    assert harness.core.make_load() == {"waiting_prefill_tokens": 38, "running_decodes": 0}
    harness.step()  # a: 8 of 20 computed
    assert harness.core.make_load() == {"waiting_prefill_tokens": 30, "running_decodes": 0}
    for _ in range(100):
        if harness.core.make_load()["running_decodes"] == 2:
            break
        harness.step()
    assert harness.core.make_load() == {"waiting_prefill_tokens": 6, "running_decodes": 2}
    harness.run()
    assert harness.core.make_load() == {"waiting_prefill_tokens": 0, "running_decodes": 0}
