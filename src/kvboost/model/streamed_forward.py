"""Run a forward of a sequence whose K/V lives in a host workspace (contexts longer than the device holds). A
forward that raises leaves the sequence as it was before it."""
from __future__ import annotations

import torch

from ..kv.host_stream import HostStreamCache
from ..kv.host_workspace import HostWorkspace
from .forward import forward_tokens


def streamed_forward(model: torch.nn.Module, host: HostWorkspace, tokens: list[int] | torch.Tensor, start: int,
                     all_logits: bool = False, attention: str = "model") -> torch.Tensor:
    """float32 logits ([vocab], or [n, vocab] with all_logits) of `tokens` at [start, start + n) of `host`."""
    n = tokens.shape[-1] if isinstance(tokens, torch.Tensor) else len(tokens)
    if n == 0:
        raise ValueError("a forward needs at least one token")
    cache = HostStreamCache(host, start, n)
    try:
        with torch.no_grad():  # K/V written into the host buffers must not carry autograd history
            logits = forward_tokens(model, tokens, cache, logits_to_keep=n if all_logits else 1, attention=attention)[0]
    except BaseException:
        cache.finish(ok=False)
        raise
    cache.finish(ok=True)
    return logits if all_logits else logits[-1]
