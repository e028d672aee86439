"""`hicache-async route`'s scoring and its shared-pool form, against Dynamo's real standalone
indexer fed vLLM's own event classes over ZMQ (as a vLLM server publishes them)."""
import time

import pytest

from hicache_async.app.cli import main
from hicache_vllm.router import POOL, Member, Router

BLOCK = 4


@pytest.mark.parametrize("argv, message", [
    (["route", "--indexer", "http://i", "--model", "m", "--block-size", "4"], "--server"),
    (["route", "--server", "localhost:8000", "--indexer", "http://i", "--model", "m", "--block-size", "4"],
     "expected URL=tcp://HOST:PORT"),
    (["route", "--server", "http://a:1=tcp://a:2", "--indexer", "http://i", "--model", "m", "--block-size", "0"],
     "--block-size must be positive"),
])
def test_a_bad_flag_is_exit_2_with_one_line_naming_it(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def _router(found: dict, n: int = 2) -> Router:
    router = Router([Member(f"http://s{i}", f"tcp://s{i}:1") for i in range(n)], "http://indexer", "m", BLOCK)
    router.overlap = lambda tokens: found
    return router


def test_credit_is_by_tier_beyond_the_better_tiers_with_the_shared_pool_credited_to_all():
    # server 1: 2 blocks on device, 1 more in host; server 2: 3 blocks of its own L3; the pool: 5
    found = {1: {"gpu": 8, "cpu": 12, "disk": 12}, 2: {"gpu": 0, "cpu": 0, "disk": 12}, POOL: {"disk": 20}}
    router = _router(found)
    # server 2's own L3 is the shared pool: its 3 blocks there count as the pool's, 0.5 each
    assert router.credits([]) == [2 * 1.0 + 0.75 + 2 * 0.5, 3 * 0.5 + 2 * 0.5]
    private = _router(found)
    private.shared_pool = False
    assert private.credits([]) == [2 * 1.0 + 0.75, 3 * 0.25]
    assert router.route([]).server == 0 and router.sent == [1, 0]


def test_load_is_the_work_in_flight_so_a_session_leaves_a_busy_server_and_comes_back_once_it_is_answered():
    router = _router({1: {"gpu": 40, "cpu": 40, "disk": 40}, POOL: {"disk": 40}})     # 10 blocks, 5 beyond 2's
    prompt = [7] * 12 * BLOCK
    tickets = [router.route(prompt) for _ in range(3)]
    # server 1 computes 2 of the 12 blocks (+4 of load) and leads by 5: the second request finds
    # it 6 blocks busy and goes to server 2 (7 + 4 in flight there), the third back to server 1
    assert [t.server for t in tickets] == [0, 1, 0] and router.queued == [12, 11]
    for t in tickets:
        router.done(t)
    assert router.queued == [0, 0] and router.route(prompt).server == 0 and router.sent == [3, 1]


def test_a_server_that_is_down_is_never_picked():
    router = _router({1: {"gpu": 40, "cpu": 40, "disk": 40}})
    router.members[0].up = False
    assert router.credits([])[0] is None and router.route([]).server == 1


def test_the_shared_pool_is_the_union_of_every_servers_l3_announcements_and_outlives_a_server(tmp_path):
    pytest.importorskip("dynamo.llm")
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from hicache_vllm.bench.fleet_indexer import Indexer
    from hicache_async.ports import free_port

    def stored(h, parent, tokens, medium):
        return kv_events.BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                                     lora_id=None, medium=medium, lora_name=None, extra_keys=None)

    tokens = list(range(10, 26))        # four blocks
    ports = [free_port(), free_port()]
    publishers = [kv_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{p}") for p in ports]
    try:
        with Indexer(tmp_path / "indexer.log") as indexer:
            router = Router([Member(f"http://s{i}", f"tcp://127.0.0.1:{p}") for i, p in enumerate(ports)],
                            indexer.url, "m", BLOCK)
            router.register()
            time.sleep(1.5)             # ZMQ drops what is published before the subscriber joins
            # server 1 computed and stored blocks 0-1; server 2 continued the prompt: blocks 2-3 in L3
            publishers[0].publish(kv_events.KVEventBatch(ts=time.time(), events=[
                stored(101, None, tokens[:4], "GPU"), stored(102, 101, tokens[4:8], "GPU"),
                stored(101, None, tokens[:4], "STORAGE"), stored(102, 101, tokens[4:8], "STORAGE")]))
            publishers[1].publish(kv_events.KVEventBatch(ts=time.time(), events=[
                stored(103, 102, tokens[8:12], "STORAGE"), stored(104, 103, tokens[12:], "STORAGE")]))
            deadline = time.monotonic() + 30     # till the indexer has both servers' events
            while router.overlap(tokens).get(POOL, {}).get("disk", 0) < 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            found = router.overlap(tokens)
            assert found[1]["gpu"] == found[1]["disk"] == 8
            assert found.get(2, {}).get("disk", 0) == 0        # its chain starts on server 1's pages
            assert found[POOL]["disk"] == 16                    # the pool holds the whole chain
            assert router.credits(tokens) == [2 * 1.0 + 2 * 0.5, 4 * 0.5]
            router.down(0)
            found = router.overlap(tokens)
            assert 1 not in found and found[POOL]["disk"] == 16     # L3 outlives the server
            assert router.route(tokens).server == 1
    finally:
        for p in publishers:
            p.shutdown()
