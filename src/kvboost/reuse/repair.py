"""Repair re-positioned K/V and prefill the rest of the prompt, layer by layer, over the workspace. One forward runs
over a query set that may shrink per layer (forward pre-hooks on the decoder layers); attention reads keys [0, N)
under an explicit causal mask. Strategies: none (live positions), selective (plus `overlap` placed tokens after each
seam), cacheblend (a probe at CHECK_LAYER ranks placed tokens by K/V deviation, keeping the top 2r, then r)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..kv.length_layer import BufferLayer
from ..kv.workspace import KVWorkspace
from ..model.cache_arg import cache_kwargs
from ..results import RecomputeStrategy
from .rope import decoder_of

CHECK_LAYER = 2  # layer 0's K/V equals the stored K/V (no context yet); layer 2 ranks better than 1 for ~equal cost
GRADUAL = 2.0  # the first filtering step keeps GRADUAL * r of the placed tokens
_BLOCK_ROWS = 96  # query rows per block: attention of a block reads keys only up to its last position
_MAX_BLOCKS = 8
_SUPPORTED_ATTENTION = ("sdpa", "eager")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class RepairResult:
    logits: torch.Tensor  # [vocab] float32 logits of the last prompt position
    recomputed: int  # placed tokens recomputed in every layer after selection


def layer_windows(model: torch.nn.Module) -> tuple[list[int | None] | None, str | None]:
    """Per layer: None (full causal attention) or the sliding window w (query q sees keys k with q - k < w)."""
    config = model.config.get_text_config()
    layers = getattr(decoder_of(model), "layers", None)
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


class _Probed(Exception):
    """Raised by ScatterLayer.update in probe mode: the K/V is written and scored, attention is not needed."""


class ScatterLayer(BufferLayer):
    """Cache layer writing K/V at arbitrary workspace positions and returning keys [0, end). After score(candidates),
    update() records the K/V `deviation` (CacheBlend's signal); `probing` raises _Probed once the K/V is written."""

    def __init__(self, workspace: KVWorkspace, layer_idx: int, total: int):
        super().__init__()
        self.workspace, self.layer_idx, self.total, self.end = workspace, layer_idx, total, total
        self.positions: torch.Tensor | None = None
        self.candidate_slot: torch.Tensor | None = None  # [total] long: slot in `deviation`, or -1
        self.deviation: torch.Tensor | None = None
        self.probing = False
        k_buf, _ = workspace.buffers(layer_idx)
        self.dtype, self.device = k_buf.dtype, k_buf.device

    def score(self, candidates: torch.Tensor | None) -> None:
        """Measure deviation for these positions during this layer's updates (None: stop measuring)."""
        if candidates is None:
            self.candidate_slot = self.deviation = None
            return
        self.candidate_slot = torch.full((self.total,), -1, dtype=torch.long, device=candidates.device)
        self.candidate_slot[candidates] = torch.arange(candidates.numel(), device=candidates.device)
        self.deviation = torch.zeros(candidates.numel(), dtype=torch.float32, device=candidates.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k_buf, v_buf = self.workspace.buffers(self.layer_idx)
        pos = self.positions
        if self.candidate_slot is not None:
            slots = self.candidate_slot.index_select(0, pos)
            rows = (slots >= 0).nonzero().flatten()
            if rows.numel():
                src = pos.index_select(0, rows)
                self.deviation[slots.index_select(0, rows)] = (
                    _relative_change(key_states.index_select(2, rows), k_buf.index_select(2, src))
                    + _relative_change(value_states.index_select(2, rows), v_buf.index_select(2, src)))
        k_buf.index_copy_(2, pos, key_states.to(k_buf.dtype))
        v_buf.index_copy_(2, pos, value_states.to(v_buf.dtype))
        if self.probing:
            raise _Probed
        return k_buf[:, :, : self.end], v_buf[:, :, : self.end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end, 0

    def get_seq_length(self) -> int:
        return self.total


def _relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per token ||new - old||^2 / ||old||^2 over heads and dims: scale-free, so K and V weigh alike."""
    new, old = new.float(), old.float()
    return (new - old).pow(2).sum(dim=(0, 1, 3)) / old.pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)


# ---- query schedules ------------------------------------------------------------------------------

class _Schedule:
    """The query set of each layer (`current`), from `first` on. With `keep` (CacheBlend) the placed tokens still in the
    running (`pool`, sorted by position) are filtered by deviation at layers check, check + 1... (top GRADUAL * r, then
    top r) and the queries become them with the live positions."""

    def __init__(self, first: torch.Tensor, live: torch.Tensor, pool: torch.Tensor, keep: list[int] | None = None,
                 check: int = 0):
        self.first = self.current = first
        self.live, self.pool, self.keep, self.check = live, pool, keep or [], check

    def probes(self, layer: int) -> bool:
        return self.check <= layer < self.check + len(self.keep)

    def select(self, layer: int, deviation: torch.Tensor) -> None:
        """Keep the pool's most deviating tokens (deviation is aligned with self.pool)."""
        k = min(self.keep[layer - self.check], self.pool.numel())
        if k < self.pool.numel():
            top = torch.topk(deviation, k, sorted=False).indices
            self.pool = self.pool.index_select(0, top).sort().values
        self.current = torch.cat([self.live, self.pool]).sort().values


# ---- the layer-wise forward -----------------------------------------------------------------------

def _mask(queries: torch.Tensor, end: int, window: int | None, impl: str, dtype: torch.dtype) -> torch.Tensor:
    keys = torch.arange(end, device=queries.device)
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window  # HF's sliding_window_overlay
    allowed = allowed[None, None]
    if impl == "eager":  # eager attention adds the mask to the scores
        return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), torch.finfo(dtype).min)
    return allowed


def _blocks(n_rows: int) -> list[slice]:
    """Consecutive row blocks: causal attention of early blocks then skips the keys after them."""
    g = max(1, min(_MAX_BLOCKS, n_rows // _BLOCK_ROWS))
    bounds = [round(i * n_rows / g) for i in range(g + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(g)]


def _schedule(strategy: RecomputeStrategy, ratio: float, overlap: int, n: int, exact_len: int,
              placed: torch.Tensor, seams: list[int], n_layers: int) -> _Schedule:
    device = placed.device
    positions = torch.arange(exact_len, n, device=device)
    is_placed = placed[exact_len:]
    live, reused = positions[~is_placed], positions[is_placed]
    if strategy is RecomputeStrategy.CACHEBLEND and ratio > 0 and reused.numel():
        # Every non-exact position up to the check layer, then the top GRADUAL * r placed tokens, then the top r.
        keep = [math.ceil(min(1.0, ratio * GRADUAL) * reused.numel()), math.ceil(ratio * reused.numel())]
        return _Schedule(positions, live, reused, keep, min(CHECK_LAYER, n_layers - 1))
    if strategy is RecomputeStrategy.SELECTIVE and overlap > 0 and reused.numel():
        forced = torch.zeros(n, dtype=torch.bool, device=device)
        for s in seams:
            forced[s:s + overlap] = True
        forced = (forced & placed).nonzero().flatten()
        return _Schedule(torch.cat([live, forced]).sort().values, live, forced)
    return _Schedule(live, live, live[:0])  # none, cacheblend at r = 0, or nothing placed


def repair_forward(model: torch.nn.Module, workspace: KVWorkspace, ids: list[int], exact_len: int,
                   placed: torch.Tensor, seams: list[int], strategy: RecomputeStrategy | str, ratio: float,
                   overlap: int) -> RepairResult:
    """Fill workspace positions [exact_len, len(ids)) and return the last position's logits. `placed`: bool [len(ids)]
    of positions holding approximate K/V; the last position must be live. Run under inference_mode."""
    n = len(ids)
    device = workspace.device
    placed = placed.to(device)
    if placed[-1] or placed[:exact_len].any():
        raise ValueError("placed positions must lie in [exact_len, len(ids) - 1)")
    layers = getattr(decoder_of(model), "layers", None)
    windows, reason = layer_windows(model)
    if windows is None:
        raise ValueError(reason)
    impl, dtype = model.config._attn_implementation, workspace.dtype
    schedule = _schedule(RecomputeStrategy.parse(strategy), ratio, overlap, n, exact_len, placed, seams, len(layers))
    cache = Cache(layers=[ScatterLayer(workspace, i, n) for i in range(len(layers))])
    first = schedule.first
    state: dict[str, Any] = {"rows_of": first, "stash": None}
    probe_mask = _mask(first[-1:], n, None, impl, dtype)  # never read: a probe stops before attention

    def narrow(hidden: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Hidden rows of the previous queries -> rows of `queries` (a subset; both sorted by position)."""
        if queries is not state["rows_of"]:
            hidden = hidden.index_select(1, torch.searchsorted(state["rows_of"], queries))
            state["rows_of"] = queries
        return hidden

    def rotary(pe: Any, queries: torch.Tensor) -> Any:
        if queries is first or not isinstance(pe, (tuple, list)):
            return pe
        rows0 = torch.searchsorted(first, queries)
        return tuple(t.index_select(1, rows0) for t in pe)

    def pre_hook(layer_idx: int):
        def hook(module, args, kwargs):
            layer: ScatterLayer = cache.layers[layer_idx]
            queries = schedule.current
            hidden = narrow(args[0] if args else kwargs.pop("hidden_states"), queries)
            if schedule.probes(layer_idx):
                # Every row's true K/V is written and scored; attention and MLP run for the kept rows only.
                layer.score(schedule.pool)
                layer.positions, layer.end, layer.probing = queries, n, True
                kw = dict(kwargs, position_ids=queries[None], attention_mask=probe_mask)
                if "position_embeddings" in kwargs:
                    kw["position_embeddings"] = rotary(kwargs["position_embeddings"], queries)
                try:
                    module.forward(hidden, *args[1:], **kw)
                except _Probed:
                    pass
                finally:
                    layer.probing = False
                schedule.select(layer_idx, layer.deviation)
                layer.score(None)
                queries = schedule.current
                hidden = narrow(hidden, queries)
            pe = rotary(kwargs.get("position_embeddings"), queries)
            outs = []
            blocks = _blocks(queries.numel())
            for i, rows in enumerate(blocks):
                q = queries[rows]
                layer.positions, layer.end = q, int(q[-1]) + 1
                kw = dict(kwargs, position_ids=q[None],
                          attention_mask=_mask(q, layer.end, windows[layer_idx], impl, dtype))
                if isinstance(pe, (tuple, list)):
                    kw["position_embeddings"] = tuple(t[:, rows] for t in pe)
                if i == len(blocks) - 1:  # the last block runs as the real call; the post-hook joins the rest
                    state["stash"] = outs
                    return (hidden[:, rows],) + tuple(args[1:]), kw
                out = module.forward(hidden[:, rows], *args[1:], **kw)  # .forward: no hook re-entry
                outs.append(out[0] if isinstance(out, tuple) else out)
            raise AssertionError("unreachable: there is always a last block")
        return hook

    def post_hook(module, args, kwargs, output):
        outs, state["stash"] = state["stash"], None
        if not outs:
            return output
        if isinstance(output, tuple):
            return (torch.cat(outs + [output[0]], dim=1),) + tuple(output[1:])
        return torch.cat(outs + [output], dim=1)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook, with_kwargs=True))
    try:
        out = model(input_ids=torch.tensor([ids], device=device).index_select(1, first),
                    position_ids=first[None], attention_mask=_mask(first[-1:], n, None, impl, dtype),
                    **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return RepairResult(out.logits[0, -1].float(), schedule.pool.numel())
