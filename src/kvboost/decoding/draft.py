"""Draft-model speculation: a small model sharing the target's tokenizer proposes the next k tokens greedily. It runs
in its own InferenceEngine (private to the target, used under the target's lock), so its prompt K/V is reused too."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidRequestError
from ..reuse.match import common_prefix_length
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..request import Request


def load_draft_model(draft_model, target_model, target_tokenizer):
    """The draft HF model on the target's device and dtype; InvalidRequestError when vocabularies differ."""
    from ..loading import load_model_and_tokenizer

    param = next(target_model.parameters())
    if isinstance(draft_model, str):
        model, tokenizer = load_model_and_tokenizer(draft_model, dtype=param.dtype, device=str(param.device))
        if tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise InvalidRequestError(f"draft model {draft_model!r} has a different tokenizer vocabulary than the "
                                      "target; speculative decoding needs a draft sharing the tokenizer",
                                      "draft_model")
    elif isinstance(draft_model, torch.nn.Module) and hasattr(draft_model, "config"):
        model = draft_model.to(param.device)
    else:
        raise InvalidRequestError(f"draft_model must be a path, a hub id or a loaded Hugging Face model, got "
                                  f"{type(draft_model).__name__}", "draft_model")
    ours, theirs = (m.get_input_embeddings().num_embeddings for m in (model, target_model))
    if ours != theirs:
        raise InvalidRequestError(f"the draft model's vocabulary has {ours} tokens, the target's {theirs}: "
                                  "speculative decoding needs a draft sharing the target's tokenizer", "draft_model")
    return model.eval()


class DraftProposer:
    """One sequence's draft K/V in a row of the draft engine's workspace (the first one when free, where the draft's
    runner steps run: CUDA graphs, the compiled CPU step); proposes greedily."""

    def __init__(self, draft_engine, request: Request, context: Sequence[int]):
        self.engine = draft_engine
        self.context = list(context)  # prompt + emitted tokens
        params = SamplingParams(max_new_tokens=request.params.max_new_tokens)
        self.request = draft_engine.make_request(request.ids, params, mode=request.mode, cache_salt=request.salt,
                                                 speculative=None)
        with draft_engine.lock, torch.inference_mode():
            self.slot = draft_engine.scheduler.lease()
            try:
                self.plan = self.slot.prefill(self.request).plan
            except BaseException:
                draft_engine.scheduler.release(self.slot)
                raise
        # The draft K/V holds context[:base] (which only grows), then `tail` (drafts the target may have rejected).
        self.base, self.tail = len(request.ids), []

    def extend(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        n = self._synced(self.context)
        with self.engine.lock, torch.inference_mode():
            drafts = [int(torch.argmax(self.slot.forward(self.context[n:], n)))]
            for pos in range(len(self.context), len(self.context) + k - 1):  # each draft but the last is fed back
                drafts.append(int(torch.argmax(self.slot.forward([drafts[-1]], pos))))
        self.base, self.tail = len(self.context), drafts[:-1]
        return drafts

    def _synced(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` (an extension or prefix of the context) have draft K/V."""
        if len(tokens) <= self.base:
            return len(tokens)
        return self.base + common_prefix_length(self.tail, tokens[self.base:])

    def close(self, emitted: Sequence[int]) -> None:
        """Store the draft's exact K/V in the draft engine's cache; the row goes back to the draft engine."""
        n = self._synced(emitted)
        with self.engine.lock, torch.inference_mode():
            try:
                self.slot.finish(self.request, self.plan, list(emitted[:n]))
            finally:
                self.engine.scheduler.release(self.slot)
