"""Prompt lookup on the embedded SmolLM2-135M with grounded prompts: drafts are accepted and the greedy output is
identical to plain greedy, token for token."""
from __future__ import annotations

import pytest

from kvboost import KVBoost

pytestmark = pytest.mark.slow

DOC = ("The Jorwick Scout is a portable consumer device aimed at outdoor and field users. The device went on sale "
       "in March and is assembled in two plants. Its battery lasts about nineteen hours, and the casing is rated "
       "for light rain. Reviewers praised the screen but criticised the slow charger.")


@pytest.mark.parametrize("ask", ["Copy the first two sentences of the document exactly.",
                                 "Quote the sentence about the battery."])
def test_grounded_answers_are_identical_and_accept_drafts(smol, ask):
    model, tokenizer = smol
    engine = KVBoost(model, tokenizer)
    messages = [{"role": "user", "content": f"Document:\n{DOC}\n\n{ask}"}]
    plain = engine.generate(messages=messages, max_new_tokens=40)
    spec = engine.generate(messages=messages, max_new_tokens=40, speculative="prompt_lookup")
    assert spec.output_token_ids == plain.output_token_ids
    assert spec.accepted_tokens >= 10, (spec.draft_tokens, spec.accepted_tokens)
