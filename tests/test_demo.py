"""`kvboost demo` measures what its table says: each question's KVBoost run reuses the stored system prompt and
nothing more (not the baseline's K/V of the same prompt, not an earlier question's chunks)."""
from __future__ import annotations

from kvboost import KVBoost
from kvboost.demo import DEMO_ENGINE_OPTIONS, ask
from kvboost.samples import load_system_prompt

from .tiny_models import make_tiny_model


def test_each_question_reuses_exactly_the_stored_system_prompt(tokenizer, device):
    # The shipped manual is ~1,100 tokens: longer than the tiny model's default context.
    model = make_tiny_model("llama", tokenizer, device=device, max_position_embeddings=2048)
    engine = KVBoost(model, tokenizer, **DEMO_ENGINE_OPTIONS)
    system, questions = load_system_prompt()
    system_messages = [{"role": "system", "content": system}]
    warm = engine.warm(messages=system_messages)
    stored = engine.encode(messages=system_messages, add_generation_prompt=False)
    assert warm.tokens == len(stored) > 1000 and warm.chunks_stored > 1
    # Three questions (they share the chat template's user-turn opening after the system prompt), then the
    # first one again: each baseline leaves its K/V resident and each request could store its chunks.
    for question in [*questions[:3], questions[0]]:
        run = ask(engine, system_messages, question, max_new_tokens=3)
        assert run.cached_tokens == len(stored), question
        assert run.prompt_tokens > len(stored) and run.identical
