"""Linear layers over a few token rows on a CPU: W @ x^T instead of x @ W^T.

A forward of 2-8 token rows (a speculative verify, a batched decode step, a short suffix) multiplies each of the
model's weights by a thin matrix. The BLAS in torch's CPU builds (MKL) runs x @ W^T for such a thin x at one
thread and at 1.5-2x the time of a single row, whereas W @ x^T streams the weights once and threads. Measured
on SmolLM2-135M's 211 weights (fp32, torch 2.13 + MKL, AMD EPYC, 2 cores; all Linear products of one forward,
best of 3): 2 rows 21.6 ms instead of 41.1 at 1 thread and 15.1 instead of 43.9 at 2; 4 rows 26.5 / 43.3 and
15.2 / 45.4; 8 rows 55.2 / 52.5 and 31.7 / 41.1; 9 rows and more, and 1 row, gain nothing.

Numerics: both forms are matrix products whose per-element sums run in another order, so rows of 2-8 round
differently than before, as they already did from a 1-row product (a matrix-vector product, left untouched:
a plain decode step is bit-identical to the model's own). The choice depends on the row count alone, never on
timing, and is installed on the model's nn.Linear modules rather than around some forwards, so every path
(workspace, block table, streamed layers, the runner's steps, the model's own forward) computes the same rows
the same way.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = range(2, 9)  # row counts computed as W @ x^T
MODES = ("auto", "on", "off")
_MARK = "_kvboost_few_rows"  # set on a module whose forward this module replaced


def _few_row_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (rows not in FEW_ROWS or x.dtype != module.weight.dtype or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))):
        return F.linear(x, module.weight, module.bias)
    out = torch.mm(module.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()  # [rows, out_features]
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], module.out_features)


def few_rows_reason(model: nn.Module) -> str | None:
    """Why W @ x^T does not apply to this model (None: it does)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type} (CPU BLAS only)"
    if param.dtype != torch.float32:
        return f"the model is {str(param.dtype).removeprefix('torch.')} (measured for float32 only)"
    if not torch.backends.mkl.is_available():
        return "torch was built without MKL (measured with MKL only)"
    return None


def install_few_rows(mode: str, model: nn.Module) -> str:
    """Apply EngineConfig.few_row_linear to the model's nn.Linear modules; returns what was done and why.
    "auto": where few_rows_reason finds nothing against it; "on": the same, refused with a ValueError where it
    does not apply; "off": the model's own products (undoing an earlier engine's install on the same model)."""
    if mode not in MODES:
        raise ValueError(f"few_row_linear must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        uninstall_few_rows(model)
        return "off"
    reason = few_rows_reason(model)
    if reason is not None:
        if mode == "on":
            raise ValueError(f"few_row_linear='on': {reason}")
        uninstall_few_rows(model)
        return f"off: {reason}"
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses (quantized layers) keep their own forward
            if not getattr(module, _MARK, False):
                module.forward = functools.partial(_few_row_forward, module)
                setattr(module, _MARK, True)
            count += 1
    return f"W @ x^T for {FEW_ROWS.start}-{FEW_ROWS.stop - 1} rows in {count} Linear layers"


def uninstall_few_rows(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward  # the instance attribute: the class's forward is seen again
            delattr(module, _MARK)


@contextmanager
def model_own_products(model: nn.Module) -> Iterator[None]:
    """The model's own Linear products inside the block (e.g. a plain-transformers baseline on the same model
    object), the engine's choice again after it."""
    installed = [m for m in model.modules() if getattr(m, _MARK, False)]
    uninstall_few_rows(model)
    try:
        yield
    finally:
        for module in installed:
            module.forward = functools.partial(_few_row_forward, module)
            setattr(module, _MARK, True)
