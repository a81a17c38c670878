"""Move cached RoPE keys to new positions: HF caches keys after the rotary embedding, and rotations compose, so
R(delta * inv_freq) moves a key to p + delta exactly with the model's own inv_freq. Length-dependent schemes report
exact=False unless both passes used the same frequencies."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ModelNotSupportedError

__all__ = ["RotaryInfo", "rotary_info_for", "rotation_support", "rerotate_keys", "decoder_of"]

# inv_freq is fixed at init for these, so any pair of positions is related by one rotation.
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
# Layer types that hold an ordinary post-RoPE K/V cache; anything else (mamba, linear attention...) does not.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


@dataclass(eq=False)
class RotaryInfo:
    """How to re-rotate the cached keys of one decoder layer: ``inv_freq`` float32 [rotary_dim // 2] over the first
    ``rotary_dim`` dims of ``head_dim`` in rotate-half layout; ``rotary_dim == 0`` is a NoPE layer."""

    inv_freq: torch.Tensor
    rotary_dim: int
    exact: bool
    reason: str | None = None
    rope_type: str | None = None
    layer_type: str | None = None
    # Informational only: already inside the cached keys, never re-applied by rerotate_keys.
    attention_scaling: float = 1.0


def _not_exact(reason: str, layer_type: str | None = None, rope_type: str | None = None) -> RotaryInfo:
    return RotaryInfo(torch.empty(0), 0, False, reason, rope_type, layer_type)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def decoder_of(model: nn.Module) -> nn.Module:
    """The model's decoder stack (model.get_decoder()), or the model itself where it names none."""
    with contextlib.suppress(Exception):  # none, or an exotic wrapper raised: the model itself is the best guess
        decoder = model.get_decoder()
        if isinstance(decoder, nn.Module):
            return decoder
    return model


def _model_level_reason(rotary: nn.Module | None, config) -> str | None:
    """Reasons that rule out every layer at once, or None."""
    if rotary is None:
        return ("no `rotary_emb` module on the decoder: positions are not RoPE (learned/ALiBi/none) "
                "or the layout is unknown")
    if getattr(config, "qk_rope_head_dim", None):
        # DeepSeek-style MLA caches cat(k_nope, k_rope): the rotary dims are not the leading ones.
        return "MLA attention (qk_rope_head_dim): rotary dims are not the leading key dims"
    rope = getattr(config, "rope_parameters", None) or {}
    for params in [v for v in rope.values() if isinstance(v, dict)] or [rope]:  # per layer type, or one for all
        if any(str(k).startswith("mrope") for k in params):
            return "multimodal M-RoPE (3-D positions) is not re-rotated"
    # Some families pair dims interleaved: probe the modeling file's own rotate_half rather than a list of names.
    module = sys.modules.get(type(rotary).__module__)
    fn = getattr(module, "rotate_half", None)
    if fn is None:
        return f"{type(rotary).__module__} has no rotate_half: RoPE layout unknown"
    probe = torch.arange(1.0, 9.0).reshape(1, 8)
    same = False
    with contextlib.suppress(Exception):
        same = torch.equal(fn(probe), _rotate_half(probe))
    if not same:
        return f"{type(rotary).__module__}.rotate_half is not the half-split layout (interleaved RoPE?)"
    return None


def _attr(rotary: nn.Module, name: str, layer_key: str | None):
    return getattr(rotary, f"{layer_key}_{name}" if layer_key else name, None)


def _layer_info(rotary: nn.Module, layer_type: str | None, src_len: int | None, dst_len: int | None) -> RotaryInfo:
    rope_types = getattr(rotary, "rope_type", None)
    # Gemma3-style modules keep one inv_freq per layer type ("sliding_attention_inv_freq", ...).
    layer_key = layer_type if isinstance(rope_types, dict) else None
    rope_type = rope_types.get(layer_type) if isinstance(rope_types, dict) else rope_types
    if rope_type is None:
        return _not_exact(f"rotary module has no RoPE settings for layer type {layer_type!r}", layer_type)

    scaling = _attr(rotary, "attention_scaling", layer_key)
    if scaling is None:
        scaling = getattr(rotary, "attention_scaling", 1.0)

    def info(buf: torch.Tensor | None) -> RotaryInfo:
        if buf is None:
            return _not_exact(f"{type(rotary).__name__} has no inv_freq buffer", layer_type, rope_type)
        inv = buf.detach().to(torch.float32).clone()
        return RotaryInfo(inv, 2 * inv.numel(), True, None, rope_type, layer_type, float(scaling))

    if rope_type in _STATIC_ROPE_TYPES:
        # Use the buffer forward() multiplies with (dtype included) so we mirror the model, not the math.
        return info(_attr(rotary, "inv_freq", layer_key))

    if "dynamic" in rope_type:
        # The module regrows inv_freq past max_position_embeddings and resets it only on a strictly shorter pass.
        limit = int(getattr(rotary, "original_max_seq_len", rotary.config.max_position_embeddings))
        if src_len is not None and dst_len is not None and max(src_len, dst_len) < limit:
            return info(_attr(rotary, "original_inv_freq", layer_key))
        return _not_exact(f"dynamic NTK RoPE: inv_freq depends on the pass length once it reaches "
                          f"max_position_embeddings={limit}; pass src_len/dst_len below it", layer_type, rope_type)

    if rope_type == "longrope":
        params = rotary.config.rope_parameters
        params = params[layer_type] if layer_key else params
        switch = int(params["original_max_position_embeddings"])
        if src_len is None or dst_len is None or (src_len > switch) != (dst_len > switch):
            return _not_exact(f"longrope: short/long factors switch once the pass length exceeds {switch}; "
                              f"src_len={src_len}, dst_len={dst_len} must both be given and on one side",
                              layer_type, rope_type)
        short = _attr(rotary, "original_inv_freq", layer_key)
        if src_len <= switch:
            return info(short)
        long_inv = _attr(rotary, "long_inv_freq", layer_key)
        if long_inv is None:
            # Not cached until the model first sees a long pass; build it exactly as dynamic_rope_update does.
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, short.device, seq_len=switch + 1,
                                                          layer_type=layer_key)
        # forward() copies it into the inv_freq buffer, so it takes that buffer's dtype first.
        return info(long_inv.to(short.dtype))

    return _not_exact(f"rope_type {rope_type!r} is not known to be exactly re-rotatable", layer_type, rope_type)


def rotary_info_for(model: nn.Module, *, src_len: int | None = None, dst_len: int | None = None) -> list[RotaryInfo]:
    """One RotaryInfo per decoder layer from the model's rotary module; exact=False rather than raising."""
    decoder = decoder_of(model)
    config = getattr(decoder, "config", None) or model.config.get_text_config()
    layers = getattr(decoder, "layers", None)
    n_layers = len(layers) if layers is not None else int(config.num_hidden_layers)
    shared = getattr(decoder, "rotary_emb", None)
    layer_types = getattr(config, "layer_types", None)
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3/Llama4: 1 = RoPE layer, 0 = NoPE layer

    infos: list[RotaryInfo] = []
    checked: dict[int, str | None] = {}  # model-level verdict per rotary module
    for i in range(n_layers):
        layer_type = layer_types[i] if layer_types else None
        # A few architectures give each attention block its own rotary module; prefer it when present.
        attn = getattr(layers[i], "self_attn", None) if layers is not None else None
        rotary = getattr(attn, "rotary_emb", None) or shared
        if id(rotary) not in checked:
            checked[id(rotary)] = _model_level_reason(rotary, config)
        reason = checked[id(rotary)]
        if reason is not None:
            infos.append(_not_exact(reason, layer_type))
        elif layer_type is not None and layer_type not in _ATTENTION_LAYER_TYPES:
            infos.append(_not_exact(f"layer type {layer_type!r} has no post-RoPE key cache", layer_type))
        elif no_rope is not None and not no_rope[i]:
            # Empty, but on the model's device like every other layer's inv_freq (callers move them together).
            device = next(model.parameters()).device
            infos.append(RotaryInfo(torch.empty(0, device=device), 0, True, None, "none", layer_type))
        else:
            infos.append(_layer_info(rotary, layer_type, src_len, dst_len))
    return infos


def rotation_support(model: nn.Module, *, src_len: int | None = None,
                     dst_len: int | None = None) -> tuple[list[RotaryInfo] | None, str | None]:
    """Per-layer rotary settings when every layer's cached keys can be moved exactly; else (None, first reason)."""
    infos = rotary_info_for(model, src_len=src_len, dst_len=dst_len)
    if not infos:
        return None, "model has no decoder layers"
    for i, info in enumerate(infos):
        if not info.exact:
            return None, f"layer {i}: {info.reason}"
    return infos, None


def rerotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, info: RotaryInfo, *,
                  src_positions: int | torch.Tensor | None = None) -> torch.Tensor:
    """Rotate post-RoPE ``keys`` [..., kv_heads, n_tokens, head_dim] from p to p + delta (int/[n_tokens]).
    Float32 math, result in ``keys.dtype``; ``src_positions`` rebuilds the model's own angles (closer far out)."""
    if not info.exact:
        raise ModelNotSupportedError(f"keys are not exactly re-rotatable: {info.reason}")
    n_tokens, head_dim, rd = keys.shape[-2], keys.shape[-1], info.rotary_dim
    if rd % 2 or rd > head_dim:
        raise ValueError(f"rotary_dim={rd} does not fit head_dim={head_dim}")
    dev = keys.device
    delta_t = torch.as_tensor(delta, device=dev)
    if delta_t.ndim == 0:
        delta_t = delta_t.reshape(1)  # broadcasts over tokens
    elif delta_t.shape != (n_tokens,):
        raise ValueError(f"delta must be a scalar or shape ({n_tokens},), got {tuple(delta_t.shape)}")
    if delta_t.is_floating_point() and not torch.equal(delta_t, delta_t.round()):
        raise ValueError("delta must be integral (positions are integers)")
    if rd == 0:
        return keys.clone()

    inv = info.inv_freq.to(device=dev, dtype=torch.float32)
    if src_positions is None:
        angle = delta_t.to(torch.float32)[:, None] * inv
        cos, sin = angle.cos(), angle.sin()
    else:
        src = torch.as_tensor(src_positions, device=dev).to(torch.int64)
        if src.ndim == 0:
            src = src + torch.arange(n_tokens, device=dev)  # a start position: tokens are contiguous
        if src.shape != (n_tokens,):
            raise ValueError(f"src_positions must be an int or shape ({n_tokens},), got {tuple(src.shape)}")
        dst = src + delta_t.to(torch.int64)
        # Same float32 products the rotary module forms, then cos/sin of the difference via the identities.
        a_src = src.to(torch.float32)[:, None] * inv
        a_dst = dst.to(torch.float32)[:, None] * inv
        cs, ss, cd, sd = a_src.cos(), a_src.sin(), a_dst.cos(), a_dst.sin()
        cos, sin = cd * cs + sd * ss, sd * cs - cd * ss
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    k = keys.to(torch.float32)
    rot = k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin
    out = torch.cat((rot, k[..., rd:]), dim=-1) if rd < head_dim else rot
    return out.to(keys.dtype)
