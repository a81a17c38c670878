"""Int4Linear: a Linear layer over Int4Weights, computed without a float weight, by the kernel of the device the
weights were given on.

On a CPU, torch's `_weight_int4pack_mm_for_cpu` reads the packed codes and bfloat16 scales and zeros; it is fast only
with bfloat16 activations, so the input is rounded to bfloat16 and the output returned in the input's dtype. On CUDA,
KVBoost's Triton W4A16 kernel (triton_w4a16.py) in the input's dtype with fp32 accumulation. Each layout is its
kernel's, so a layer runs where it was built: moved to another device, it refuses with the reason.
"""
from __future__ import annotations

import torch
from torch import nn

from .weights import Int4Weights


class Int4Linear(nn.Module):
    """y = x @ W^T + b with W held as packed INT4 codes ([out, in / 2] uint8) and scales/zeros [in / g, out, 2]."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weights.shape
        self.group = weights.group
        self.weight_format = f"int4-g{weights.group}"  # model_fingerprint tells quantized models apart by it
        self.device_type = weights.codes.device.type
        if self.device_type == "cpu":
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(weights.codes.to(torch.int32), 1))
            pairs = torch.stack([weights.scales.t(), weights.zeros.t()], dim=-1)  # [in / g, out, 2]
            self.register_buffer("scales_and_zeros", pairs.to(torch.bfloat16).contiguous())
        elif self.device_type == "cuda":
            from .triton_w4a16 import W4A16Weights

            laid_out = W4A16Weights(weights, weights.codes.device)
            self.register_buffer("packed", laid_out.packed)  # [out, in / 2]
            self.register_buffer("scales", laid_out.scales)
            self.register_buffer("zeros", laid_out.zeros)
        else:
            raise ValueError(f"Int4Linear runs on cpu or cuda, the weights are on {self.device_type}")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type != self.device_type or x.device != self.packed.device:
            raise ValueError(f"this Int4Linear's weights are laid out for {self.device_type}; it holds them on "
                             f"{self.packed.device} and got input on {x.device} (load the model on its device)")
        if self.device_type == "cuda":
            from .triton_w4a16 import w4a16_matmul

            out = w4a16_matmul(x, self)
        else:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


def weight_formats(model: nn.Module) -> list[str]:
    """The quantized formats of a model's layers (e.g. ["int4-g32", "int8-row"]); [] for float weights."""
    return sorted({m.weight_format for m in model.modules() if isinstance(getattr(m, "weight_format", None), str)})


def replace_linear(model: nn.Module, name: str, weights: Int4Weights) -> None:
    """Swap the nn.Linear at `name` (a module path) for an Int4Linear of `weights`, keeping its bias."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != weights.shape:
        raise ValueError(f"{name}: expected an nn.Linear of shape {weights.shape}, found {old}")
    setattr(parent, child, Int4Linear(weights, old.bias))


def quantize_linears(model: nn.Module, group: int = 128, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Round every nn.Linear but those named in `skip` to INT4 (quantize_rtn); returns how many. A layer whose
    inputs the group does not divide stays float."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rpartition(".")[2] not in skip
             and m.in_features % group == 0]
    for name in names:
        replace_linear(model, name, Int4Weights.quantize_rtn(model.get_submodule(name).weight, group))
    return len(names)
