"""precise-prefix on the shared gateway, in-process over HTTP: stand-in engines (their /tokenize, and a real
engine-side KV-event publisher each, engine/core/kv_events.py) behind a shared gateway fed InferenceServices and
EndpointSlices as its watches would list them. Each service gets its own index and subscribers, found from the
slices' kv-events ports and torn down with the service; a prompt one namespace's engines cached gives another
namespace's identical request (same model name) no precise hit; a salted request never routes by the index; a pool
whose engines cannot tokenize routes approximately and stops asking; events that stop reset that pool's view."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time

from aiohttp import web

from shoal.engine.config import KVEventsConfig
from shoal.engine.core.kv_events import KVEventPublisher
from shoal.engine.kv_hash import hash_chain
from shoal.operator.contract import KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME, kv_events_topic
from shoal.operator.gateway.proxy import GatewayConfig

from .gwkit import free_port
from .test_admission import Engine, endpoint_slice, shared
from .test_tenancy import auth, keys, service

BOUND = 20.0  # seconds the subscribers get to hear what was published
BLOCK = 16
PREFIX = "a long shared system prompt that both namespaces send, word for word. " * 4


def token_ids(prompt: str) -> list[int]:
    """What the stand-in engines' tokenizer makes of a prompt (a model's own would do as well)."""
    return [ord(c) for c in prompt]


class EventEngine(Engine):
    """A stand-in engine that tokenizes (/tokenize, vLLM's shape, counted), and publishes its KV events as a Shoal
    engine does, under its service's topic."""

    def __init__(self, name: str, namespace: str, served: str = "m", tokenize: bool = True):
        super().__init__(name, served=served, hold=False)
        self.tokenize_calls = 0
        self.can_tokenize = tokenize
        self.server.app.router.add_post("/tokenize", self.tokenize)
        self.events_port, self.replay_port = free_port(), free_port()
        self.publisher = KVEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"tcp://*:{self.events_port}",
            replay_endpoint=f"tcp://*:{self.replay_port}", topic=kv_events_topic("m", namespace)), BLOCK, "CPU")

    async def tokenize(self, request):
        self.tokenize_calls += 1
        if not self.can_tokenize:
            return web.json_response({"error": "not found"}, status=404)
        body = await request.json()
        return web.json_response({"tokens": token_ids(body["prompt"]), "count": len(body["prompt"])})

    def cache(self, prompt: str) -> int:
        """The engine's prefix cache took the prompt's full blocks: its BlockStored, as its block pool sends it."""
        tokens = token_ids(prompt)
        hashes = list(hash_chain(tokens, BLOCK))
        return self.publisher.publish([("BlockStored", hashes, None, tokens[:BLOCK * len(hashes)], None)])

    async def __aexit__(self, *exc):
        self.publisher.close()
        await super().__aexit__(*exc)


def slice_of(namespace: str, engine: EventEngine, i: int, events: bool = True) -> dict:
    """One EndpointSlice per engine (each has ports of its own on 127.0.0.1), naming its KV-event ports as the
    operator's engines Service does when the engines publish."""
    s = endpoint_slice("m-engines", engine.url, namespace=namespace)
    s["metadata"]["name"] += str(i)
    if events:
        s["ports"] += [{"name": KV_EVENTS_PORT_NAME, "port": engine.events_port, "protocol": "TCP"},
                       {"name": KV_REPLAY_PORT_NAME, "port": engine.replay_port, "protocol": "TCP"}]
    return s


def pools(gw) -> dict:
    return {p.namespace: p for p in gw.pools.all()}


async def heard(gw, namespace: str, engine: EventEngine, seq: int | None = None) -> None:
    """Until the pool of `namespace` applied every batch `engine` published (empty batches meanwhile: a PUB socket
    drops what precedes a subscription, and the first batch heard brings the rest by replay)."""
    deadline = time.monotonic() + BOUND
    seq, resend = engine.publisher.publish([]), time.monotonic() + 1.0
    while (view := pools(gw)[namespace].router.kv_index.views.get(engine.url)) is None or view.last_seq != seq:
        assert time.monotonic() < deadline, f"{namespace} never heard {engine.name}'s events"
        if time.monotonic() > resend:
            seq, resend = engine.publisher.publish([]), time.monotonic() + 1.0
        await asyncio.sleep(0.02)


def metric(gw, name: str, **labels) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


def fallbacks(gw, reason: str) -> float:
    return metric(gw, "shoal:gateway_precise_prefix_fallbacks_total", reason=reason)


async def ask(client, key: str, prompt: str, **extra) -> str:
    r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1, **extra},
                          headers=auth(key))
    assert r.status == 200, await r.text()
    return (await r.json())["engine"]


async def test_each_service_has_its_own_index_and_another_namespaces_cache_gives_no_precise_hit(tmp_path):
    async with EventEngine("a1", "team-a") as a1, EventEngine("a2", "team-a") as a2, \
            EventEngine("b1", "team-b") as b1, EventEngine("b2", "team-b") as b2:
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), routing="precise-prefix"),
                                  [service("team-a", "m", "m"), service("team-b", "m", "m")], {})
        gw.pools.slices_reset([slice_of("team-a", a1, 0), slice_of("team-a", a2, 1),
                               slice_of("team-b", b1, 2), slice_of("team-b", b2, 3)])
        try:
            for ns, engines in (("team-a", (a1, a2)), ("team-b", (b1, b2))):
                for e in engines:
                    await heard(gw, ns, e)
            a, b = pools(gw)["team-a"], pools(gw)["team-b"]
            assert a.router.kv_index is not b.router.kv_index  # one index per service, never shared
            assert set(a.router.kv_index.views) == {a1.url, a2.url} and set(b.router.kv_index.views) == {
                b1.url, b2.url}

            # team-a's second engine cached the prefix: team-a's requests repeating it all go there, precisely
            a2.cache(PREFIX + "question 0")
            await heard(gw, "team-a", a2)
            for i in range(1, 5):
                assert await ask(client, "sk-a", f"{PREFIX}question {i}") == "a2"
            assert metric(gw, "shoal:gateway_precise_prefix_hits_total") == 4
            assert a1.tokenize_calls + a2.tokenize_calls == 4 and b1.tokenize_calls + b2.tokenize_calls == 0

            # team-b sends the same prompt to its own `m`: its pool's index holds none of team-a's blocks
            hits = metric(gw, "shoal:gateway_precise_prefix_hits_total")
            assert await ask(client, "sk-b", f"{PREFIX}question 1") in ("b1", "b2")
            assert metric(gw, "shoal:gateway_precise_prefix_hits_total") == hits
            assert b.router.kv_index.matches([b1.url, b2.url], token_ids(f"{PREFIX}question 1")) == {}
            # ...and its own engines' blocks route its own requests precisely
            b1.cache(PREFIX + "question 1")
            await heard(gw, "team-b", b1)
            assert await ask(client, "sk-b", f"{PREFIX}question 2") == "b1"
            assert metric(gw, "shoal:gateway_precise_prefix_hits_total") == hits + 1

            # a salted prompt (vLLM's cache_salt: a tenant's own blocks) is never matched by the index
            salted = metric(gw, "shoal:gateway_precise_prefix_fallbacks_total", reason="cache_salt")
            calls = a1.tokenize_calls + a2.tokenize_calls
            hits = metric(gw, "shoal:gateway_precise_prefix_hits_total")
            await ask(client, "sk-a", f"{PREFIX}question 9", cache_salt="team-a-secret")
            assert metric(gw, "shoal:gateway_precise_prefix_hits_total") == hits
            assert fallbacks(gw, "cache_salt") == salted + 1 and a1.tokenize_calls + a2.tokenize_calls == calls

            # team-a's engine stops publishing (its socket closes): its view is reset, and team-a's requests route
            # approximately again, while team-b keeps its view
            a2.publisher.close()
            deadline = time.monotonic() + BOUND
            while a.router.kv_index.views[a2.url].blocks:
                assert time.monotonic() < deadline, "a2's view outlived its event stream"
                await asyncio.sleep(0.02)
            hits = metric(gw, "shoal:gateway_precise_prefix_hits_total")
            await ask(client, "sk-a", f"{PREFIX}question 7")
            assert metric(gw, "shoal:gateway_precise_prefix_hits_total") == hits
            assert b.router.kv_index.views[b1.url].blocks
        finally:
            await client.close()
            await gw.stop()


async def test_a_deleted_service_takes_its_subscribers_and_sockets_along(tmp_path):
    async with EventEngine("a1", "team-a") as a1, EventEngine("b1", "team-b") as b1:
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), routing="precise-prefix"),
                                  [service("team-a", "m", "m"), service("team-b", "m", "m")], {})
        gw.pools.slices_reset([slice_of("team-a", a1, 0), slice_of("team-b", b1, 1)])
        try:
            await heard(gw, "team-a", a1)
            await heard(gw, "team-b", b1)
            a = pools(gw)["team-a"]
            subscribers = gw._kv_subscribers[a]
            (task,) = subscribers.tasks.values()
            gw.pools.isvc_event("DELETED", service("team-a", "m", "m"))
            assert a not in gw._kv_subscribers and "team-a" not in pools(gw)
            await asyncio.gather(task, return_exceptions=True)  # close() runs as a task of its own
            deadline = time.monotonic() + BOUND
            while not subscribers.ctx.closed:
                assert time.monotonic() < deadline, "the deleted service's ZMQ context was never closed"
                await asyncio.sleep(0.02)
            assert task.done() and not subscribers.tasks and subscribers.sync not in subscribers.backends.listeners
            assert not [t for t in asyncio.all_tasks() if t.get_name() == f"kv-events {a1.url}"]
            # the other namespace's service is untouched, and a service created again gets a fresh index
            await heard(gw, "team-b", b1)
            gw.pools.apply(service("team-a", "m", "m"))
            gw.pools.slices_reset([slice_of("team-a", a1, 0), slice_of("team-b", b1, 1)])
            await heard(gw, "team-a", a1)
            assert gw._kv_subscribers[pools(gw)["team-a"]] is not subscribers
        finally:
            await client.close()
            await gw.stop()


async def test_only_engines_whose_slices_name_kv_event_ports_are_subscribed(tmp_path):
    """A service whose engines do not publish (no kv-events port in its slices: the operator renders none) gets
    no subscriber, and its requests route approximately without a /tokenize round trip."""
    async with EventEngine("a1", "team-a") as a1:
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), routing="precise-prefix"),
                                  [service("team-a", "m", "m")], {})
        gw.pools.slices_reset([slice_of("team-a", a1, 0, events=False)])
        try:
            deadline = time.monotonic() + BOUND
            while not pools(gw)["team-a"].backends.eligible():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert not gw._kv_subscribers[pools(gw)["team-a"]].tasks
            assert await ask(client, "sk-a", PREFIX) == "a1"
            assert a1.tokenize_calls == 0 and fallbacks(gw, "no_events") == 1
            gw.pools.slices_reset([slice_of("team-a", a1, 0)])  # now it publishes: followed from here on
            await heard(gw, "team-a", a1)
        finally:
            await client.close()
            await gw.stop()


async def test_a_pool_whose_engines_cannot_tokenize_routes_approximately_and_stops_asking(tmp_path):
    async with EventEngine("a1", "team-a", tokenize=False) as a1, EventEngine("b1", "team-b") as b1:
        config = GatewayConfig(tenant_keys=keys(tmp_path), routing="precise-prefix", tokenize_backoff=1e9)
        gw, client = await shared(config, [service("team-a", "m", "m"), service("team-b", "m", "m")], {})
        gw.pools.slices_reset([slice_of("team-a", a1, 0), slice_of("team-b", b1, 1)])
        try:
            a1.cache(PREFIX)
            b1.cache(PREFIX)
            await heard(gw, "team-a", a1)
            await heard(gw, "team-b", b1)
            for _ in range(3):
                assert await ask(client, "sk-a", PREFIX + "again") == "a1"
            assert a1.tokenize_calls == 1  # asked once; then the pool routes approximately for the backoff
            assert (fallbacks(gw, "tokenize_failed"), fallbacks(gw, "tokenizer_unavailable")) == (1, 2)
            assert metric(gw, "shoal:gateway_precise_prefix_hits_total") == 0
            assert await ask(client, "sk-b", PREFIX + "again") == "b1"  # another pool's engines tokenize
            assert b1.tokenize_calls == 1 and metric(gw, "shoal:gateway_precise_prefix_hits_total") == 1
            gw.config.tokenize_backoff = 0.0  # the backoff over: asked again, and precise once they answer
            gw._tokenize_down[pools(gw)["team-a"]] = 0.0
            a1.can_tokenize = True
            assert await ask(client, "sk-a", PREFIX + "again") == "a1"
            assert a1.tokenize_calls == 2 and metric(gw, "shoal:gateway_precise_prefix_hits_total") == 2
        finally:
            await client.close()
            await gw.stop()


async def test_a_subscriber_takes_its_own_topic_only_not_every_topic_it_prefixes():
    """ZMQ's subscription filter is a prefix: the subscriber of kv@team-a/m would also receive kv@team-a/m2's
    batches from an address a pod of service m2 now holds. It applies exactly its own topic's."""
    import time as clock

    import zmq

    from shoal.operator.gateway.backends import BackendSet
    from shoal.operator.gateway.kv_index import KVIndex
    from shoal.operator.gateway.kv_subscriber import KVSubscribers

    url, port = f"http://127.0.0.1:{free_port()}", free_port()
    ours, theirs = kv_events_topic("m", "team-a"), kv_events_topic("m2", "team-a")
    assert theirs.startswith(ours)
    encoder = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"), BLOCK, "CPU")
    mine, other = token_ids(PREFIX), token_ids("another service's prompt, cached over there. " * 3)

    def batch(tokens: list[int]) -> bytes:
        hashes = list(hash_chain(tokens, BLOCK))
        return encoder.encode(clock.time(), [("BlockStored", hashes, None, tokens[:BLOCK * len(hashes)], None)], {})

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    backends, index = BackendSet(), KVIndex()
    backends.replace({url})
    subs = KVSubscribers(backends, index, None, None, ours, ports={url: (port, None)})
    subs.start()
    try:
        deadline = time.monotonic() + BOUND
        while (view := index.views.get(url)) is None or view.last_seq < 1:
            assert time.monotonic() < deadline, "the subscriber never applied its own topic's batch"
            # the other service's batch first, as seq 0; ours as seq 1: taken, the other's would stay indexed
            pub.send_multipart((theirs.encode(), (0).to_bytes(8, "big"), batch(other)))
            pub.send_multipart((ours.encode(), (1).to_bytes(8, "big"), batch(mine)))
            await asyncio.sleep(0.05)
        assert index.matches([url], mine) == {url: len(mine) // BLOCK}
        assert index.matches([url], other) == {}
    finally:
        await subs.close()
        encoder.close()
        pub.close(linger=0)
        ctx.term()


class ImageEngine(EventEngine):
    """A stand-in vision-language engine: /tokenize renders a chat as its characters' codes with each image's part
    expanded to 10 image tokens, and answers each image's placement and digest (here the sha256 of its URL, where a
    Shoal engine's is of the pixel values its processor makes) as a Shoal engine does; its KV events are its real
    block pool's (engine/core/kv_cache.py), image blocks with their digests."""

    IMAGE = [1] * 10

    def __init__(self, name: str, namespace: str):
        super().__init__(name, namespace)
        self.server.app.router.add_post("/v1/chat/completions", self.complete)

    @classmethod
    def render(cls, messages: list[dict]) -> tuple[list[int], list[tuple[int, int, bytes]]]:
        tokens, images = [], []
        for m in messages:
            for part in m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]:
                if part["type"] == "image_url":
                    url = part["image_url"]["url"]
                    images.append((len(tokens), len(cls.IMAGE), hashlib.sha256(url.encode()).digest()))
                    tokens += cls.IMAGE
                else:
                    tokens += token_ids(part["text"])
        return tokens, images

    @classmethod
    def render_prompt(cls, prompt: str, urls: list[str]) -> tuple[list[int], list[tuple[int, int, bytes]]]:
        """A completion's prompt with "<image>" placeholders filled, in order, by multi_modal_data's images."""
        parts = prompt.split("<image>")
        assert len(parts) == len(urls) + 1
        content = [{"type": "text", "text": parts[0]}]
        for url, text in zip(urls, parts[1:]):
            content += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        return cls.render([{"role": "user", "content": content}])

    async def tokenize(self, request):
        self.tokenize_calls += 1
        body = await request.json()
        if "prompt" in body:
            urls = [i["url"] for i in (body.get("multi_modal_data") or {}).get("image", [])]
            tokens, images = self.render_prompt(body["prompt"], urls)
        else:
            tokens, images = self.render(body["messages"])
        return web.json_response({"tokens": tokens, "count": len(tokens), "images": [
            {"offset": o, "length": n, "digest": d.hex()} for o, n, d in images]})

    def cache_chat(self, messages: list[dict]) -> int:
        from shoal.engine.core.images import ProcessedImage, PromptImages
        from shoal.engine.core.kv_cache import BlockPool

        tokens, images = self.render(messages)
        pool = BlockPool(64, BLOCK, events=True)
        placed = PromptImages([(o, ProcessedImage(None, n, d)) for o, n, d in images], BLOCK)
        ids, chain = pool.allocate(len(tokens) // BLOCK + 1), []
        pool.cache_full_blocks(tokens, ids, chain, len(tokens), None, placed.block_key)
        return self.publisher.publish(pool.take_events())


IMAGE_X, IMAGE_Y = "data:image/png;base64,eA==", "data:image/png;base64,eQ=="


def image_turn(image: str, *more: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": PREFIX},
                                         {"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "what is in this picture? " * 2}]}, *more]


@contextlib.asynccontextmanager
async def image_fleet(tmp_path):
    """A shared gateway over two image engines: a1 holds a turn about image X, a2 the same words about image Y."""
    async with ImageEngine("a1", "team-a") as a1, ImageEngine("a2", "team-a") as a2:
        gw, client = await shared(GatewayConfig(tenant_keys=keys(tmp_path), routing="precise-prefix"),
                                  [service("team-a", "m", "m")], {})
        gw.pools.slices_reset([slice_of("team-a", a1, 0), slice_of("team-a", a2, 1)])
        try:
            a1.cache_chat(image_turn(IMAGE_X))
            a2.cache_chat(image_turn(IMAGE_Y))
            await heard(gw, "team-a", a1)
            await heard(gw, "team-a", a2)
            yield gw, client, a1, a2
        finally:
            await client.close()
            await gw.stop()


async def test_a_conversation_about_an_image_routes_to_the_engine_holding_that_images_blocks(tmp_path):
    # each image's next turn goes to its engine (the text before the image alone would tie), through the engines'
    # /tokenize and the pool's index
    async with image_fleet(tmp_path) as (gw, client, a1, a2):
        index = pools(gw)["team-a"].router.kv_index
        tokens, _images = ImageEngine.render(image_turn(IMAGE_X))
        full, text = len(tokens) // BLOCK, len(token_ids(PREFIX)) // BLOCK
        assert index.matches([a1.url, a2.url], tokens) == {a1.url: text, a2.url: text}  # text only: a tie
        for image, engine in ((IMAGE_X, "a1"), (IMAGE_Y, "a2"), (IMAGE_X, "a1"), (IMAGE_Y, "a2")):
            more = [{"role": "assistant", "content": "a picture."}, {"role": "user", "content": "and then?"}]
            hits = metric(gw, "shoal:gateway_precise_prefix_matched_blocks_total")
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": image_turn(image, *more),
                                                               "max_tokens": 1}, headers=auth("sk-a"))
            assert r.status == 200, await r.text()
            assert (await r.json())["engine"] == engine
            assert metric(gw, "shoal:gateway_precise_prefix_matched_blocks_total") == hits + full


async def test_a_completion_with_images_routes_by_its_images_like_a_chat(tmp_path):
    # the same words about images X and Y on /v1/completions (multi_modal_data): the gateway asks an engine's
    # /tokenize for the image placements, so each prompt goes to the engine holding its image's blocks
    prompt = PREFIX + "<image>" + "what is in this picture? " * 2
    async with image_fleet(tmp_path) as (gw, client, a1, a2):
        tokens, _ = ImageEngine.render_prompt(prompt, [IMAGE_X])
        full = len(tokens) // BLOCK
        for image, engine in ((IMAGE_Y, "a2"), (IMAGE_X, "a1"), (IMAGE_Y, "a2")):
            hits = metric(gw, "shoal:gateway_precise_prefix_matched_blocks_total")
            calls = a1.tokenize_calls + a2.tokenize_calls
            r = await client.post("/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 1,
                "multi_modal_data": {"image": [{"url": image}]}}, headers=auth("sk-a"))
            assert r.status == 200, await r.text()
            assert (await r.json())["engine"] == engine
            assert a1.tokenize_calls + a2.tokenize_calls == calls + 1
            assert metric(gw, "shoal:gateway_precise_prefix_matched_blocks_total") == hits + full
