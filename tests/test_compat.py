from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf

from kvboost import KVBoost, ModelNotSupportedError
from kvboost.compat import UNSUPPORTED_ARCHITECTURES, check_model_compatibility

from .tiny_models import make_tiny_model


def _gpt2():
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()


def test_learned_absolute_positions_rejected_in_strict_mode(tokenizer):
    with pytest.raises(ModelNotSupportedError, match="absolute position"):
        KVBoost(_gpt2(), tokenizer)
    assert issubclass(ModelNotSupportedError, ValueError)


def test_non_strict_only_warns():
    with pytest.warns(UserWarning, match="not supported"):
        assert check_model_compatibility(_gpt2(), strict=False) == "unsupported"


def test_alibi_families_have_reasons():
    for arch in ("BloomForCausalLM", "MPTForCausalLM", "FalconForCausalLM"):
        assert "ALiBi" in UNSUPPORTED_ARCHITECTURES[arch]


def test_tested_architecture_is_silent(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_model_compatibility(make_tiny_model("llama", tokenizer)) == "supported"


def test_untested_architecture_warns():
    torch.manual_seed(0)
    cfg = tf.StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2)
    with pytest.warns(UserWarning, match="verify_correctness"):
        assert check_model_compatibility(tf.StableLmForCausalLM(cfg)) == "untested"
