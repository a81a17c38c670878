"""Linear layers over few token rows on a CPU as W @ x^T, which the BLAS threads (MKL runs a thin x @ W^T on one
thread): 2-4 rows at one thread, 1-9 at 2+; bfloat16 and input-major weights keep F.linear. Row/thread counts decide."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ROWS_ONE_THREAD = range(2, 5)  # row counts computed as W @ x^T at one thread ...
ROWS_THREADED = range(1, 10)  # ... and at 2+ threads (9: a verify of the default 8 drafts)
CPU_LINEAR_MODES = ("auto", "on", "off")
_MARK = "_kvboost_cpu_linear"  # set on a module whose forward this module replaced


def uses_w_x(rows: int) -> bool:
    """Whether a product over `rows` token rows runs as W @ x^T (at torch's current thread count)."""
    return rows in (ROWS_THREADED if torch.get_num_threads() > 1 else ROWS_ONE_THREAD)


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a compiled step (fast_path="compiled"): inductor picks its own kernels
        return F.linear(x, module.weight, module.bias)
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (not uses_w_x(rows) or x.dtype != module.weight.dtype or x.device.type != "cpu"
            or not module.weight.is_contiguous()  # input-major: W @ x^T ran 4-15x slower than F.linear
            or (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))):
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # two equal columns: the threaded matrix product instead of the 1-thread matrix-vector one
        out = torch.mm(module.weight, torch.cat((flat, flat)).t())[:, 0].contiguous()  # [out_features]
    else:
        out = torch.mm(module.weight, flat.t()).t().contiguous()  # [rows, out_features]
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], module.out_features)


def cpu_linear_reason(model: nn.Module) -> str | None:
    """Why W @ x^T does not apply to this model (None: it does)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type} (CPU BLAS only)"
    if param.dtype != torch.float32:
        return f"the model is {str(param.dtype).removeprefix('torch.')} (measured for float32 only)"
    if not torch.backends.mkl.is_available():
        return "torch was built without MKL (measured with MKL only)"
    return None


def install_cpu_linear(mode: str, model: nn.Module) -> str:
    """Apply EngineConfig.cpu_linear to the model's nn.Linear modules; returns what was done and why."""
    reason = None if mode == "off" else cpu_linear_reason(model)
    if mode == "off" or reason is not None:
        uninstall_cpu_linear(model)
        return "off" if reason is None else f"off: {reason}"
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses (quantized layers) keep their own forward
            if not getattr(module, _MARK, False):
                module.forward = functools.partial(_forward, module)
                setattr(module, _MARK, True)
            count += 1
    return f"W @ x^T in {count} Linear layers for 2-4 rows at one thread, 1-9 rows at 2+ threads"


def uninstall_cpu_linear(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward  # the instance attribute: the class's forward is seen again
            delattr(module, _MARK)


@contextmanager
def model_own_products(model: nn.Module) -> Iterator[None]:
    """The model's own Linear products inside the block (same forward objects: compiled steps guard on identity)."""
    installed = {m: m.forward for m in model.modules() if getattr(m, _MARK, False)}
    uninstall_cpu_linear(model)
    try:
        yield
    finally:
        for module, forward in installed.items():
            module.forward = forward
            setattr(module, _MARK, True)
