"""KV cache events (`--kv-events-endpoint`) read by a real ZeroMQ subscriber and decoded with vLLM's own
msgspec event types: the replayed BlockStored / BlockRemoved / AllBlocksCleared stream must equal the
server's prefix-cache index (GET /engine/blocks) once the load ends; sequence numbers have no gaps; the
replay socket re-sends what was published; stored tokens are the prompts' tokens."""
import concurrent.futures
import random
import time

import msgspec
import pytest
import zmq

from conftest import MODELS
from server_util import Server, free_port

STORIES = MODELS / "stories260K.gguf"
WORDS = "the cat dog sun tree ball girl boy happy little big red blue park day play ran saw went home".split()


# vLLM's event types up to v0.11 (array_like; what llm-d and Dynamo decode) ...
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ... and vLLM's current layout (maps with a "type" tag).
class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, tag_field="type"):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class MapBatchTyped(MapBatch):
    events: list[MapBlockStored]


class Subscriber:
    def __init__(self, port, topic=b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.messages = []  # (topic, seq, payload)
        time.sleep(0.5)  # PUB/SUB: the subscription must reach the publisher before the first event

    def drain(self, quiet=1.0):
        """Receives until nothing has arrived for `quiet` seconds."""
        while self.sock.poll(int(quiet * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.messages.append((topic, int.from_bytes(seq, "big"), payload))

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def prompts(n, seed=0):
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(3)]
    return [rng.choice(prefixes) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def complete(server, prompt):
    status, body, _ = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200, body


def replay(batches):
    hashes, counts = set(), {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    for batch in batches:
        for e in batch.events:
            counts[type(e).__name__] += 1
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                assert not hashes & set(e.block_hashes), "a hash stored twice without its removal"
                hashes |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= hashes, "removal of a hash never stored"
                hashes -= set(e.block_hashes)
            else:
                hashes.clear()
    return hashes, counts


def cached_hashes(server):
    status, body = server.get("/engine/blocks")
    assert status == 200
    import json
    return {b["hash"] for b in json.loads(body)["cached"]}


@pytest.fixture(scope="module")
def events_server():
    port, replay_port = free_port(), free_port()
    # A small cache (32 blocks of 16 tokens) so the load evicts blocks.
    server = Server(STORIES, "--kv-events-endpoint", f"tcp://*:{port}", "--kv-events-replay-endpoint",
                    f"tcp://*:{replay_port}", "--kv-events-topic", "kv@serval", kv_memory="320KiB")
    sub = Subscriber(port, b"kv@serval")
    yield server, sub, replay_port
    sub.close()
    server.stop()


def test_events_rebuild_the_block_map(events_server):
    server, sub, _ = events_server
    texts = prompts(40)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: complete(server, p), texts))
    sub.drain()
    assert sub.messages, "no events"
    assert all(t == b"kv@serval" for t, _, _ in sub.messages)
    assert [s for _, s, _ in sub.messages] == list(range(len(sub.messages))), "sequence numbers have gaps"
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = [decoder.decode(p) for _, _, p in sub.messages]
    assert all(b.data_parallel_rank == 0 and b.ts > 1.6e9 for b in batches)
    hashes, counts = replay(batches)
    assert counts["BlockStored"] > 0 and counts["BlockRemoved"] > 0, counts  # the small cache evicted
    assert hashes == cached_hashes(server)
    # The first block of a prompt, as stored, is the prompt's first 16 tokens.
    _, tok, _ = server.post("/tokenize", {"prompt": texts[0]})
    firsts = {tuple(e.token_ids[:16]) for b in batches for e in b.events
              if isinstance(e, BlockStored) and e.parent_block_hash is None}
    assert tuple(tok["tokens"][:16]) in firsts
    assert all(e.medium == "CPU" and e.block_size == 16 for b in batches for e in b.events if isinstance(e, BlockStored))


def test_replay_socket_resends_batches(events_server):
    server, sub, replay_port = events_server
    if not sub.messages:
        complete(server, prompts(1, seed=9)[0])
        sub.drain()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    got = []
    while dealer.poll(10000):
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        got.append((int.from_bytes(seq, "big"), payload))
    dealer.close(0)
    ctx.term()
    live = {s: p for _, s, p in sub.messages}
    assert got and got[0][0] == 1
    assert all(live[s] == p for s, p in got if s in live)


def test_reset_prefix_cache_clears_everything(events_server):
    server, sub, _ = events_server
    complete(server, prompts(1, seed=3)[0])
    status, body, _ = server.post("/reset_prefix_cache", {})
    assert status == 200, body
    sub.drain()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    last = decoder.decode(sub.messages[-1][2])
    assert isinstance(last.events[-1], AllBlocksCleared)
    assert cached_hashes(server) == set()


def test_map_encoding_and_vllm_config_flag():
    port = free_port()
    server = Server(STORIES, "--kv-events-config", f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}',
                    "--kv-events-encoding", "map")
    sub = Subscriber(port)
    try:
        complete(server, prompts(1, seed=5)[0])
        sub.drain()
        batches = [msgspec.msgpack.Decoder(MapBatchTyped).decode(p) for _, _, p in sub.messages]
        stored = {h for b in batches for e in b.events for h in e.block_hashes}
        assert stored and stored == cached_hashes(server)
    finally:
        sub.close()
        server.stop()


def test_bad_endpoint_is_a_clear_error():
    import subprocess
    from conftest import SERVAL
    r = subprocess.run([str(SERVAL), "serve", str(STORIES), "--port", "0", "--kv-events-endpoint", "bogus://x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "KV events" in r.stderr and "bogus://x" in r.stderr


def test_bad_config_values_are_clear_errors():
    """--kv-events-config values of the wrong JSON type are refused naming the key (not a JSON library
    exception): a string for the boolean switch, a string for an integer."""
    import subprocess
    from conftest import SERVAL
    for config, message in [('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be a boolean"),
                            ('{"buffer_steps": "10"}', "buffer_steps must be an integer")]:
        r = subprocess.run([str(SERVAL), "serve", str(STORIES), "--port", "0", "--kv-events-config", config],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert message in r.stderr, r.stderr
