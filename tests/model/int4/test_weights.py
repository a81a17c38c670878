"""model/int4/weights.py: GGUF Q4_0 / Q4_1 blocks decode to gguf-py's own dequantization (the format's reference
implementation), round to nearest stays within half a step, and malformed shapes are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvboost.model.int4.weights import Int4Weights


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_decode_to_gguf_pys_dequantization(kind):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 2, (48, 1))).astype(np.float32)
    weight[3, :32] = 0.5  # a constant block
    qtype = GGMLQuantizationType[kind]
    blocks = quantize(weight, qtype)  # uint8 [48, 256 / 32 * block bytes]
    got = Int4Weights.from_gguf(kind, blocks, weight.shape)
    assert got.group == 32 and got.codes.dtype == torch.uint8 and int(got.codes.max()) <= 15
    want = torch.from_numpy(dequantize(blocks, qtype).reshape(weight.shape))
    torch.testing.assert_close(got.dequantize(), want, rtol=1e-6, atol=1e-6)
    assert (got.dequantize() - torch.from_numpy(weight)).abs().max() < 0.5  # and it is the weight, roughly


def test_round_to_nearest_is_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(64, 384) * torch.rand(64, 1)
    weight[0, :128] = 1.25  # a constant group: exact
    q = Int4Weights.quantize_rtn(weight, group=128)
    assert q.shape == (64, 384) and q.scales.shape == (64, 3) and int(q.codes.max()) <= 15
    step = q.scales.repeat_interleave(128, dim=1)
    error = (q.dequantize() - weight).abs()
    assert bool((error <= step / 2 + 1e-6).all())
    torch.testing.assert_close(q.dequantize()[0, :128], weight[0, :128])


def test_malformed_weights_are_refused():
    codes = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group 48"):
        Int4Weights(codes, torch.ones(8, 1), torch.zeros(8, 1), 48)
    with pytest.raises(ValueError, match="scales"):
        Int4Weights(codes, torch.ones(8, 3), torch.zeros(8, 3), 32)
    with pytest.raises(ValueError, match="divide"):
        Int4Weights.quantize_rtn(torch.randn(8, 96), group=64)
    with pytest.raises(ValueError, match="Q8_0"):
        Int4Weights.from_gguf("Q8_0", np.zeros((8, 34), np.uint8), (8, 32))
