"""KVBoost's own calls into transformers and torch raise no deprecation notice.

A FutureWarning or DeprecationWarning from a dependency announces a removal: transformers 5.24 renamed the
forward's `past_key_values` to `cache` and drops the old name in 5.40, so a call still using it works today and
breaks on the release that removes it. transformers also logs some notices (reading `output.past_key_values`)
through its logger instead of `warnings`; those are caught too. The requests below go through every kind of
model call the engine makes: the shape probe, prefill and decode over the workspace, exact and re-positioned
reuse (with repair), a batch, speculative decoding, over the host tier and long contexts streamed from host
memory, and through the runner's fixed-shape steps.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from transformers.utils import logging as hf_logging

from kvboost import KVBoost

from .prompts import text_with_tokens, words
from .tiny_models import make_tiny_model

CHUNK = 16
_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def deprecations() -> Iterator[list[str]]:
    """Every deprecation notice raised inside the block: warnings of the deprecation categories, and the
    transformers logger's warnings that say "deprecated"."""
    found: list[str] = []
    handler = _Records()
    root = logging.getLogger("transformers")  # every transformers logger propagates to it
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    # warning_once remembers what it printed for the whole process: an earlier test's notice would hide ours.
    hf_logging.warning_once.cache_clear()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        root.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    found += [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
              for w in caught if issubclass(w.category, _DEPRECATIONS)]
    found += [f"transformers logger: {m}" for m in handler.messages if "deprecat" in m.lower()]


def _requests(engine: KVBoost, tokenizer) -> None:
    system = text_with_tokens(tokenizer, 3 * CHUNK + 5, seed=1)
    engine.generate(system + " first question?", 6)
    engine.generate(system + " second question?", 6)  # exact reuse of the stored system prompt
    engine.generate(system + " third?", 4, mode="baseline")
    engine.generate("A different opening. " + system + " fourth?", 4, content_reuse=True)  # re-positioned
    engine.generate_batch([system + " " + words(n, seed=n) for n in (3, 9)], max_new_tokens=4)
    repetitive = words(30, seed=21) + " " + words(30, seed=21)  # prompt lookup drafts get accepted
    engine.generate(repetitive, 12, speculative="prompt_lookup")


@pytest.mark.parametrize("options", [{}, {"device_kv_budget_bytes": 1 << 14, "device_kv_max_tokens": 2 * CHUNK},
                                     {"fast_path": "eager"}],
                         ids=["default", "host-tier-and-streamed", "runner"])
def test_kvboost_calls_raise_no_deprecation(tokenizer, options):
    model = make_tiny_model("llama", tokenizer)
    with deprecations() as found:
        engine = KVBoost(model, tokenizer, chunk_size=CHUNK, **options)
        _requests(engine, tokenizer)
    assert found == []


def test_the_check_sees_a_deprecated_call():
    """The helper above catches both kinds of notice (so an empty list means there were none)."""
    with deprecations() as found:
        warnings.warn("old name", FutureWarning, stacklevel=1)
        hf_logging.get_logger("transformers.modeling_utils").warning_once("`x` is deprecated. Use `y`.")
    assert len(found) == 2
