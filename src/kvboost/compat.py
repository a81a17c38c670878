"""Which architectures can have their K/V reused correctly, and why the others cannot."""
from __future__ import annotations

import warnings

from .errors import ModelNotSupportedError

# RoPE decoder-only families whose HF implementations take position ids and cache K after rotation.
SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "PhiForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "StableLmForCausalLM",
    "InternLM2ForCausalLM", "InternLMForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
})
# Verified by this project's fidelity tests (tiny random models and SmolLM2).
TESTED_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
})
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "BloomForCausalLM": "BLOOM uses ALiBi: position enters as a bias on attention scores, not in the cached keys.",
    "FalconForCausalLM": "Falcon checkpoints may use ALiBi; stored K/V cannot be re-positioned.",
    "MPTForCausalLM": "MPT uses ALiBi: there is no rotary key to re-position.",
    "GPT2LMHeadModel": "GPT-2 adds learned absolute position embeddings to the input; positions are baked into "
                       "every hidden state, so K/V from another position is simply wrong.",
    "GPTNeoForCausalLM": "GPT-Neo uses learned absolute position embeddings.",
    "OPTForCausalLM": "OPT uses learned absolute position embeddings.",
    "GPTBigCodeForCausalLM": "GPTBigCode (StarCoder 1) uses learned absolute position embeddings.",
}


def check_model_compatibility(model, strict: bool = True) -> str:
    """'supported' / 'untested'; raises ModelNotSupportedError (a ValueError) in strict mode for known-bad ones."""
    arch = type(model).__name__
    if arch in UNSUPPORTED_ARCHITECTURES:
        message = f"{arch} is not supported by KVBoost: {UNSUPPORTED_ARCHITECTURES[arch]}"
        if strict:
            raise ModelNotSupportedError(message)
        warnings.warn(message + " (strict=False: continuing, outputs may be wrong)", stacklevel=3)
        return "unsupported"
    if arch not in SUPPORTED_ARCHITECTURES:
        message = (f"{arch} has not been tested with KVBoost; run engine.verify_correctness() before trusting "
                   "cached outputs.")
        warnings.warn(message, stacklevel=3)
        return "untested"
    if arch not in TESTED_ARCHITECTURES:
        warnings.warn(f"{arch} is expected to work but is not covered by KVBoost's fidelity tests; "
                      "engine.verify_correctness() checks it on your prompts.", stacklevel=3)
        return "untested"
    return "supported"


def has_sliding_layers(model) -> bool:
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any("sliding" in str(t) for t in layer_types)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False
