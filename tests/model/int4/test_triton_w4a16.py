"""model/int4/triton_w4a16.py (Triton's interpreter without a GPU): the W4A16 product equals x @ dequantized(W)^T on
every shape class the models use in small (decode's single row, prefill rows, N and K off the tile sizes, groups of
32 and 128), in fp32 (IEEE, tight) and fp16 / bf16 (fp32 accumulation, half-precision inputs)."""
from __future__ import annotations

import pytest
import torch

from kvboost.model.int4.weights import Int4Weights


@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (96, 160, 32), (40, 256, 128), (128, 96, 32)])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_w4a16_matches_the_dequantized_product(kernel_device, n, k, group, m):
    from kvboost.model.int4.triton_w4a16 import W4A16Weights, w4a16_matmul

    torch.manual_seed(n + k + m)
    weights = Int4Weights.quantize_rtn(torch.randn(n, k) * 0.1, group)
    packed = W4A16Weights(weights, kernel_device)
    reference = weights.dequantize().to(kernel_device)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 3e-2)):
        x = torch.randn(2, m, k, device=kernel_device).to(dtype)
        got = w4a16_matmul(x, packed)
        want = x.float() @ reference.t()
        assert got.shape == (2, m, n) and got.dtype == dtype
        assert (got.float() - want).abs().max() <= tol * max(want.abs().max().item(), 1.0), dtype


def test_pack_nibbles_low_then_high():
    from kvboost.model.int4.weights import pack_nibbles, unpack_nibbles

    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


def test_int4_linear_built_on_cuda_runs_the_triton_kernel(device):
    if device.type != "cuda":
        pytest.skip("an Int4Linear on CUDA needs a GPU (run with --device cuda)")
    from kvboost.model.int4.linear import Int4Linear

    weights = Int4Weights.quantize_rtn(torch.randn(96, 128) * 0.1, 32)
    on_gpu = Int4Weights(weights.codes.to(device), weights.scales.to(device), weights.zeros.to(device), 32)
    layer = Int4Linear(on_gpu, torch.randn(96, device=device))
    x = torch.randn(3, 128, device=device, dtype=torch.float16)
    want = x.float() @ weights.dequantize().to(device).t() + layer.bias.float()
    assert (layer(x).float() - want).abs().max() <= 2e-2 * want.abs().max()
    with pytest.raises(ValueError, match="laid out for cuda"):
        layer(x.cpu())


def test_a_cpu_int4_linear_moved_to_another_device_refuses(device):
    from kvboost.model.int4.linear import Int4Linear

    layer = Int4Linear(Int4Weights.quantize_rtn(torch.randn(32, 64), 32))
    with pytest.raises(ValueError, match="laid out for cpu"):
        layer(torch.randn(2, 64, dtype=torch.float64).to("meta"))
