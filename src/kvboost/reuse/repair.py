"""Repair re-positioned K/V and prefill the rest of the prompt, layer by layer, over the workspace.

After assembly the workspace holds, for a prompt of N tokens: exact K/V at [0, exact_len) (never touched
here), approximate K/V at the placed positions, and nothing yet at the live positions (separators, the
question, anything unmatched). One forward of the model runs over a *query set* of positions that may
shrink from layer to layer; every query's new K/V is scattered to its own position and attention always
reads keys [0, N) under an explicit causal (and, per layer, sliding-window) mask. Positions outside the
query set keep the K/V already there.

Strategies (RecomputeStrategy):
  none        queries = live positions in every layer; placed K/V used as is.
  selective   queries = live positions + the first `overlap` placed tokens after each seam, in every layer:
              the tokens that most need the new preceding context see it.
  cacheblend  layers 0..CHECK_LAYER run every non-exact position (cheap: 2 of ~30 layers), and the check
              layer ranks placed tokens by how far their fresh values deviate from the stored ones. The
              next layer recomputes the top min(1, 2r) of them and ranks again (gradual filtering); from
              then on only the top r and the live positions run. Cost ~ (CHECK_LAYER + 1 + r * rest) of a
              prefill: it grows with r, not with the prompt. r = 0 is exactly `none`, r = 1 a full prefill.

The per-layer query sets are applied with forward pre-hooks on the decoder layers, so the model's own
embedding (scaling included), rotary module, norms and head run unchanged; only the hidden-state rows,
their rotary rows, position ids and the mask are narrowed before each layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..results import RecomputeStrategy
from ..runner import KVWorkspace

CHECK_LAYER = 1  # layer 0's K/V equals the stored K/V (no context yet), so layer 1 is the first informative one
GRADUAL = 2.0  # the first filtering step keeps GRADUAL * r of the placed tokens
_SUPPORTED_ATTENTION = ("sdpa", "eager")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_SCORE = ["v"]
_FORCE = [0]


@dataclass
class RepairResult:
    logits: torch.Tensor  # [vocab] float32 logits of the last prompt position
    recomputed: int  # placed tokens recomputed in every layer after selection


def _decoder_layers(model: torch.nn.Module) -> Any:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else model
    return getattr(decoder, "layers", None)


def layer_windows(model: torch.nn.Module) -> tuple[list[int | None] | None, str | None]:
    """Per layer: None (full causal attention) or the sliding window w (query q sees keys k with q - k < w)."""
    config = model.config.get_text_config()
    layers = _decoder_layers(model)
    if layers is None:
        return None, "no decoder layers found (model.get_decoder().layers)"
    n = len(layers)
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "attention_chunk_size", None):
        return None, "bidirectional or chunked attention: the layer-wise mask is not reproduced"
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        unknown = sorted({t for t in types if t not in _LAYER_TYPES})
        if unknown:
            return None, f"layer types {unknown} are not supported by the layer-wise repair"
        if "sliding_attention" in types and not window:
            return None, "sliding layers without a sliding_window"
        return [window if t == "sliding_attention" else None for t in types[:n]], None
    # No layer_types (Llama, Mistral, Phi3): the model builds a sliding mask for every layer iff a window is set.
    return [window if window else None] * n, None


def repair_support(model: torch.nn.Module) -> str | None:
    """None when the layer-wise forward reproduces this model's attention; otherwise the reason it does not."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in _SUPPORTED_ATTENTION:
        return f"attention implementation {impl!r}: only {', '.join(_SUPPORTED_ATTENTION)} take an explicit 4D mask"
    return layer_windows(model)[1]


class ScatterLayer(CacheLayerMixin):
    """Cache layer whose update writes K/V at arbitrary workspace positions and returns keys [0, total).

    `positions` (the query set of this layer) is set by the driver before the layer runs. When `score_rows`
    is set, update() first measures how far the incoming values of those rows deviate from what the buffer
    holds at their positions (the placed, stored values): CacheBlend's selection signal.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, workspace: KVWorkspace, layer_idx: int, total: int):
        super().__init__()
        self.workspace = workspace
        self.layer_idx = layer_idx
        self.total = total
        self.positions: torch.Tensor | None = None
        self.score_rows: torch.Tensor | None = None
        self.deviation: torch.Tensor | None = None
        self.is_initialized = True
        k_buf, _ = workspace.buffers(layer_idx)
        self.dtype, self.device = k_buf.dtype, k_buf.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k_buf, v_buf = self.workspace.buffers(self.layer_idx)
        pos = self.positions
        if self.score_rows is not None:
            src = pos.index_select(0, self.score_rows)
            new_v = value_states.index_select(2, self.score_rows).float()
            old_v = v_buf.index_select(2, src).float()
            dv = (new_v - old_v).pow(2).sum(dim=(0, 1, 3))
            new_k = key_states.index_select(2, self.score_rows).float()
            old_k = k_buf.index_select(2, src).float()
            dk = (new_k - old_k).pow(2).sum(dim=(0, 1, 3))
            mode = _SCORE[0]
            if mode == "v":
                self.deviation = dv
            elif mode == "k":
                self.deviation = dk
            elif mode == "kv":
                self.deviation = dv / dv.mean().clamp_min(1e-12) + dk / dk.mean().clamp_min(1e-12)
            elif mode == "rel":
                self.deviation = dv / old_v.pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12) + dk / old_k.pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)
        k_buf.index_copy_(2, pos, key_states.to(k_buf.dtype))
        v_buf.index_copy_(2, pos, value_states.to(v_buf.dtype))
        return k_buf[:, :, : self.total], v_buf[:, :, : self.total]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.total, 0

    def get_seq_length(self) -> int:
        return self.total

    def get_max_length(self) -> int:
        return -1


# ---- query schedules ------------------------------------------------------------------------------

class _Fixed:
    """The same query set in every layer (none, selective)."""

    def __init__(self, queries: torch.Tensor, recomputed: int):
        self.first = queries
        self.recomputed = recomputed

    def queries(self, layer: int, cache: Cache) -> torch.Tensor:
        return self.first

    def score(self, layer: int, queries: torch.Tensor) -> torch.Tensor | None:
        return None


class _Blend:
    """CacheBlend: all non-exact positions up to the check layer, then placed tokens filtered by deviation."""

    def __init__(self, everything: torch.Tensor, live: torch.Tensor, placed: torch.Tensor, ratio: float,
                 n_layers: int):
        self.first = everything
        self.live = live
        self.candidates = placed  # the placed tokens still in the running, sorted by position
        n = placed.numel()
        self.check = min(CHECK_LAYER, n_layers - 1)
        self.keep = [math.ceil(min(1.0, ratio * GRADUAL) * n), math.ceil(ratio * n)]
        self.current = everything
        self.recomputed = n if self.check + 1 >= n_layers else 0

    def queries(self, layer: int, cache: Cache) -> torch.Tensor:
        step = layer - self.check - 1
        if 0 <= step < len(self.keep):
            dev = cache.layers[layer - 1].deviation
            k = min(self.keep[step], self.candidates.numel())
            top = torch.topk(dev, k, sorted=False).indices if k < dev.numel() else torch.arange(dev.numel())
            self.candidates = self.candidates.index_select(0, top.to(self.candidates.device)).sort().values
            self.current = torch.cat([self.live, self.candidates]).sort().values
            self.recomputed = self.candidates.numel()
        return self.current

    def score(self, layer: int, queries: torch.Tensor) -> torch.Tensor | None:
        if self.check <= layer <= self.check + len(self.keep) - 1:
            return torch.searchsorted(queries, self.candidates)
        return None


# ---- the layer-wise forward -----------------------------------------------------------------------

def _mask(queries: torch.Tensor, total: int, window: int | None, impl: str, dtype: torch.dtype) -> torch.Tensor:
    keys = torch.arange(total, device=queries.device)
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window  # HF's sliding_window_overlay
    allowed = allowed[None, None]
    if impl == "eager":  # eager attention adds the mask to the scores
        return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), torch.finfo(dtype).min)
    return allowed


def repair_forward(model: torch.nn.Module, workspace: KVWorkspace, ids: list[int], exact_len: int,
                   placed: torch.Tensor, seams: list[int], strategy: RecomputeStrategy | str, ratio: float,
                   overlap: int) -> RepairResult:
    """Fill workspace positions [exact_len, len(ids)) and return the last position's logits.

    `placed` is a bool [len(ids)] mask of positions holding assembled (approximate) K/V; the last position
    must be live (its logits pick the first new token). Callers run this under torch.inference_mode().
    """
    strategy = RecomputeStrategy.parse(strategy)
    n = len(ids)
    device = workspace.device
    placed = placed.to(device)
    if placed[-1] or placed[:exact_len].any():
        raise ValueError("placed positions must lie in [exact_len, len(ids) - 1)")
    positions = torch.arange(exact_len, n, device=device)
    is_placed = placed[exact_len:]
    live, reused = positions[~is_placed], positions[is_placed]
    layers = _decoder_layers(model)
    windows, reason = layer_windows(model)
    if windows is None:
        raise ValueError(reason)
    impl = model.config._attn_implementation

    if strategy is RecomputeStrategy.CACHEBLEND and ratio > 0 and reused.numel():
        if _FORCE[0]:
            forced = torch.zeros(n, dtype=torch.bool, device=device)
            for s in seams:
                forced[s:s + _FORCE[0]] = True
            forced &= placed
            live = torch.cat([live, forced.nonzero().flatten()]).sort().values
            reused = positions[is_placed & ~forced[exact_len:]]
        schedule: _Fixed | _Blend = _Blend(positions, live, reused, float(ratio), len(layers))
    elif strategy is RecomputeStrategy.SELECTIVE and overlap > 0 and reused.numel():
        forced = torch.zeros(n, dtype=torch.bool, device=device)
        for s in seams:
            forced[s:s + overlap] = True
        forced &= placed
        schedule = _Fixed(torch.cat([live, forced.nonzero().flatten()]).sort().values, int(forced.sum()))
    else:  # none, cacheblend at r = 0, or nothing placed
        schedule = _Fixed(live, 0)

    cache = Cache(layers=[ScatterLayer(workspace, i, n) for i in range(len(layers))])
    first = schedule.first
    state: dict[str, Any] = {"rows_of": first, "masks": {}}
    dtype = workspace.dtype

    def mask_for(queries: torch.Tensor, window: int | None) -> torch.Tensor:
        key = (id(queries), window)
        hit = state["masks"].get(key)
        if hit is None or hit[0] is not queries:
            hit = (queries, _mask(queries, n, window, impl, dtype))
            state["masks"][key] = hit
        return hit[1]

    def pre_hook(layer_idx: int):
        def hook(module, args, kwargs):
            queries = schedule.queries(layer_idx, cache)
            prev = state["rows_of"]
            if queries is not prev:
                # Hidden rows of the previous layer's queries -> this layer's (a subset, both sorted).
                rows = torch.searchsorted(prev, queries)
                if args:
                    args = (args[0].index_select(1, rows),) + tuple(args[1:])
                else:
                    kwargs["hidden_states"] = kwargs["hidden_states"].index_select(1, rows)
                state["rows_of"] = queries
            if queries is not first:
                rows0 = torch.searchsorted(first, queries)
                pe = kwargs.get("position_embeddings")
                if isinstance(pe, (tuple, list)):
                    kwargs["position_embeddings"] = tuple(t.index_select(1, rows0) for t in pe)
            kwargs["position_ids"] = queries[None]
            kwargs["attention_mask"] = mask_for(queries, windows[layer_idx])
            layer = cache.layers[layer_idx]
            layer.positions = queries
            layer.score_rows = schedule.score(layer_idx, queries)
            return args, kwargs
        return hook

    handles = [layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        out = model(input_ids=torch.tensor([ids], device=device).index_select(1, first),
                    position_ids=first[None], attention_mask=mask_for(first, None), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return RepairResult(out.logits[0, -1].float(), int(schedule.recomputed))
