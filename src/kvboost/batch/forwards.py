"""The eager forwards of several rows at once over the scheduler's workspace, for steps the runner's fixed-shape steps
do not take. Row K/V sits at columns equal to its positions (minus a shared prefix), each row masked to its own."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..kv.workspace import KVWorkspace
from ..model.cache_arg import cache_kwargs
from ..model.forward import attention_context
from .cascade import cascade_forward
from .prefix import SharedPrefix
from .slot_layer import SlotLayer


class RowForwards:
    """Eager batched forwards over `ws` for the engine's model (and the batch's shared prefix, when set)."""

    def __init__(self, engine, ws: KVWorkspace):
        self.model, self.attention, self.device = engine.model, engine.attention, engine.device
        self.ws = ws
        self.prefix: SharedPrefix | None = None
        # Ragged verifies need a 4D mask: None where the attention in use takes none (flash attention...).
        self.ragged_mask = ragged_mask_kind(engine)

    def forward(self, cache: Cache, keep: int = 1, **inputs) -> torch.Tensor:
        # The shared prefix needs cascade attention; otherwise rows use the engine's attention (resolve_attention).
        ctx = cascade_forward(self.model, cache) if self.prefix is not None else \
            attention_context(self.model, self.attention)
        with ctx:
            return self.model(**cache_kwargs(cache), use_cache=True, logits_to_keep=keep, **inputs).logits

    def cache(self, slots: slice, write_cols: torch.Tensor | int, past: int) -> Cache:
        return Cache(layers=[SlotLayer(self.ws, i, slots, write_cols, past, self.prefix)
                             for i in range(len(self.ws.shapes))])

    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """float32-castable logits [vocab] of the last of `tokens` run at positions [start, start + n) of one slot."""
        cache = self.cache(slice(slot, slot + 1), start, start)
        ids = torch.tensor([tokens], device=self.device)
        return self.forward(cache, input_ids=ids)[0, -1]

    def alone(self, tokens: list[int], start: int) -> torch.Tensor:
        """float32 logits [n, vocab] of tokens at [start, start + n) of slot 0, the batch's only row."""
        n = len(tokens)
        self.ws.ensure_capacity(start + n, keep=start)
        ids = torch.tensor([tokens], device=self.device)
        return self.forward(self.cache(slice(0, 1), start, start), keep=n, input_ids=ids)[0].float()

    def decode(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """float32-castable logits [rows, vocab]: row i feeds tokens[i] at position lengths[i]."""
        n = len(tokens)
        lengths_t = torch.tensor(lengths, device=self.device)
        past = max(lengths)
        self.ws.ensure_capacity(past + 1, keep=past)
        mask = torch.arange(past + 1, device=self.device)[None, :] <= lengths_t[:, None]
        ids = torch.tensor([[t] for t in tokens], device=self.device)
        cache = self.cache(slice(0, n), lengths_t, past)
        return self.forward(cache, input_ids=ids, attention_mask=mask, position_ids=lengths_t[:, None])[:, -1]

    def ragged(self, tokens: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """float32 logits [rows, q, vocab]: row i's q tokens at [lengths[i], lengths[i] + q), own columns only."""
        device = self.device
        n, q = len(tokens), len(tokens[0])
        past = max(lengths)
        self.ws.ensure_capacity(past + q, keep=past)
        starts = torch.tensor(lengths, device=device)
        positions = starts[:, None] + torch.arange(q, device=device)  # [rows, q]
        first = self.prefix.length if self.prefix is not None else 0  # key columns hold positions [first, past + q)
        columns = torch.arange(first, past + q, device=device)
        mask = (columns[None, None, :] <= positions[:, :, None])[:, None]  # [rows, 1, q, keys]: may attend
        if self.ragged_mask == "additive" and self.prefix is None:  # the model's own eager attention adds it
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
        ids = torch.tensor(tokens, device=device)
        return self.forward(self.cache(slice(0, n), starts, past), keep=q, input_ids=ids, attention_mask=mask,
                            position_ids=positions).float()


def ragged_mask_kind(engine) -> str | None:
    """The 4D mask a ragged verify hands the attention in use: "bool" (KVBoost's attention, cascade, SDPA),
    "additive" (the model's own eager attention), or None where it takes no such mask (flash attention...)."""
    if engine.attention != "model":
        return "bool"
    implementation = getattr(engine.model.config, "_attn_implementation", None)
    return {"sdpa": "bool", "eager": "additive"}.get(implementation)
