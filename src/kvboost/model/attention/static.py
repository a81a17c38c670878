"""The attention of the runner's static steps: ends travel as the `kvboost_ends` forward keyword, so no host value is
read inside a step; KVBOOST_STATIC has no mask implementation, so transformers builds none. Plain causal only."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from .backend import dispatch
from .cast import in_kv_dtype
from .reference import sdpa_attention
from .switch import switched_attention

KVBOOST_STATIC = "kvboost_static"
_NEEDS_MASK = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias")


def static_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, q, d] over key/value [B, Hkv, capacity, d] to kwargs["kvboost_ends"] -> ([B, q, Hq, d], None)."""
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


AttentionInterface.register(KVBOOST_STATIC, in_kv_dtype(static_attention_forward))


@contextmanager
def static_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model attends with KVBOOST_STATIC; pass kvboost_ends to the model's forward."""
    with switched_attention(model, KVBOOST_STATIC):
        yield
