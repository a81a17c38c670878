"""The real openai SDK against a live server: chat, streaming, completions, models, sampling semantics."""
from __future__ import annotations

import json

import pytest

from ..prompts import text_with_tokens, words
from .conftest import TINY_NAME, live_server


@pytest.fixture(scope="module", params=["batched", "single"])
def live(request, tiny_engine, tiny_model_dir):
    """Each test runs on the continuous-batching worker and on the one-request-at-a-time worker."""
    size = 16 if request.param == "batched" else 1
    with live_server(tiny_engine, model=str(tiny_model_dir), max_batch_size=size) as srv:
        yield srv


@pytest.fixture
def sdk(live):
    return live.client()


def _messages(seed: int, n_words: int = 30) -> list[dict]:
    return [{"role": "system", "content": "You are terse. " + words(n_words, seed)},
            {"role": "user", "content": f"question {seed}: " + words(6, seed + 100)}]


def test_chat_completion_greedy_matches_the_library(sdk, live, tiny_engine):
    msgs = _messages(1)
    r = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == TINY_NAME and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content  # temperature 0 is greedy, not an empty divide-by-zero sample
    assert choice.finish_reason in ("length", "stop")
    expected = tiny_engine.generate(messages=msgs, max_new_tokens=8)
    assert choice.message.content == expected.output_text
    assert r.usage.prompt_tokens == expected.prompt_tokens
    assert r.usage.completion_tokens == expected.generated_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_role_deltas_finish_usage_done(sdk):
    msgs = _messages(2)
    full = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=10, temperature=0)
    chunks = list(sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again: its K/V is reused, and usage says so the way OpenAI does.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_stream_deltas_carry_only_what_they_set(live):
    """On the wire, as OpenAI streams: the role chunk, content-only deltas, then a final chunk whose delta is
    {} beside the finish_reason (never role/content null, which naive clients print as "None")."""
    body = {"model": TINY_NAME, "messages": _messages(9), "max_tokens": 5, "temperature": 0, "stream": True}
    with live.http() as http:
        raw = http.post("/v1/chat/completions", json=body).text
    events = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} and d["content"] for d in deltas[1:-1])
    final = chunks[-1]["choices"][0]
    assert final["delta"] == {} and final["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_the_sdk_reads_the_empty_final_delta(sdk):
    chunks = list(sdk.chat.completions.create(model=TINY_NAME, messages=_messages(9), max_tokens=5,
                                              temperature=0, stream=True))
    last = chunks[-1].choices[0]
    assert last.finish_reason in ("length", "stop") and last.delta.content is None and last.delta.role is None


def test_stream_without_include_usage_has_no_usage_chunk(sdk):
    chunks = list(sdk.chat.completions.create(model=TINY_NAME, messages=_messages(3), max_tokens=4, temperature=0,
                                              stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_cached_tokens_reported_for_a_shared_system_prompt(sdk, tiny_engine):
    system = {"role": "system", "content": text_with_tokens(tiny_engine.tokenizer, 120, seed=4)}
    first = sdk.chat.completions.create(model=TINY_NAME, max_tokens=2, temperature=0,
                                        messages=[system, {"role": "user", "content": "first question"}])
    second = sdk.chat.completions.create(model=TINY_NAME, max_tokens=2, temperature=0,
                                         messages=[system, {"role": "user", "content": "another one"}])
    assert first.usage.prompt_tokens > 120
    assert second.usage.prompt_tokens_details.cached_tokens >= 96  # six 16-token chunks of the system prompt


def test_text_completion_and_its_stream(sdk, tiny_engine):
    prompt = words(20, seed=5)
    r = sdk.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.choices[0].text == tiny_engine.generate(prompt, 6).output_text
    chunks = list(sdk.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_token_id_prompts_give_the_same_completion_as_their_text(sdk, tiny_engine):
    prompt = words(20, seed=7)
    ids = tiny_engine.encode(prompt)
    by_text = sdk.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=6, temperature=0)
    for token_prompt in (ids, [ids]):  # OpenAI accepts one id list or a batch of one
        r = sdk.completions.create(model=TINY_NAME, prompt=token_prompt, max_tokens=6, temperature=0)
        assert r.choices[0].text == by_text.choices[0].text
        assert r.usage.prompt_tokens == len(ids)


def test_completions_default_to_16_tokens(sdk):
    r = sdk.completions.create(model=TINY_NAME, prompt=words(10, seed=6), temperature=0)
    assert r.usage.completion_tokens <= 16
    assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == 16


def test_seeded_sampling_is_reproducible_and_default_temperature_samples(sdk):
    msgs = _messages(7)
    a = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=12, temperature=1.0, seed=123)
    b = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=12, temperature=1.0, seed=123)
    assert a.choices[0].message.content == b.choices[0].message.content
    # temperature omitted means 1.0, as with OpenAI: random text from a random model differs from greedy.
    greedy = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=12, temperature=0)
    sampled = {sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=12, seed=s
                                           ).choices[0].message.content for s in (1, 2, 3)}
    assert sampled != {greedy.choices[0].message.content}


def test_penalties_and_logit_bias_are_honoured_as_in_the_library(sdk, tiny_engine):
    """frequency/presence penalties and logit_bias (OpenAI's), repetition_penalty (extra_body): the server's reply
    is the library's, on the batching and the single worker, streamed or not, for each of n choices."""
    msgs = _messages(11)
    options = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "logit_bias": {"28": 3.5}}
    expected = tiny_engine.generate(messages=msgs, max_new_tokens=12, repetition_penalty=1.3,
                                    **{**options, "logit_bias": {28: 3.5}})
    plain = tiny_engine.generate(messages=msgs, max_new_tokens=12)
    assert expected.output_token_ids != plain.output_token_ids  # the options change this reply
    r = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=12, temperature=0, n=2,
                                    extra_body={"repetition_penalty": 1.3}, **options)
    assert [c.message.content for c in r.choices] == [expected.output_text] * 2
    stream = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"repetition_penalty": 1.3}, **options)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.output_text
    text = sdk.completions.create(model=TINY_NAME, prompt=words(12, seed=4), max_tokens=8, temperature=0,
                                  frequency_penalty=2.0, logit_bias={"17": -100})
    assert text.choices[0].text == tiny_engine.generate(words(12, seed=4), 8, frequency_penalty=2.0,
                                                        logit_bias={17: -100}).output_text


def test_stop_strings_and_max_completion_tokens(sdk):
    msgs = _messages(8)
    full = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_completion_tokens=16, temperature=0)
    assert full.usage.completion_tokens <= 16
    text = full.choices[0].message.content
    assert len(text) > 6
    stop = text[3:6]
    cut = sdk.chat.completions.create(model=TINY_NAME, messages=msgs, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_are_listed_and_accepted_by_name_or_path(sdk, tiny_model_dir):
    models = sdk.models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    assert sdk.models.retrieve(TINY_NAME).id == TINY_NAME
    r = sdk.completions.create(model=str(tiny_model_dir), prompt="hello", max_tokens=2, temperature=0)
    assert r.model == TINY_NAME


def test_list_content_parts_and_developer_role(sdk):
    r = sdk.chat.completions.create(model=TINY_NAME, max_tokens=3, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}])
    assert r.choices[0].message.content is not None
