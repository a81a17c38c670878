"""Int8Head: the output projection of an INT4 model as int8 rows with one scale each, on the CPU.

The head is the largest matrix a small model reads per decode step (SmolLM2-135M: 49,152 x 576, 113 MB in fp32, twice
its INT4 layers' bytes), and torch's `_weight_int8pack_mm` reads it as int8 with bfloat16 activations in a fifth of the
fp32 product's time. One scale per vocabulary row (the kernel's layout) is coarser than a GGUF's Q8_0 blocks of 32;
docs/weights.md gives the measured agreement with the float head.
"""
from __future__ import annotations

import torch
from torch import nn


class Int8Head(nn.Module):
    """y = x @ W^T with W [out, in] held as int8 codes and a bfloat16 scale per row (W ~ codes * scale)."""

    weight_format = "int8-row"  # model_fingerprint tells quantized heads apart by it

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.device.type != "cpu":
            raise ValueError(f"Int8Head runs on the CPU, the weight is on {weight.device}")
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        # The kernel takes bfloat16 scales: each is rounded up to one first and the codes are rounded against it, so
        # a weight is off by half a step at most (rounding the scale after the codes would add up to 127 x 2^-8 more).
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny)
        rounded = scales.to(torch.bfloat16)
        rounded = torch.where(rounded.float() < scales, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)),
                              rounded)
        self.register_buffer("codes", torch.round(weight / rounded.float()[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", rounded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.codes, self.scales)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def quantize_head(model: nn.Module, device: torch.device | str = "cpu") -> bool:
    """Replace the float output projection of a model that runs on the CPU (`device`) by an Int8Head (the input
    embedding keeps its float weight, tied or not); False elsewhere, or where the head is not a float nn.Linear on the
    CPU."""
    head = model.get_output_embeddings()
    if torch.device(device).type != "cpu" or type(head) is not nn.Linear or head.bias is not None \
            or head.weight.device.type != "cpu":
        return False
    model.set_output_embeddings(Int8Head(head.weight))
    return True
