"""model/int4/checkpoint.py: AWQ (GEMM) and GPTQ tensors, packed here by the packers' definitions from hand-built codes,
decode to the plain dequantization W^T = (q - z) * s; a tiny llama saved as an AWQ / GPTQ folder loads through
from_pretrained with INT4 layers and computes what its dequantized float twin computes; act-order, other bit widths and
other AWQ layouts are refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kvboost import KVBoost
from kvboost.loading import load_model_and_tokenizer
from kvboost.model.int4.checkpoint import awq_weights, gptq_weights
from kvboost.model.int4.install import SiblingOutput
from kvboost.model.int4.linear import Int4Linear

from ...tiny_models import make_tiny_model

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes -> int32 [rows, cols / 8]: nibble i of packed column c holds column 8c + AWQ_ORDER[i]."""
    rows, cols = codes.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            packed[:, c] |= codes[:, 8 * c + AWQ_ORDER[i]].long() << (4 * i)
    return _int32(packed)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: [rows, cols] -> int32 [rows / 8, cols], nibble k of packed row r holds row 8r + k."""
    rows, cols = codes.shape
    packed = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for k in range(8):
        packed |= codes[k::8].long() << (4 * k)
    return _int32(packed)


def pack_cols(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros: [rows, cols] -> int32 [rows, cols / 8], nibble k of packed column c holds column 8c + k."""
    return pack_rows(codes.t().contiguous()).t().contiguous()


def _int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _hand_built(n_in: int = 64, n_out: int = 48, group: int = 32, seed: int = 0, lowest_zero: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n_in, n_out), generator=g)
    z = torch.randint(lowest_zero, 16, (n_in // group, n_out), generator=g)
    s = (torch.rand(n_in // group, n_out, generator=g) * 0.1 + 0.01).half()
    reference = (q - z.repeat_interleave(group, 0)).float() * s.float().repeat_interleave(group, 0)  # W^T
    return q, z, s, reference


def test_awq_tensors_decode_to_the_plain_dequantization():
    q, z, s, reference = _hand_built()
    weights = awq_weights(pack_awq(q), pack_awq(z), s, 32)
    torch.testing.assert_close(weights.dequantize(), reference.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_tensors_decode_to_the_plain_dequantization(v2):
    q, z, s, reference = _hand_built(seed=1, lowest_zero=1)  # v1 stores z - 1 in four bits
    stored = z if v2 else z - 1
    weights = gptq_weights(pack_rows(q), pack_cols(stored), s, 32, torch.arange(64) // 32, v2=v2)
    torch.testing.assert_close(weights.dequantize(), reference.t(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="act-order"):
        gptq_weights(pack_rows(q), pack_cols(stored), s, 32, torch.arange(64).flip(0) // 32)


def _save_quantized(model, tokenizer, folder, method: str, group: int = 32, **extra) -> dict[str, torch.Tensor]:
    """Quantize every Linear but the head to random-free RTN codes, save the folder in `method`'s layout; returns the
    dequantized weights the checkpoint stands for, by module name."""
    tensors, reference = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        w_t = module.weight.detach().t()  # [in, out]
        groups = w_t.reshape(-1, group, w_t.shape[1])
        low, high = groups.amin(1), groups.amax(1)
        s = ((high - low) / 15).clamp_min(1e-6).half()
        z = (-low / s.float()).round().clamp(1, 15).long()
        q = (w_t / s.float().repeat_interleave(group, 0) + z.repeat_interleave(group, 0)).round().clamp(0, 15).long()
        reference[name] = ((q - z.repeat_interleave(group, 0)).float() * s.float().repeat_interleave(group, 0)).t()
        if method == "awq":
            tensors.update({f"{name}.qweight": pack_awq(q), f"{name}.qzeros": pack_awq(z), f"{name}.scales": s})
        else:
            tensors.update({f"{name}.qweight": pack_rows(q), f"{name}.qzeros": pack_cols(z - 1), f"{name}.scales": s,
                            f"{name}.g_idx": (torch.arange(w_t.shape[0]) // group).to(torch.int32)})
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach().clone()
    for name, p in model.state_dict().items():
        tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
        if name.rsplit(".", 1)[0] not in reference and not tied_head:
            tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group, **extra}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(folder)
    return reference


@pytest.mark.parametrize("method,extra", [("awq", {"version": "gemm", "zero_point": True}),
                                          ("gptq", {"desc_act": False, "sym": False})])
def test_a_quantized_folder_loads_as_int4_and_computes_its_dequantized_twin(tokenizer, tmp_path, device, method,
                                                                            extra):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    reference = _save_quantized(model, tokenizer, tmp_path, method, **extra)
    with torch.no_grad():
        for name, weight in reference.items():
            model.get_submodule(name).weight.copy_(weight)  # the float twin
    model.to(device)
    engine = KVBoost.from_pretrained(str(tmp_path), device=str(device), dtype="float32", fast_path="off")
    projections = {n: m for n, m in engine.model.named_modules() if isinstance(m, (Int4Linear, SiblingOutput))
                   and not n.endswith(".fused")}
    assert sorted(projections) == sorted(reference)
    layers = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    assert {m.device_type for m in layers} == {device.type}  # laid out for the device's kernel
    ids = torch.tensor([[5, 9, 11, 300, 42, 7, 1000]], device=device)
    with torch.inference_mode():
        got, want = engine.model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999
    out = engine.generate("Hello there", max_new_tokens=5)
    assert out.generated_tokens == 5


def test_a_quantized_folder_streams_from_host_memory_without_ever_being_whole_on_the_device(tokenizer, tmp_path,
                                                                                            device):
    _save_quantized(make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=4), tokenizer, tmp_path,
                    "awq")
    resident = KVBoost.from_pretrained(str(tmp_path), device=str(device), dtype="float32", fast_path="off")
    want = [resident.generate(p, max_new_tokens=8).output_token_ids for p in ("Hello there", "Once upon a time")]
    layers = resident.model.model.layers
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    budget = nbytes(resident.model) - nbytes(layers) + 3 * (nbytes(layers[0]) + 64 * 16)  # two slots, one layer
    del resident
    if device.type == "cuda":  # loaded for the device into host memory: nothing reaches it yet
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        load_model_and_tokenizer(str(tmp_path), dtype="float32", device=str(device), on_host=True)
        assert torch.cuda.max_memory_allocated(device) == before
    engine = KVBoost.from_pretrained(str(tmp_path), device=str(device), dtype="float32", weight_budget_bytes=budget)
    assert engine.device.type == device.type
    if device.type == "cuda":  # the resident weights and the slots, within the budget
        on_device = sum(t.numel() * t.element_size() for t in [*engine.model.parameters(), *engine.model.buffers()]
                        if t.device.type == "cuda")
        weights = engine.cache_stats()["weights"]
        assert on_device + weights["slots"] * weights["slot_bytes"] <= budget
    stats = engine.cache_stats()["weights"]
    assert len(stats["resident_layers"]) == 1 and len(stats["streamed_layers"]) == 3
    assert [engine.generate(p, max_new_tokens=8).output_token_ids for p in ("Hello there", "Once upon a time")] \
        == want


def test_unsupported_quantizations_are_refused(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    for extra, match in (({"bits": 8}, "8 bits"), ({"version": "gemv"}, "GEMM layout")):
        _save_quantized(model, tokenizer, tmp_path, "awq")
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"].update(extra)
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            KVBoost.from_pretrained(str(tmp_path), device="cpu")
    _save_quantized(model, tokenizer, tmp_path, "gptq", desc_act=True)
    with pytest.raises(ValueError, match="act-order"):
        KVBoost.from_pretrained(str(tmp_path), device="cpu")
