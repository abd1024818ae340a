"""`kvtier router --workers A,B,C --policy cache_aware` in front of three `kvtier serve` processes
(CPU): each conversation's later turns go where its earlier turns' blocks are (device-tier hits,
as each server's usage reports them), new conversations spread over the instances, a killed
instance leaves the rotation and its conversations go on elsewhere; the index resynchronizes
from a snapshot after lost events. The routing policies themselves: tests/cache/test_route.py."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from kvtier.serve.backend import Backend
from kvtier.serve.route import PrefixIndex
from kvtier.serve.workers import CacheView

ENGINE = [
    "--served-model-name",
    "m",
    "--num-device-blocks",
    "96",
    "--block-size",
    "8",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "4",
]


@pytest.fixture(scope="module")
def fleet(procs, checkpoint):
    model = checkpoint("llama-tiny")
    workers = [procs(["serve", model, *ENGINE], f"worker{i}") for i in range(3)]
    for w in workers:
        w.wait_ready()
    router = procs(
        ["router", "--workers", ",".join(w.url for w in workers), "--policy", "cache_aware", "--expose-config"], "router"
    )
    return workers, router.wait_ready()


def complete(url: str, prompt: list[int], max_tokens: int = 6) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": "m",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def routed(router) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(r'^kvtier_router_routed_total\{instance="([^"]+)"\} (\S+)$', text, re.M)}


@pytest.mark.slow  # four servers (~40 s on 2 cores): CI runs it with -m slow
def test_turns_go_where_their_prefix_is_and_a_killed_instance_leaves(fleet):
    workers, router = fleet
    rng = random.Random(0)
    convs = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(5)]  # (5: round robin would scatter turns)
    before = routed(router)
    for turn in range(3):
        for c, prompt in enumerate(convs):
            out = complete(router.url, prompt)
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn:  # the whole earlier history (full blocks) was a device hit where it went
                assert cached >= (len(prompt) - 6 - 12) // 8 * 8, (turn, c, out["usage"])
                assert out["usage"]["kvtier"]["cached_tokens_by_tier"]["device"] == cached
            answer = out["choices"][0]["token_ids"]
            convs[c] = prompt + answer + [rng.randrange(3, 250) for _ in range(12)]
    after = routed(router)
    spread = {u: after.get(u, 0) - before.get(u, 0) for u in after}
    assert sum(spread.values()) == 15 and sum(1 for n in spread.values() if n > 0) >= 2, spread

    # one instance dies: the router notices on its own (its polls of the instance fail), before
    # any request is sent there, and stops sending to it; every request answers. (60 s only
    # bounds a router that never notices: how soon it does is not this test's to say)
    victim = workers[0]
    victim.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(router.url + "/health", timeout=5).json()
        assert "decode_up" not in health and "prefill_up" not in health  # workers, not P and D
        up = health["workers_up"]
        if victim.url not in up:
            break
        time.sleep(0.1)
    assert victim.url not in up and len(up) == 2
    for prompt in convs:
        complete(router.url, prompt)
    assert routed(router).get(victim.url, 0) == after.get(victim.url, 0)


def test_lost_events_are_recovered_from_a_snapshot():
    """A poll answered with a gap drops the index; the next takes a snapshot (counted)."""
    answers = iter(
        [
            {"seq": 2, "device": ["aa"], "host": [], "block_size": 8, "hash": "sha256", "fingerprint": ""},
            {"seq": 3, "events": [[3, "stored", "device", "bb"]]},
            {"seq": 9, "gap": True},
            {"seq": 9, "device": ["cc"], "host": ["dd"], "block_size": 8, "hash": "sha256", "fingerprint": ""},
        ]
    )
    paths = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":  # asked once, after the first snapshot: the model's directory and context
            return httpx.Response(200, json={"data": [{"id": "m", "root": "/m", "max_model_len": 512}]})
        paths.append(req.url.path + ("?" + req.url.query.decode() if req.url.query else ""))
        return httpx.Response(200, json=next(answers))

    async def run() -> PrefixIndex:
        view, b = CacheView(), Backend("http://w.test", "worker")
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for _ in range(2):
                await view.poll(client, b)
            assert b.index.device == {b"\xaa", b"\xbb"} and b.seq == 3
            await view.poll(client, b)  # the gap
            assert b.seq is None  # out of step: routed by load until the snapshot
            await view.poll(client, b)
        assert view.resyncs == 1 and b.seq == 9
        return b.index

    index = asyncio.run(run())
    assert index.device == {b"\xcc"} and index.host == {b"\xdd"}
    assert paths == [
        "/kvtier/kv_events/snapshot",
        "/kvtier/kv_events?since=2",
        "/kvtier/kv_events?since=3",
        "/kvtier/kv_events/snapshot",
    ]


def test_a_stalled_instance_leaves_the_rotation_with_its_index_and_comes_back_when_it_answers():
    """A poll past the timeout (a busy engine answers between steps) takes the instance out of
    the rotation but keeps its index: its next answer brings it back with the events it missed,
    no snapshot. One that cannot be reached is down: its index is dropped."""
    from kvtier.serve.router import Router

    answers = iter(
        [
            {"seq": 2, "device": ["aa"], "host": [], "block_size": 8, "hash": "sha256", "fingerprint": ""},
            httpx.ReadTimeout("slow"),
            {"seq": 3, "events": [[3, "stored", "device", "bb"]]},
            httpx.ConnectError("refused"),
        ]
    )
    paths = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":  # asked once, after the first snapshot
            return httpx.Response(200, json={"data": [{"id": "m", "root": "/m", "max_model_len": 512}]})
        paths.append(req.url.path + ("?" + req.url.query.decode() if req.url.query else ""))
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return httpx.Response(200, json=got)

    router = Router([], ["http://w0.test", "http://w1.test"], policy="cache_aware")
    b, other = router.decode

    async def run() -> None:
        view = CacheView()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await view.poll(client, b)
            await view.poll(client, b)  # no answer in time
            assert b.stalled and b.healthy and not b.up
            assert b.index.device == {b"\xaa"} and b.seq == 2  # kept
            assert [c.url for c in router.decode if c.up] == [other.url]
            other.healthy = False  # (every other one down: a stalled one still takes requests)
            chosen = await router.choose("completion", {"prompt": [1, 2, 3]}, set())
            assert chosen is not None and chosen[0] is b
            await view.poll(client, b)  # it answers: back, with the events it missed
            assert b.up and b.index.device == {b"\xaa", b"\xbb"} and b.seq == 3
            await view.poll(client, b)  # unreachable: down, its index dropped
            assert not b.healthy and b.seq is None and not b.index.device

    asyncio.run(run())
    assert paths == [
        "/kvtier/kv_events/snapshot",
        "/kvtier/kv_events?since=2",
        "/kvtier/kv_events?since=2",
        "/kvtier/kv_events?since=3",
    ]


def test_the_pool_the_instances_share_counts_past_what_each_holds():
    """kvtier router --storage: the router asks the pool how many of a prompt's leading blocks it
    holds (the names the instances write: the same keys, cache/keys.py); an instance holding the
    first block gets the pool's rest as storage hits; a pool that fails counts nothing."""
    from kvtier.cache.keys import BlockHasher, encoded_seed, object_name
    from kvtier.storage import StorageClient
    from kvtier.storage.memory import MemoryBackend

    prompt = list(range(100, 132))  # 4 blocks of 8
    keys = BlockHasher(8, encoded_seed(b"", None, "sha256"), "sha256").extend(prompt)
    backend = MemoryBackend()
    assert all(backend.put_from([object_name(k) for k in keys[:3]], [memoryview(b"x")] * 3))
    b = Backend("http://w.test", "worker")
    b.seq, b.keying = 0, (8, "sha256", b"")
    b.index.apply("stored", "device", keys[0])

    def score(pool):
        view = CacheView()
        if pool is not None:  # (the router opens its clients from --storage; here one in process)
            view.storage, view.pools[1] = "memory://", pool
        cands, _, n = asyncio.run(view.candidates([b], "completion", {"prompt": prompt}))
        return cands[0], n

    c, n = score(StorageClient(backend))
    assert (c.device_hit, c.host_hit, c.storage_hit, n) == (8, 0, 16, 32)
    assert score(None)[0].storage_hit == 0

    class Dead(MemoryBackend):
        def exists(self, names):
            raise ConnectionError("the pool is down")

    assert score(StorageClient(Dead()))[0].storage_hit == 0
    # an instance of two tensor-parallel ranks: a block is there when both ranks' objects are
    b.storage_shards = 2
    two = StorageClient(backend)
    two.shard(0, 2)
    assert score(two)[0].storage_hit == 0  # (only unsharded names stored)
    view = CacheView()
    view.storage, view.pools[2] = "memory://", two
    assert all(backend.put_from([object_name(k, tp_rank=r, tp_size=2) for k in keys[:2] for r in (0, 1)], [memoryview(b"x")] * 4))
    assert asyncio.run(view.candidates([b], "completion", {"prompt": prompt}))[0][0].storage_hit == 8


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_a_pd_router_sends_a_prompt_to_the_prefill_server_that_holds_its_prefix(policy):
    """Several --prefill servers: under cache_aware the P whose tiers hold the prompt's prefix
    prefills it (what it holds it does not compute), each time; round robin takes them in turn."""
    from kvtier.cache.keys import BlockHasher, encoded_seed
    from kvtier.serve.router import Router

    prompt = list(range(100, 132))
    keys = BlockHasher(8, encoded_seed(b"", None, "sha256"), "sha256").extend(prompt)
    router = Router(["http://p0.test", "http://p1.test"], ["http://d.test"], policy=policy)
    for b in router.prefill + router.decode:
        b.seq, b.keying = 0, (8, "sha256", b"")
    for k in keys[:3]:
        router.prefill[1].index.apply("stored", "device", k)

    async def chosen() -> list[tuple[str, int]]:
        got = []
        for _ in range(4):
            one = await router.choose("completion", {"prompt": prompt}, set(), "prefill")
            assert one is not None
            got.append((one[0].url, one[1]))
        return got

    got = asyncio.run(chosen())
    want = ["http://p1.test"] * 4 if policy == "cache_aware" else ["http://p0.test", "http://p1.test"] * 2
    assert [url for url, _ in got] == want
    # the prompt tokens the chosen one holds, not its work (the load the router counts): three
    # blocks, then the whole prompt (a prompt just sent counts as held there)
    assert [cached for _, cached in got] == ([24, 32, 32, 32] if policy == "cache_aware" else [0] * 4)


def test_an_instances_load_is_the_work_it_was_sent():
    """A request weighs its prompt and max_tokens less what the instance holds of the prompt:
    a long conversation that is mostly a hit must not weigh as if it were recomputed, or the
    balance rule moves it away from its blocks."""
    from kvtier.serve.router import request_load

    body = {"prompt": list(range(1000)), "max_tokens": 16}
    assert request_load(body, 0) == 1016
    assert request_load(body, 992) == 24
    assert request_load(body, 1200) == 16  # (a text prompt's estimate under what is held: its answer still counts)
    assert request_load({"prompt": "x" * 400}, 0) == 100 + 16  # (text: characters / 4; max_tokens 16)
