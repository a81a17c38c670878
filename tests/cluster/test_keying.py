"""cluster/keying.py and cluster/held_keys.py: the ingress keys a request's prompt exactly as the replica that serves
it will (same ids, same chain and content keys, from the replica's recipe), and a replica reports the keys its fast
tiers hold as they are stored, moved and evicted."""
from __future__ import annotations

import json
import pickle

import pytest

from kvboost import KVBoost
from kvboost.cluster.held_keys import HeldKeys
from kvboost.cluster.keying import Recipe, RequestKeying
from kvboost.cluster.routing import RequestKeys, short_key

from ..tiny_models import make_tiny_model

SYSTEM = "You answer questions about the solar system in one short sentence. " * 4
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How far is Mars?"}]


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)


@pytest.fixture(scope="module")
def keying(engine) -> RequestKeying:
    return RequestKeying(pickle.loads(pickle.dumps(Recipe.of(engine))))  # as Ray ships it to the ingress


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_chat_keys_are_the_engines_keys(engine, keying):
    keys = keying.keys("/v1/chat/completions", _body(model="m", messages=CHAT, cache_salt="tenant-a"))
    ids = engine.encode(messages=CHAT)
    assert keys == RequestKeys.of(engine.chunker, ids, "tenant-a")
    assert len(keys.chains) == len(ids) // 16 > 2


def test_text_parts_completions_and_responses_key_like_their_prompts(engine, keying):
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": "How far"}, {"type": "text",
                                                                                         "text": "is Mars?"}]}]
    joined = [CHAT[0], {"role": "user", "content": "How far\nis Mars?"}]
    assert keying.keys("/v1/chat/completions", _body(messages=parts)) == \
        RequestKeys.of(engine.chunker, engine.encode(messages=joined))
    assert keying.keys("/v1/completions", _body(prompt=SYSTEM)) == RequestKeys.of(engine.chunker,
                                                                                  engine.encode(SYSTEM))
    responses = keying.keys("/v1/responses", _body(instructions=SYSTEM, input="How far is Mars?",
                                                   content_reuse=True))
    assert responses == RequestKeys.of(engine.chunker, engine.encode(messages=CHAT), content_reuse=True)


@pytest.mark.parametrize("path, body", [
    ("/v1/models", b""),
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", _body(messages="not a list")),
    ("/v1/chat/completions", _body(messages=[{"role": "user", "content": 3}])),
    ("/v1/completions", _body(prompt=[1, 2, 3])),
    ("/v1/responses", _body(input="Hi", previous_response_id="resp_1")),  # routed by pin, not keys
])
def test_what_cannot_be_keyed_is_routed_by_load(keying, path, body):
    assert keying.keys(path, body) is None


def test_held_keys_follow_the_store(engine):
    told = []
    held = HeldKeys(also=lambda kind, meta, medium: told.append((kind, medium)))
    engine.clear_cache()
    engine.store.watch(held, "CPU")
    try:
        ids = engine.encode(messages=CHAT)
        engine.warm(messages=CHAT)
        expected = RequestKeys.of(engine.chunker, ids)
        report = held.report()
        assert set(expected.chains) <= set(report["chains"]) and set(expected.contents) <= set(report["contents"])
        assert ("stored", "CPU") in told
        engine.clear_cache()
        assert held.report() == {"chains": [], "contents": []}
    finally:
        engine.store.watch(None, "")
    assert all(len(k) == len(short_key("0" * 40)) for k in expected.chains)
