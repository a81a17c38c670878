"""Fields of other OpenAI-compatible servers (server/extensions.py): vLLM's guided decoding and llama.cpp's
json_schema / grammar constrain the reply as response_format does; min_p samples; result-changing fields this
server does not implement are a 400, never silently ignored (tiny random model: the grammar decides the shape)."""
from __future__ import annotations

import json
import re

import openai
import pytest
import torch

from kvboost.errors import InvalidRequestError
from kvboost.sampling import Sampler, SamplingParams
from kvboost.server.extensions import guided_format, refuse_unsupported

from .conftest import TINY_NAME
from .test_structured import BOUNDED, CHAT, _valid

pytest.importorskip("xgrammar")


def test_each_guided_field_maps_to_one_format():
    assert guided_format({}) is None
    assert guided_format({"guided_json": BOUNDED}).kind == "json_schema"
    assert guided_format({"json_schema": json.dumps(BOUNDED)}).kind == "json_schema"  # llama.cpp, as text
    assert guided_format({"guided_regex": "[ab]+"}).source == "[ab]+"
    assert guided_format({"guided_choice": ["yes", "no (maybe)"]}).source == r"(yes)|(no \(maybe\))"
    assert guided_format({"guided_grammar": 'root ::= "x"'}).kind == "grammar"
    assert guided_format({"structured_outputs": {"choice": ["a"]}}).param == "structured_outputs.choice"
    assert guided_format({"structured_outputs": {"json_object": True}}).kind == "json_object"
    for bad, param in [({"guided_json": BOUNDED, "guided_regex": "a"}, "guided_regex"),
                       ({"guided_choice": []}, "guided_choice"), ({"guided_choice": "yes"}, "guided_choice"),
                       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                       ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs"),
                       ({"guided_json": "{not json"}, "guided_json")]:
        with pytest.raises(InvalidRequestError) as info:
            guided_format(bad)
        assert info.value.param == param, bad


def test_fields_that_would_change_the_reply_are_refused_and_defaults_pass():
    refuse_unsupported({"skip_special_tokens": True, "min_tokens": 0, "priority": 0, "ignore_eos": False,
                        "guided_decoding_backend": "xgrammar", "stop_token_ids": [],
                        "cache_prompt": True, "length_penalty": 1.0, "return_logits": False})
    for field, value in [("use_beam_search", True), ("min_tokens", 5), ("ignore_eos", True),
                         ("stop_token_ids", [7]), ("chat_template", "{{ messages }}"),
                         ("skip_special_tokens", False), ("guided_decoding_backend", "outlines"),
                         ("typical_p", 0.5), ("logits_processors", ["x"]), ("priority", 3), ("return_logits", True)]:
        with pytest.raises(InvalidRequestError) as info:
            refuse_unsupported({field: value})
        assert info.value.param == field


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = Sampler(SamplingParams(temperature=1.0, min_p=0.4)).probabilities(logits)
    assert p[2] == 0 and p[3] == 0 and abs(float(p[:2].sum()) - 1) < 1e-6  # 0.15 < 0.4 x 0.5 <= 0.3
    assert torch.allclose(Sampler(SamplingParams(temperature=1.0)).probabilities(logits), torch.exp(logits))
    with pytest.raises(InvalidRequestError):
        SamplingParams(min_p=1.5)


def test_guided_fields_constrain_the_reply(client):
    def chat(**extra):
        return client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=200, temperature=0,
                                              extra_body=extra).choices[0].message.content

    assert _valid(json.loads(chat(guided_json=BOUNDED)), BOUNDED)
    assert _valid(json.loads(chat(structured_outputs={"json": BOUNDED})), BOUNDED)
    assert chat(guided_choice=["sunny", "rainy (light)"]) in ("sunny", "rainy (light)")
    assert re.fullmatch(r"[0-9]{3}-[a-c]+", chat(guided_regex="[0-9]{3}-[a-c]+"))
    assert chat(grammar='root ::= "yes" | "no"') in ("yes", "no")
    text = client.completions.create(model=TINY_NAME, prompt="The weather:", max_tokens=100, temperature=0,
                                     extra_body={"guided_json": BOUNDED}).choices[0].text
    assert _valid(json.loads(text), BOUNDED)
    sampled = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=8, temperature=1.0, seed=3,
                                             extra_body={"min_p": 0.1})
    assert sampled.choices[0].message.content is not None


@pytest.mark.parametrize("extra, param", [({"guided_json": BOUNDED, "response_format": {"type": "json_object"}},
                                           "guided_json"),
                                          ({"ignore_eos": True}, "ignore_eos"),
                                          ({"use_beam_search": True}, "use_beam_search"),
                                          ({"guided_choice": []}, "guided_choice"),
                                          ({"min_p": 2}, "min_p")])
def test_conflicting_or_unsupported_fields_are_400(client, extra, param):
    body = dict(extra)
    response_format = body.pop("response_format", None)
    kwargs = {"response_format": response_format} if response_format else {}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=4, extra_body=body, **kwargs)
    assert info.value.param == param


def test_chat_template_kwargs_reach_the_template(tokenizer, tiny_model_dir):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, for one) are the template's variables, in the library
    and the server; the template's own arguments cannot be overridden; completions refuse them."""
    import copy

    from kvboost import KVBoost

    from ..tiny_models import make_tiny_model
    from .conftest import live_server

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% if greeting %}{{ greeting }} {% endif %}" + tokenizer.chat_template
    engine = KVBoost(make_tiny_model("llama", tok), tok, chunk_size=16)
    messages = [{"role": "user", "content": "hi"}]
    plain = engine.encode(messages=messages)
    greeted = engine.encode(messages=messages, chat_template_kwargs={"greeting": "Hello there"})
    assert greeted[len(greeted) - len(plain):] == plain and len(greeted) > len(plain)
    r = engine.generate(messages=messages, max_new_tokens=2, chat_template_kwargs={"greeting": "Hello there"})
    assert r.prompt_tokens == len(greeted)
    for bad in ({"tokenize": False}, {"tools": []}, ["greeting"]):
        with pytest.raises(InvalidRequestError) as info:
            engine.encode(messages=messages, chat_template_kwargs=bad)
        assert info.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError):
        engine.encode("plain prompt", chat_template_kwargs={"greeting": "x"})
    with live_server(engine, model=str(tiny_model_dir)) as live:
        client = live.client()
        r = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"greeting": "Hello there"}})
        assert r.usage.prompt_tokens == len(greeted)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
        assert info.value.param == "chat_template_kwargs"
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2,
                                      extra_body={"chat_template_kwargs": {"greeting": "x"}})
        assert info.value.param == "chat_template_kwargs"
