"""A fleet that survives its members: two real vLLM servers over one Mooncake L3 behind
`hicache-async route` (Dynamo's indexer hearing both), and vLLM alone for the reference.

- both servers compute the same fresh prompt at once: the store holds its pages once, and
  neither reads the other's half-written object (both answer as vLLM alone does);
- server A is SIGKILLed mid-stream: the router resends to B, which reads A's sessions from
  L3, and every answer equals vLLM alone's;
- A is gone from the indexer once the router sees it dead (the shared pool keeps what L3
  holds), and comes back empty when restarted in place.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("hicache_vllm")
pytest.importorskip("mooncake")
pytest.importorskip("dynamo.llm")

from hicache_async.ports import free_port  # noqa: E402
from hicache_vllm.bench.engine import write_llama, write_tokenizer  # noqa: E402
from hicache_vllm.bench.fleet_figures import (  # noqa: E402
    BLOCK, DEVICE_BLOCKS, HOST_PAGES, LLAMA, MODEL_NAME, FleetServer)
from hicache_vllm.bench.fleet_indexer import Indexer  # noqa: E402
from hicache_vllm.bench.fleet_stream import Shape, complete, play, stream  # noqa: E402
from hicache_vllm.router import POOL, healthy, post  # noqa: E402

SHAPE = Shape(systems=2, system_tokens=256, sessions=5, turns=4, in_flight=2)
KILL_AFTER = 7          # answers before A dies
FRESH = 10 * BLOCK + 8  # the prompt both compute at once: 10 full pages


def _metrics(url: str) -> str:
    return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()


def _sum(text: str, name: str, *labels: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(label in line for label in labels))


def _until(check, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> dict:
    from hicache_mooncake import MooncakeMaster

    root = tmp_path_factory.mktemp("fleet")
    model = write_tokenizer(write_llama(root / "llama", **LLAMA), LLAMA["vocab"])
    out: dict = {}
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster(holder_bytes=256 << 20, log_path=str(root / "mooncake.log")))
        store = f"http://{master.host}:{master.metrics_port}"
        extra = {"storage": "mooncake", "host_pages": HOST_PAGES, "storage_optional": False, "l3_reads": "always",
                 "mooncake_master": master.address, "mooncake_metadata": master.metadata_url}
        ports = [(free_port(), free_port(), free_port()) for _ in range(2)]     # HTTP, events, replay
        ref = stack.enter_context(FleetServer("vllm", model, None, root / "ref", 0, DEVICE_BLOCKS))
        a, b = (stack.enter_context(FleetServer("shared_l3", model, extra, root / f"s{i}", i, DEVICE_BLOCKS,
                                                (ports[i][1], ports[i][2]), port=ports[i][0])) for i in (0, 1))
        indexer = stack.enter_context(Indexer(root / "indexer.log"))
        deadline = time.monotonic() + 400
        for s in (ref, a, b):
            s.wait_ready(deadline)
        front_port = free_port()
        cmd = [str(Path(sys.executable).parent / "hicache-async"), "route", "--indexer", indexer.url,
               "--model", MODEL_NAME, "--block-size", str(BLOCK), "--port", str(front_port)]
        for http, events, replay in ports:
            cmd += ["--server", f"http://127.0.0.1:{http}=tcp://127.0.0.1:{events},tcp://127.0.0.1:{replay}"]
        with open(root / "route.log", "wb") as log:
            front = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(lambda: (front.kill(), front.wait(10)))
        front_url = f"http://127.0.0.1:{front_port}"
        _until(lambda: healthy(front_url) if front.poll() is None else pytest.fail((root / "route.log").read_text()),
               "routing")

        # 1. the same fresh prompt on both servers at once
        rng = random.Random(7)
        fresh = [rng.randrange(3, LLAMA["vocab"]) for _ in range(FRESH)]
        keys0 = _sum(_metrics(store), "master_key_count")
        both: dict = {}
        threads = [threading.Thread(target=lambda s=s: both.update({s.base: complete(s.base, MODEL_NAME, fresh, 4)[1]}))
                   for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(3)           # backups finish
        out["fresh"] = {"answers": list(both.values()), "ref": complete(ref.base, MODEL_NAME, fresh, 4)[1],
                        "keys": _sum(_metrics(store), "master_key_count") - keys0}

        # 2. a stream through the router; A killed mid-way
        turns = stream(SHAPE, seed=1)
        out["ref"] = [x.text for x in play(turns, [ref.base], MODEL_NAME, lambda p: 0, SHAPE)[0]]
        l3_before = _sum(_metrics(b.base), "vllm:hicache_prefix_tokens_total{", 'tier="l3"')
        killed, holder = threading.Event(), {}

        def on_answer(i: int, answer) -> None:
            holder.setdefault("count", 0)
            holder["count"] += 1
            if holder["count"] == KILL_AFTER and not killed.is_set():
                holder["query_before"] = post(f"{indexer.url}/query", {"token_ids": turns[i].prompt,
                                                                       "model_name": MODEL_NAME})["instances"]
                holder["prompt"] = turns[i].prompt
                os.killpg(a.proc.pid, signal.SIGKILL)
                killed.set()

        answers, _ = play(turns, [front_url], MODEL_NAME, lambda p: 0, SHAPE, on_answer)
        out["stream"] = [x.text for x in answers]
        out["killed"] = killed.is_set()
        out["b_l3_tokens"] = _sum(_metrics(b.base), "vllm:hicache_prefix_tokens_total{", 'tier="l3"') - l3_before
        out["stats"] = json.load(urllib.request.urlopen(f"{front_url}/stats", timeout=5))

        # 3. A's entries leave the index; restarted in place, it comes back empty
        _until(lambda: not json.load(urllib.request.urlopen(f"{front_url}/stats", timeout=5))["up"][0], "A down")
        out["query_before"] = holder["query_before"]
        query = {"token_ids": holder["prompt"], "model_name": MODEL_NAME}
        out["query_dead"] = post(f"{indexer.url}/query", query)["instances"]
        a.proc.wait(30)
        a2 = stack.enter_context(FleetServer("shared_l3", model, extra, root / "s0-again", 0, DEVICE_BLOCKS,
                                             (ports[0][1], ports[0][2]), port=ports[0][0]))
        a2.wait_ready(time.monotonic() + 400)
        _until(lambda: json.load(urllib.request.urlopen(f"{front_url}/stats", timeout=5))["up"][0], "A back")
        out["query_back"] = post(f"{indexer.url}/query", query)["instances"]
        out["again"] = complete(a2.base, MODEL_NAME, holder["prompt"], 4)[1]
        out["again_ref"] = complete(ref.base, MODEL_NAME, holder["prompt"], 4)[1]
        out["again_l3"] = _sum(_metrics(a2.base), "vllm:hicache_prefix_tokens_total{", 'tier="l3"')
        for s in (a2, b):
            out.setdefault("rejected", 0)
            out["rejected"] += _sum(_metrics(s.base), "vllm:hicache_l3_rejected_objects_total")
    return out


def test_two_servers_computing_one_prefix_at_once_store_it_once_and_answer_exactly(fleet):
    assert fleet["fresh"]["answers"] == [fleet["fresh"]["ref"]] * 2
    assert fleet["fresh"]["keys"] == FRESH // BLOCK      # one object a page, put once
    assert fleet["rejected"] == 0                          # no half-written object was read


def test_a_server_killed_mid_stream_loses_no_answer_and_its_sessions_come_from_l3(fleet):
    assert fleet["killed"]
    assert fleet["stream"] == fleet["ref"]
    assert fleet["b_l3_tokens"] > 0
    assert fleet["stats"]["up"] == [False, True] and sum(fleet["stats"]["sent"]) >= len(fleet["ref"])


def test_a_dead_servers_entries_leave_the_index_and_it_comes_back_empty(fleet):
    before, dead, back = fleet["query_before"], fleet["query_dead"], fleet["query_back"]
    assert before["1"]["disk"] > 0 or before["2"]["disk"] > 0
    assert "1" not in dead and dead[str(POOL)]["disk"] > 0         # the pool keeps what L3 holds
    assert back.get("1", {}).get("disk", 0) == 0 and back[str(POOL)]["disk"] > 0
    assert fleet["again"] == fleet["again_ref"] and fleet["again_l3"] > 0    # and reads it from L3
