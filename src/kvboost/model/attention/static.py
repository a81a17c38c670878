"""The attention of the runner's static steps (model/runner.py): ends travel as a forward keyword argument.

A static step hands attention the whole workspace buffer [B, kv_heads, capacity, d] and a device tensor of each
row's valid end. Two things keep such a step free of host values, which a CUDA graph and torch.compile both
need (a host value read inside a compiled step is a guard that recompiles at every new position):

* the ends reach the attention function as the `kvboost_ends` keyword argument, which transformers forwards
  from the model's forward to every attention call (as it does flash-attention's kwargs); no thread-local
  state is read, so dynamo traces the call like any other;
* KVBOOST_STATIC is registered in AttentionInterface but not in AttentionMaskInterface, so transformers builds
  no mask at all (masking_utils returns None early for such implementations) and never asks the cache for its
  host-side length. Causality and the valid length come from the ends alone (backend.py's semantics).

Only plain causal attention runs here: runner.static_path_unsupported_reason keeps sliding-window, softcap and
length-dependent RoPE models off the static path, and anything else that would need a mask raises.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from .backend import dispatch
from .reference import sdpa_attention
from .switch import switched_attention

KVBOOST_STATIC = "kvboost_static"
_NEEDS_MASK = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias")


def static_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: query [B, Hq, q, d] over the whole buffers key/value [B, Hkv, capacity, d];
    kwargs["kvboost_ends"] [B] int32. Returns ([B, q, Hq, d], None)."""
    ends = kwargs.get("kvboost_ends")
    exact = kwargs.get("kvboost_exact_views", False)  # the buffers are views of exactly the valid keys
    if ends is None and not exact:
        raise ValueError(f"{KVBOOST_STATIC} attention needs the kvboost_ends keyword argument (a static step)")
    unsupported = [name for name in _NEEDS_MASK if kwargs.get(name) is not None]
    if attention_mask is not None or unsupported or is_causal is False or (module.training and dropout):
        raise NotImplementedError(f"a static step runs plain causal attention only, not {unsupported or 'a mask'}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if exact:  # every key is valid and bottom-right causal needs no mask (the compiled CPU decode step)
        out = sdpa_attention(query, key, value, scale=scale)
    elif torch.compiler.is_compiling():  # compiled steps run on CPU (runner.py): the SDPA path, traced directly
        out = sdpa_attention(query, key, value, scale=scale, ends=ends)
    else:
        out, _, _ = dispatch(query, key, value, lengths=ends, scale=scale, backend=kwargs.get("kvboost_backend"))
    return out.transpose(1, 2), None


AttentionInterface.register(KVBOOST_STATIC, static_attention_forward)


@contextmanager
def static_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model attends with KVBOOST_STATIC; pass kvboost_ends (and optionally
    kvboost_backend: "triton" / "sdpa") to the model's forward."""
    with switched_attention(model, KVBOOST_STATIC):
        yield
