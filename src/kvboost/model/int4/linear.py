"""Int4Linear: a Linear layer over Int4Weights, computed without a float weight, by the kernel of the device it is built
for.

- cpu: torch's `_weight_int4pack_mm_for_cpu` over packed codes and bfloat16 scales and zeros; it is fast only with
  bfloat16 activations, so the input is rounded to bfloat16 and the output returned in the input's dtype.
- tinygemm (CUDA, the default): torch's `_weight_int4pack_mm` (sm80+, bfloat16 activations as on the CPU), where its
  tiles take the layer's shape and a GPU is there to lay the codes out.
- triton (CUDA, the fallback): KVBoost's W4A16 kernel (triton_w4a16.py) in the input's dtype with fp32 accumulation:
  any shape, any CUDA GPU, laid out without one; far slower (docs/weights.md has the measured rates).
A layer is built for a device but its tensors may sit elsewhere until the model moves there (host memory, for a
model whose layers stream to the device: model/weight_stream.py). Each layout is its kernel's, so a layer runs only on
the device type it was built for: anywhere else it refuses with the reason.
"""
from __future__ import annotations

import torch
from torch import nn

from .weights import Int4Weights

KERNELS = ("cpu", "triton", "tinygemm")
TINYGEMM_INNER_K_TILES = (8, 4, 2)  # tinygemm's tilings of K, widest first: K must be a multiple of 16 x one


def _tinygemm_tiles(out_features: int, in_features: int) -> int:
    """The widest K tiling of torch's int4 CUDA kernel that fits the layer (ValueError where none does)."""
    tiles = next((t for t in TINYGEMM_INNER_K_TILES if in_features % (16 * t) == 0), None)
    if out_features % 8 or tiles is None:
        raise ValueError(f"torch's int4 CUDA kernel needs outputs a multiple of 8 and inputs of 32; this layer is "
                         f"[{out_features}, {in_features}]")
    if not torch.cuda.is_available():
        raise ValueError("torch's int4 CUDA kernel lays its weights out on a CUDA device, and none is available")
    if torch.cuda.get_device_capability() < (8, 0):
        raise ValueError(f"torch's int4 CUDA kernel needs compute capability 8.0 (Ampere) or later; this GPU has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
    return tiles


def default_kernel(device_type: str, out_features: int, in_features: int) -> str:
    """cpu on a CPU; on CUDA torch's int4 kernel where it takes the layer, else the Triton kernel."""
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        raise ValueError(f"Int4Linear runs on cpu or cuda, not {device_type}")
    try:
        _tinygemm_tiles(out_features, in_features)
        return "tinygemm"
    except ValueError as why:
        from ..attention.support import triton_available

        if not triton_available():
            raise ValueError(f"{why}, and triton (the other CUDA kernel) is not installed") from None
        return "triton"


class Int4Linear(nn.Module):
    """y = x @ W^T + b with W held as packed INT4 codes, in the layout of `kernel` (default: the device's own)."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None = None,
                 device: torch.device | str | None = None, kernel: str | None = None):
        super().__init__()
        self.out_features, self.in_features = weights.shape
        self.group = weights.group
        self.weight_format = f"int4-g{weights.group}"  # model_fingerprint tells quantized models apart by it
        self.device_type = torch.device(device).type if device is not None else weights.codes.device.type
        self.kernel = kernel or default_kernel(self.device_type, self.out_features, self.in_features)
        if self.kernel not in KERNELS or (self.kernel == "cpu") != (self.device_type == "cpu"):
            raise ValueError(f"Int4Linear kernel {self.kernel!r} does not run on {self.device_type} "
                             f"(cpu: 'cpu'; cuda: 'triton' or 'tinygemm')")
        home = weights.codes.device  # the tensors stay where the weights are; model.to() moves them
        if self.kernel != "triton":
            if self.kernel == "cpu":
                packed = torch._convert_weight_to_int4pack_for_cpu(weights.codes.cpu().to(torch.int32), 1)
            else:
                tiles = _tinygemm_tiles(*weights.shape)
                codes = weights.codes.to("cuda")
                high_low = (codes[:, 0::2] << 4 | codes[:, 1::2]).contiguous()  # even k in the high nibble
                packed = torch._convert_weight_to_int4pack(high_low, tiles)
            self.register_buffer("packed", packed.to(home))
            pairs = torch.stack([weights.scales.t(), weights.zeros.t()], dim=-1)  # [in / g, out, 2]
            self.register_buffer("scales_and_zeros", pairs.to(torch.bfloat16).contiguous())
        else:
            from .triton_w4a16 import W4A16Weights

            laid_out = W4A16Weights(weights, home)
            for name in ("packed", "scales", "zeros"):  # [out, in / 2], then [out, in / group] twice
                self.register_buffer(name, getattr(laid_out, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != self.device_type or x.device != self.packed.device:
            raise ValueError(f"this Int4Linear's weights are laid out for {self.device_type}; it holds them on "
                             f"{self.packed.device} and got input on {x.device} (load the model on its device)")
        if self.kernel == "triton":
            from .triton_w4a16 import w4a16_matmul

            out = w4a16_matmul(x, self)
        else:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            mm = torch._weight_int4pack_mm_for_cpu if self.kernel == "cpu" else torch._weight_int4pack_mm
            out = mm(flat, self.packed, self.group, self.scales_and_zeros)
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"kernel={self.kernel}")


def weight_formats(model: nn.Module) -> list[str]:
    """The quantized formats of a model's layers (e.g. ["int4-g32", "int8-row"]); [] for float weights."""
    return sorted({m.weight_format for m in model.modules() if isinstance(getattr(m, "weight_format", None), str)})


def layout_mismatch(model: nn.Module, device_type: str) -> str | None:
    """Why a model's INT4 layers cannot run on `device_type` (built for another device's kernel), or None."""
    other = sorted({m.device_type for m in model.modules() if isinstance(m, Int4Linear)} - {device_type})
    if not other:
        return None
    return (f"the model's INT4 layers are laid out for {', '.join(other)} and the engine runs on {device_type}: load "
            f"it for its device (load_model_and_tokenizer(..., device=...))")


def replace_linear(model: nn.Module, name: str, weights: Int4Weights, device: torch.device | str | None = None,
                   kernel: str | None = None) -> None:
    """Swap the nn.Linear at `name` (a module path) for an Int4Linear of `weights` built for `device` (default: where
    the weights are) and `kernel` (default: the device's), keeping its bias."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != weights.shape:
        raise ValueError(f"{name}: expected an nn.Linear of shape {weights.shape}, found {old}")
    setattr(parent, child, Int4Linear(weights, old.bias, device, kernel))
