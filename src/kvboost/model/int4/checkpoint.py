"""Hugging Face folders quantized by AWQ (GEMM) or GPTQ, loaded with their Linear layers as Int4Linear, no float copy.

Formats, from the packers' definitions (AutoAWQ's and AutoGPTQ's), W^T [in, out] = (q - z[group]) * s[group]:
- AWQ GEMM: qweight int32 [in, out / 8], eight 4-bit codes per int32 along the outputs in the order
  0, 2, 4, 6, 1, 3, 5, 7; qzeros int32 [in / g, out / 8] packed the same way; scales [in / g, out].
- GPTQ: qweight int32 [in / 8, out], codes packed along the inputs in order; qzeros int32 [in / g, out / 8] packed
  along the outputs in order, holding z - 1 (checkpoint_format "gptq", AutoGPTQ's) or z ("gptq_v2"); scales
  [in / g, out]; g_idx [in] the group of each input: act-order (a permuted g_idx) is refused.
In Int4Weights' convention w = (q - 8) * s + zero, so zero = (8 - z) * s.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .install import install_int4
from .weights import Int4Weights

METHODS = ("awq", "gptq")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column _AWQ_ORDER[i] of its eight
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_SHIFTS = 4 * torch.tensor([_AWQ_ORDER.index(c) for c in range(8)], dtype=torch.int32)  # column c's nibble


def quantization_config(folder: str | Path) -> dict | None:
    """The folder's config.json quantization_config, or None (no folder, no config, not quantized)."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()).get("quantization_config") if path.is_file() else None


def _unpack(packed: torch.Tensor, dim: int, shifts: torch.Tensor = _SHIFTS) -> torch.Tensor:
    """int32 [..] -> its eight 4-bit codes per value in `shifts`' order (nibble 0 first), along `dim` (uint8)."""
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 0:  # [rows, cols, 8] -> [rows * 8, cols]
        return codes.permute(0, 2, 1).reshape(-1, packed.shape[1]).to(torch.uint8)
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def _to_ours(q_t: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> Int4Weights:
    """W^T codes [in, out], zeros and scales [in / g, out] -> Int4Weights of W [out, in]."""
    scales = s.float()
    return Int4Weights(q_t.t().contiguous(), scales.t().contiguous(), ((8 - z.float()) * scales).t().contiguous(),
                       group)


def awq_weights(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Int4Weights:
    return _to_ours(_unpack(qweight, 1, _AWQ_SHIFTS), _unpack(qzeros, 1, _AWQ_SHIFTS), scales, group)


def gptq_weights(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
                 g_idx: torch.Tensor | None = None, v2: bool = False) -> Int4Weights:
    codes = _unpack(qweight, dim=0)  # [in, out]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(codes.shape[0]) // group):
        raise ValueError("GPTQ act-order (desc_act, a permuted g_idx) is not supported: quantize with desc_act=False")
    return _to_ours(codes, _unpack(qzeros, dim=1).to(torch.int16) + (0 if v2 else 1), scales, group)  # gptq: z - 1


def load_quantized(folder: str | Path, config: dict, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> nn.Module:
    """The causal LM in `folder` (config.json with an AWQ / GPTQ quantization_config, safetensors weights) in host
    memory, its quantized Linear layers as Int4Linear built for `device` and every other tensor as stored (in
    `dtype`)."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    method, bits, group = config.get("quant_method"), config.get("bits"), config.get("group_size")
    if method not in METHODS or bits != 4:
        raise ValueError(f"quantization {method!r} with {bits} bits: KVBoost loads 4-bit {' / '.join(METHODS)}")
    if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {config.get('version')!r}: only the GEMM layout is supported")
    if method == "gptq" and config.get("desc_act"):
        raise ValueError("GPTQ act-order (desc_act) is not supported: quantize with desc_act=False")
    hf_config = AutoConfig.from_pretrained(folder)
    del hf_config.quantization_config
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (RoPE) real
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tensors = {k: v for file in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(file).items()}

    def quantized():
        for name in [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]:
            parts = [tensors.pop(f"{name}.{k}") for k in ("qweight", "qzeros", "scales")]
            g_idx = tensors.pop(f"{name}.g_idx", None)
            bias = tensors.pop(f"{name}.bias", None)
            if bias is not None:
                model.get_submodule(name).bias = nn.Parameter(bias.to(dtype), requires_grad=False)
            yield name, awq_weights(*parts, group) if method == "awq" else \
                gptq_weights(*parts, group, g_idx, v2=config.get("checkpoint_format") == "gptq_v2")

    install_int4(model, quantized(), device)
    return assign_rest(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, folder)


def assign_rest(model: nn.Module, tensors: dict[str, torch.Tensor], folder: str | Path) -> nn.Module:
    """Give a model built on the meta device (its quantized layers already real) the rest of its tensors, tie its
    embeddings, and refuse it if any parameter is still missing; returns it in eval mode."""
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{folder}: no tensor for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return model.eval()
