"""Re-rotation must reproduce what the model itself caches at the new position, for every RoPE flavour we accept.

Each check runs a tiny random model on the same ids at two position offsets and compares the cached post-RoPE
keys. Layers past 0 see attention outputs, which depend only on relative positions, so they must match too.
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf

from kvboost.errors import ModelNotSupportedError
from kvboost.model.cache_arg import returned_cache
from kvboost.reuse.rope import RotaryInfo, rerotate_keys, rotary_info_for, rotation_support

from ..devices import assert_on, current

ATOL = 1e-4
N_TOKENS = 12
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_THETA = 10000.0

CONFIGS = {
    "llama-default": lambda: tf.LlamaConfig(**_BASE),
    "llama-linear": lambda: tf.LlamaConfig(**_BASE, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": _THETA}),
    # original_max_position_embeddings=32 with head_dim 16 puts frequencies in all three llama3 bands.
    "llama-llama3": lambda: tf.LlamaConfig(**_BASE, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": _THETA}),
    "llama-yarn": lambda: tf.LlamaConfig(**_BASE, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": _THETA}),
    "qwen2": lambda: tf.Qwen2Config(**_BASE),
    "mistral": lambda: tf.MistralConfig(**_BASE, sliding_window=8),
    "phi3-partial": lambda: tf.Phi3Config(**_BASE, partial_rotary_factor=0.5),
    "stablelm-partial": lambda: tf.StableLmConfig(**_BASE, partial_rotary_factor=0.25),
    "gemma2": lambda: tf.Gemma2Config(**_BASE, head_dim=16, sliding_window=8),
    # Local and global layers with different theta and scaling: a shared inv_freq would fail layer 1.
    "gemma3-text": lambda: tf.Gemma3TextConfig(**_BASE, head_dim=16, sliding_window=8,
                                               layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters={
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": _THETA},
                                                   "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1e6}}),
    # Layer 3 is NoPE (no_rope_layer_interval=4): identity re-rotation.
    "smollm3-nope": lambda: tf.SmolLM3Config(**{**_BASE, "num_hidden_layers": 4}),
    "llama-dynamic": lambda: tf.LlamaConfig(**_BASE, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": _THETA}),
    "phi3-longrope": lambda: tf.Phi3Config(**_BASE, partial_rotary_factor=0.5, original_max_position_embeddings=32,
                                           rope_parameters={"rope_type": "longrope", "rope_theta": _THETA,
                                                            "short_factor": [1.0, 1.1, 1.3, 1.5],
                                                            "long_factor": [2.0, 2.5, 3.0, 4.0]}),
    "cohere-interleaved": lambda: tf.CohereConfig(**_BASE),
    "gpt2-learned": lambda: tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4),
}
EXACT = ["llama-default", "llama-linear", "llama-llama3", "llama-yarn", "qwen2", "mistral", "phi3-partial",
         "stablelm-partial", "gemma2", "gemma3-text", "smollm3-nope"]


def _model(name: str) -> torch.nn.Module:
    """The seeded model of CONFIGS[name] on the suite's device (built once per device)."""
    return _built(name, str(current()))


@functools.cache
def _built(name: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(CONFIGS[name]()).to(device).eval()


def _ids(device: torch.device) -> torch.Tensor:
    return torch.randint(3, 256, (1, N_TOKENS), generator=torch.Generator().manual_seed(1)).to(device)


@torch.no_grad()
def _keys(model: torch.nn.Module, positions: torch.Tensor | int) -> list[torch.Tensor]:
    """Post-RoPE cached keys of every layer, [1, kv_heads, n, head_dim], on the model's device."""
    if isinstance(positions, int):
        positions = torch.arange(N_TOKENS) + positions
    out = model(input_ids=_ids(model.device), position_ids=positions.to(model.device)[None], use_cache=True)
    return [layer.keys for layer in returned_cache(out).layers]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("p,q", [(3, 40), (40, 3), (0, 77)])
def test_rerotation_matches_model(name: str, p: int, q: int) -> None:
    model = _model(name)
    infos, reason = rotation_support(model)
    assert infos is not None and reason is None
    infos = rotary_info_for(model)
    keys_p, keys_q = _keys(model, p), _keys(model, q)
    assert len(infos) == len(keys_p)
    for layer, (info, kp, kq) in enumerate(zip(infos, keys_p, keys_q)):
        assert info.exact and info.reason is None
        moved = rerotate_keys(kp, q - p, info)
        assert moved.shape == kp.shape and moved.dtype == kp.dtype
        assert_on(model.device, moved, info.inv_freq)
        assert _err(moved, kq) < ATOL, (name, layer)
        # The absolute-position path must agree as well.
        assert _err(rerotate_keys(kp, q - p, info, src_positions=p), kq) < ATOL, (name, layer)
        if info.rotary_dim:  # guard against a vacuous pass: keys really did move
            assert _err(kp, kq) > 1e-2, (name, layer)


def test_rotary_dims_follow_model_settings() -> None:
    assert [i.rotary_dim for i in rotary_info_for(_model("phi3-partial"))] == [8, 8]
    assert [i.rotary_dim for i in rotary_info_for(_model("stablelm-partial"))] == [4, 4]
    assert [i.rotary_dim for i in rotary_info_for(_model("smollm3-nope"))] == [16, 16, 16, 0]
    yarn = rotary_info_for(_model("llama-yarn"))[0]
    assert yarn.rope_type == "yarn" and yarn.attention_scaling > 1.1  # mscale is in the keys, not re-applied


def test_gemma3_uses_per_layer_frequencies() -> None:
    model = _model("gemma3-text")
    local, global_ = rotary_info_for(model)
    assert (local.layer_type, global_.layer_type) == ("sliding_attention", "full_attention")
    assert (local.rope_type, global_.rope_type) == ("default", "linear")
    assert not torch.allclose(local.inv_freq, global_.inv_freq)
    kp, kq = _keys(model, 3)[1], _keys(model, 40)[1]
    assert _err(rerotate_keys(kp, 37, local), kq) > 1e-2  # the wrong layer's frequencies are caught


@pytest.mark.parametrize("name", ["llama-yarn", "phi3-partial"])
def test_per_token_delta(name: str) -> None:
    model = _model(name)
    info = rotary_info_for(model)[0]
    src = torch.arange(N_TOKENS, device=model.device) + 2
    dst = torch.tensor([50, 51, 53, 54, 60, 61, 62, 70, 71, 72, 73, 90], device=model.device)
    moved = rerotate_keys(_keys(model, src)[0], dst - src, info)
    assert _err(moved, _keys(model, dst)[0]) < ATOL
    moved = rerotate_keys(_keys(model, src)[0], dst - src, info, src_positions=src)
    assert _err(moved, _keys(model, dst)[0]) < ATOL


def test_large_positions_absolute_path_is_tighter() -> None:
    # fp32 rounds p * inv_freq; delta * inv_freq does not reproduce that rounding, src_positions does.
    model = _model("llama-default")
    info = rotary_info_for(model)[0]
    p, q = 100_000, 7
    kp, kq = _keys(model, p)[0], _keys(model, q)[0]
    assert _err(rerotate_keys(kp, q - p, info, src_positions=p), kq) < 1e-6
    assert _err(rerotate_keys(kp, q - p, info), kq) < 5e-3


def test_bf16_keys_round_trip_dtype() -> None:
    model = _model("llama-default")
    info = rotary_info_for(model)[0]
    kp, kq = _keys(model, 3)[0], _keys(model, 40)[0]
    moved = rerotate_keys(kp.bfloat16(), 37, info)
    assert moved.dtype == torch.bfloat16
    assert _err(moved, kq) < 1e-2


def test_rerotate_basic_properties(device) -> None:
    info = rotary_info_for(_model("phi3-partial"))[0]
    keys = torch.randn(2, 3, 5, 16).to(device)
    same = rerotate_keys(keys, 0, info)
    assert same is not keys and same.data_ptr() != keys.data_ptr()
    assert _err(same, keys) < 1e-6
    assert _err(rerotate_keys(rerotate_keys(keys, 123, info), -123, info), keys) < 1e-5
    assert torch.equal(rerotate_keys(keys, 9, info)[..., 8:], keys[..., 8:])  # pass-through dims untouched
    assert _err(rerotate_keys(keys, torch.tensor(9, device=device), info), rerotate_keys(keys, 9, info)) == 0
    with pytest.raises(ValueError):
        rerotate_keys(keys, torch.arange(4, device=device), info)  # wrong number of per-token deltas
    nope = RotaryInfo(torch.empty(0), 0, True)
    assert torch.equal(rerotate_keys(keys, 5, nope), keys)


def test_keys_and_deltas_on_another_device_than_the_model(device) -> None:
    """A record from a CPU tier is re-rotated where its keys live, with the model's (device) frequencies."""
    info = rotary_info_for(_model("llama-default"))[0]
    keys = torch.randn(1, 2, 5, 16)
    on_cpu = rerotate_keys(keys, torch.full((5,), 3, device=device), info, src_positions=2)
    assert_on("cpu", on_cpu)
    on_device = rerotate_keys(keys.to(device), 3, info, src_positions=torch.arange(2, 7))
    assert_on(device, on_device)
    assert _err(on_cpu, on_device.cpu()) < 1e-5


def test_dynamic_ntk_is_not_exact(device) -> None:
    model = _model("llama-dynamic")
    infos, reason = rotation_support(model)
    assert infos is None and "dynamic" in reason
    assert all(not i.exact for i in rotary_info_for(model))
    with pytest.raises(ModelNotSupportedError):
        rerotate_keys(torch.randn(1, 2, 4, 16, device=device), 3, rotary_info_for(model)[0])
    # Crossing max_position_embeddings (128) changes the frequencies: refused, and rightly so.
    assert rotation_support(model, src_len=3 + N_TOKENS, dst_len=120 + N_TOKENS)[0] is None
    kp, k_long = _keys(model, 3)[0], _keys(model, 120)[0]
    short = rotary_info_for(model, src_len=3 + N_TOKENS, dst_len=40 + N_TOKENS)[0]
    assert _err(rerotate_keys(kp, 117, short), k_long) > 1e-3
    # Both passes strictly below the limit use the original frequencies (after the module reset itself).
    assert short.exact
    kq = _keys(model, 40)[0]
    assert _err(rerotate_keys(_keys(model, 3)[0], 37, short), kq) < ATOL


def test_longrope_exact_only_on_one_side_of_the_switch() -> None:
    model = _model("phi3-longrope")  # switch at original_max_position_embeddings = 32
    assert rotation_support(model)[0] is None
    assert rotation_support(model, src_len=3 + N_TOKENS, dst_len=40 + N_TOKENS)[0] is None
    both_short = rotary_info_for(model, src_len=0 + N_TOKENS, dst_len=15 + N_TOKENS)[0]
    # Computed before any long pass, so the long factors come from ROPE_INIT_FUNCTIONS, not the module cache.
    both_long = rotary_info_for(model, src_len=30 + N_TOKENS, dst_len=90 + N_TOKENS)[0]
    assert both_short.exact and both_long.exact and both_short.rotary_dim == 8
    assert not torch.allclose(both_short.inv_freq, both_long.inv_freq)
    assert both_short.attention_scaling > 1.0

    assert _err(rerotate_keys(_keys(model, 0)[0], 15, both_short), _keys(model, 15)[0]) < ATOL
    k30, k90 = _keys(model, 30)[0], _keys(model, 90)[0]
    assert _err(rerotate_keys(k30, 60, both_long), k90) < ATOL
    assert _err(rerotate_keys(k90, -60, both_long), k30) < ATOL
    cached = rotary_info_for(model, src_len=30 + N_TOKENS, dst_len=90 + N_TOKENS)[0]  # now from the module
    assert torch.equal(cached.inv_freq, both_long.inv_freq)
    # Crossing the switch: no single rotation relates the two, which is why it is refused.
    assert _err(rerotate_keys(_keys(model, 0)[0], 90, both_short), k90) > 1e-3


@pytest.mark.parametrize("name,needle", [("cohere-interleaved", "rotate_half"), ("gpt2-learned", "rotary_emb")])
def test_unsupported_layouts_are_refused(name: str, needle: str) -> None:
    infos, reason = rotation_support(_model(name))
    assert infos is None and needle in reason
