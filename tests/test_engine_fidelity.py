"""Exact reuse must reproduce plain Hugging Face generation: same greedy tokens, first-token logits within 1e-4."""
from __future__ import annotations

import pytest
import torch

from kvboost import GenerationMode, KVBoost

from .hf_reference import hf_first_logits, hf_greedy
from .prompts import text_with_tokens, words

CHUNK = 16
NEW = 12


@pytest.mark.parametrize("reused_chunks", [1, 2, 8])
def test_exact_reuse_matches_hf_generate(tiny, reused_chunks):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prefix = text_with_tokens(tokenizer, reused_chunks * CHUNK + CHUNK // 2, seed=reused_chunks)  # + a partial tail
    prompt = prefix + " " + words(9, seed=99)
    warm = engine.warm(prefix)
    assert warm.chunks_stored >= reused_chunks
    engine.forget_workspace()  # reuse must come from stored chunks, not the resident workspace
    result = engine.generate(prompt, NEW, return_logits=True)
    ids = engine.encode(prompt)
    assert result.cached_tokens >= reused_chunks * CHUNK + 1  # whole chunks plus part of the partial tail
    assert result.cached_tokens < len(ids)
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    diff = (result.first_token_logits - hf_first_logits(model, ids)).abs().max().item()
    assert diff < 1e-4


def test_workspace_reuse_matches_hf_generate(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    base = text_with_tokens(tokenizer, 5 * CHUNK, seed=3)
    engine.generate(base + " first question", 6)
    prompt = base + " second question entirely"
    result = engine.generate(prompt, NEW, return_logits=True)
    ids = engine.encode(prompt)
    assert result.cached_tokens >= 5 * CHUNK - 2
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    assert (result.first_token_logits - hf_first_logits(model, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_resident_workspace_is_reused_without_the_store(arch, tokenizer):
    """With nothing stored (write_back off), the previous request's K/V still in the workspace is the source."""
    from .tiny_models import make_tiny_model

    model = make_tiny_model(arch, tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, write_back=False)
    base = text_with_tokens(tokenizer, 3 * CHUNK + 5, seed=4)
    first = engine.generate(base + " first question", 6)
    assert first.cached_tokens == 0 and engine.cache_stats()["tiers"]["memory"]["entries"] == 0
    prompt = base + " second question entirely"
    result = engine.generate(prompt, NEW, return_logits=True)
    ids = engine.encode(prompt)
    assert result.cached_tokens >= 3 * CHUNK  # everything the two prompts share, from the workspace alone
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    assert (result.first_token_logits - hf_first_logits(model, ids)).abs().max().item() < 1e-4
    engine.forget_workspace()
    assert engine.generate(prompt, 2).cached_tokens == 0  # and nothing else could have served it


def test_token_id_prompts_reuse_the_exact_generated_tokens(tiny):
    # An agent that keeps token ids appends the reply as generated, never re-tokenized: all of it is reusable.
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    first = engine.encode(text_with_tokens(tokenizer, 3 * CHUNK + 5, seed=11))
    reply = engine.generate(input_ids=first, max_new_tokens=NEW)
    assert reply.output_token_ids == hf_greedy(model, tokenizer, first, NEW)
    engine.forget_workspace()  # the second turn must come from stored chunks
    second = first + reply.output_token_ids + engine.encode(" " + words(7, seed=12))
    second_ids = torch.tensor([second], device=engine.device)
    result = engine.generate(input_ids=second_ids, max_new_tokens=NEW, return_logits=True)
    assert result.prompt_tokens == len(second)
    assert result.cached_tokens >= (len(first) + len(reply.output_token_ids)) // CHUNK * CHUNK
    assert result.output_token_ids == hf_greedy(model, tokenizer, second, NEW)
    assert (result.first_token_logits - hf_first_logits(model, second)).abs().max().item() < 1e-4


def test_baseline_matches_hf_generate_and_reads_nothing(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompt = text_with_tokens(tokenizer, 3 * CHUNK, seed=5)
    engine.warm(prompt)
    result = engine.generate(prompt, NEW, mode=GenerationMode.BASELINE)
    assert result.cached_tokens == 0 and result.kv_reuse_ratio == 0.0
    assert result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), NEW)


def test_prefix_cache_mode_reuses_whole_chunks_only(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prefix = text_with_tokens(tokenizer, 2 * CHUNK + 5, seed=7)
    engine.warm(prefix)
    engine.forget_workspace()
    prompt = prefix + " " + words(6, seed=8)
    result = engine.generate(prompt, NEW, mode="prefix_cache")
    assert result.cached_tokens % CHUNK == 0 and result.cached_tokens >= 2 * CHUNK
    assert result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), NEW)


def replay_chat(engine, model, tokenizer, system: str, users: list[str], min_reuse: float,
                forget_workspace: bool = False) -> None:
    """Chat turn by turn like a client; every turn equals HF greedy, and later turns reuse > min_reuse."""
    messages = [{"role": "system", "content": system}]
    for turn, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if forget_workspace:
            engine.forget_workspace()  # each turn's reuse comes from the chunks written back after the last one
        result = engine.generate(messages=messages, max_new_tokens=10)
        ids = engine.encode(messages=messages)
        assert result.output_token_ids == hf_greedy(model, tokenizer, ids, 10), f"turn {turn}"
        if turn > 0:
            assert result.kv_reuse_ratio > min_reuse, f"turn {turn}: reuse {result.kv_reuse_ratio:.2f}"
        # The client re-sends the decoded reply; its re-tokenization may differ from the generated ids.
        messages.append({"role": "assistant", "content": result.output_text})


def test_multi_turn_replay_identical_every_turn(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    replay_chat(engine, model, tokenizer, words(40, seed=1),
                [words(8 + 3 * turn, seed=10 + turn) for turn in range(4)], min_reuse=0.5)


def test_seeded_sampling_same_tokens_in_baseline_and_reuse(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompt = text_with_tokens(tokenizer, 4 * CHUNK, seed=11)
    engine.warm(prompt)
    kwargs = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    base = engine.generate(prompt, NEW, mode="baseline", **kwargs)
    engine.forget_workspace()
    reused = engine.generate(prompt, NEW, **kwargs)
    assert reused.cached_tokens > 0
    assert base.output_token_ids == reused.output_token_ids
    other_seed = engine.generate(prompt, NEW, mode="baseline", **{**kwargs, "seed": 99})
    assert other_seed.output_token_ids != base.output_token_ids


# ---- boundary window: cuts move, reuse stays exact ----------------------------------------------------------
WINDOW = 5  # cuts slide up to 5 tokens either way of every 16th (chunk_boundary_window < CHUNK / 2)


def _prose(n_sentences: int, seed: int) -> str:
    """Sentences of varying length, so sentence ends fall at different offsets in each cut window."""
    return " ".join(words(4 + (seed + i) % 9, seed=seed * 100 + i).capitalize() + "." for i in range(n_sentences))


def _window_engine(arch: str, tokenizer) -> tuple:
    from .tiny_models import make_tiny_model

    model = make_tiny_model(arch, tokenizer)
    return model, KVBoost(model, tokenizer, chunk_size=CHUNK, chunk_boundary_window=WINDOW)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_boundary_window_exact_reuse_matches_hf_generate(arch, tokenizer):
    from kvboost.reuse.match import common_prefix_length

    model, engine = _window_engine(arch, tokenizer)
    prefix = _prose(14, seed=1) + " " + words(4, seed=3)  # ends mid-sentence
    prompt = prefix + " " + words(9, seed=99)
    prefix_ids, ids = engine.encode(prefix), engine.encode(prompt)
    chunks = engine.chunker.split(prefix_ids)
    assert len(chunks) >= 6 and any(len(c.token_ids) != CHUNK for c in chunks[:-1])  # the cuts did move
    # The prompt cuts the warmed remainder short (after its sentence end): the stored remainder must still be
    # used to its end, past the prompt's cut.
    assert any(c.start == chunks[-1].start and c.complete and c.end < len(prefix_ids)
               for c in engine.chunker.split(ids))
    assert engine.warm(prefix).chunks_stored == len(chunks)
    engine.forget_workspace()  # reuse must come from stored chunks, not the resident workspace
    result = engine.generate(prompt, NEW, return_logits=True)
    # The whole warmed prefix, although the prompt cuts its last chunks elsewhere than the warmed text did.
    assert result.cached_tokens == min(common_prefix_length(prefix_ids, ids), len(ids) - 1) > 5 * CHUNK
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    assert (result.first_token_logits - hf_first_logits(model, ids)).abs().max().item() < 1e-4
    # Whole chunks only in prefix-cache mode: the reuse ends on one of the prompt's cuts.
    engine.forget_workspace()
    whole = engine.generate(prompt, NEW, mode="prefix_cache")
    assert whole.cached_tokens in {c.end for c in engine.chunker.split(ids) if c.complete}
    assert whole.output_token_ids == result.output_token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_boundary_window_multi_turn_replay(arch, tokenizer):
    model, engine = _window_engine(arch, tokenizer)
    replay_chat(engine, model, tokenizer, _prose(8, seed=2), [_prose(2 + turn, seed=10 + turn) for turn in range(4)],
                min_reuse=0.6, forget_workspace=True)


def test_boundary_window_prefix_cache_rounds_the_workspace_to_a_cut(tokenizer):
    """Nothing stored (write_back off): a PREFIX_CACHE plan over the workspace's resident prefix keeps whole
    chunks only, down to one of the prompt's cuts (not a multiple of chunk_size)."""
    model, _ = _window_engine("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, chunk_boundary_window=WINDOW, write_back=False)
    first = _prose(8, seed=4) + " " + words(2, seed=6)
    engine.generate(first, 4)  # leaves first's K/V resident in the workspace
    ids = engine.encode(first + " " + _prose(3, seed=5))
    with torch.inference_mode():
        plan = engine.kv.lookup(ids, None, GenerationMode.PREFIX_CACHE, resident=engine.workspace.resident_ids)
    cuts = [c.end for c in engine.chunker.split(ids) if c.complete]
    expected = max(c for c in cuts if c <= len(engine.encode(first)))
    assert plan.reuse_len == expected > 4 * CHUNK and expected % CHUNK != 0


def test_boundary_window_write_back_keeps_shorter_chunks_that_have_children(tokenizer):
    """A complete chunk may be a strict prefix of a sibling cut later (another sentence end nearer the nominal
    cut); it heads its own chain, so only childless ones are dead weight. Short remainders still go."""
    _, engine = _window_engine("llama", tokenizer)
    word, dot = (tokenizer(t)["input_ids"][0] for t in (" river", "."))
    a = [word] * 13 + [dot] + [word] * 40  # first cut after the "." at 13: [0, 14)
    b = [word] * 13 + [dot, word, dot] + [word] * 40  # a "." at 15 is nearer the nominal 16: [0, 16)
    stub = a[:8]  # a remainder shorter than any complete chunk (16 - 5)
    for ids in (stub, a, b):
        engine.warm_ids(ids, None)
    ca, cb, cs = (engine.chunker.split(x)[0] for x in (a, b, stub))
    assert (ca.end, cb.end) == (14, 16) and ca.complete and cb.token_ids[:14] == ca.token_ids
    assert engine.store.contains(ca.prefix_key) and engine.store.contains(cb.prefix_key)
    assert not engine.store.contains(cs.prefix_key)
    engine.forget_workspace()
    with torch.inference_mode():
        plan = engine.kv.lookup(a + [word], None, GenerationMode.CHUNK_KV_REUSE)
    assert plan.reuse_len == len(a)  # a's whole chain is still reachable


def test_boundary_window_verify_correctness_counts_whole_chunks(tokenizer):
    _, engine = _window_engine("qwen2", tokenizer)
    prompt = _prose(7, seed=8)  # long enough for verify to use as-is
    report = engine.verify_correctness(prompts=[prompt], max_new_tokens=6)
    assert report
    check = report.checks[0]
    cuts = [stop for _, stop, done in engine.chunker.spans(engine.encode(prompt)) if done]
    assert check.cached_tokens == len(engine.encode(prompt)) - 1
    assert check.reused_chunks == sum(c <= check.cached_tokens for c in cuts) == 4  # not 81 // 16 = 5


def test_content_at_another_position_is_reused_only_when_asked(tokenizer):
    """Default generate() is exact: text stored earlier but found at another offset is recomputed, not placed.

    (A chat that shares a paragraph of its system prompt with an earlier one must still get plain output.)
    """
    from kvboost.errors import InvalidRequestError

    from .tiny_models import make_tiny_model

    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    shared = text_with_tokens(tokenizer, 4 * CHUNK, seed=21)
    engine.generate("Persona one. " + shared, 4)  # stored through write-back, at one offset
    prompt = "A different and longer opening persona, then: " + shared + " question?"
    ids = engine.encode(prompt)
    exact = engine.generate(prompt, NEW)
    assert exact.approximate_tokens == 0
    assert exact.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    other = "Yet another opening, unlike both: " + shared + " question?"  # no exact chain for it either
    approx = engine.generate(other, NEW, content_reuse=True)
    assert approx.approximate_tokens >= 2 * CHUNK  # the same text found at its new offset and re-positioned
    with pytest.raises(InvalidRequestError):
        engine.generate(prompt, 2, content_reuse="yes")
    assert KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True).config.content_reuse is True
