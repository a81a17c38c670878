"""A GGUF file's Q4_0 / Q4_1 Linear weights as Int4Linear layers, read from the file's blocks as stored.

Names map to the model's through gguf-py's tensor-name tables for the file's architecture, and rows are reordered as
transformers reorders them (llama's q/k projections are stored permuted for llama.cpp's RoPE): the permutation moves
whole rows, so it applies to the blocks before decoding. Other tensors (norms, the Q8_0 embedding) keep the model's
float weights. Parsing a GGUF takes seconds, so the decoded layers are kept in a safetensors file in a cache directory
(loading.py: $KVBOOST_CACHE_DIR/int4), keyed by the file's path, size and modification time.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .install import install_int4
from .weights import Int4Weights, pack_nibbles, unpack_nibbles

log = logging.getLogger(__name__)
FORMATS = ("Q4_0", "Q4_1")
CACHE_FORMAT = 1  # bump when what the cache file holds changes
PARTS = ("codes", "scales", "zeros", "group")  # a cached layer's tensors, each named "{layer}.{part}"


def int4_linears_from_gguf(model: nn.Module, path: str | Path, cache_dir: Path,
                           device: torch.device | str = "cpu") -> int:
    """Replace every nn.Linear of `model` that the GGUF file at `path` stores as Q4_0 / Q4_1 by an Int4Linear of its
    stored codes, built for `device` (its tensors stay in host memory); returns how many. `model` is the file's model
    (loaded from it, or from a conversion of it). cache_dir: where decoded layers are kept ($KVBOOST_CACHE_DIR/int4
    when loading.py calls)."""
    import xxhash
    from safetensors.torch import load_file, save_file

    path = Path(path)
    stat = path.resolve().stat()
    key = xxhash.xxh3_64_hexdigest(f"{CACHE_FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    cache = cache_dir / f"{path.stem}-{key}.safetensors"
    tensors = None
    if cache.exists():
        try:
            tensors = load_file(str(cache))
            names = [k.removesuffix(".codes") for k in tensors if k.endswith(".codes")]
            missing = {f"{name}.{part}" for name in names for part in PARTS} - tensors.keys()
            if missing:
                raise KeyError(min(missing))
        except Exception as exc:  # unreadable, or a layer's part missing: decoded again and rewritten
            log.warning("kvboost: INT4 cache %s unreadable (%s); decoding %s again", cache, exc, path)
            tensors = None
    if tensors is None:
        tensors, names = {}, []
        for name, w in _decode(model, path):  # one layer decoded at a time
            names.append(name)
            tensors.update({f"{name}.codes": pack_nibbles(w.codes), f"{name}.scales": w.scales.contiguous(),
                            f"{name}.zeros": w.zeros.contiguous(), f"{name}.group": torch.tensor([w.group])})
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.stem}.{os.getpid()}.partial")
        save_file(tensors, str(partial))
        partial.replace(cache)  # atomic: a reader never sees half a file

    def unpacked():  # one layer at a time, its tensors popped: the peak stays near the packed bytes
        for name in names:
            codes, scales, zeros, group = (tensors.pop(f"{name}.{part}") for part in PARTS)
            yield name, Int4Weights(unpack_nibbles(codes), scales, zeros, int(group))

    return install_int4(model, unpacked(), device)


def _decode(model: nn.Module, path: Path) -> Iterator[tuple[str, Int4Weights]]:
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"{path}: gguf-py does not know the architecture {arch_name!r}")
    names = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    linears = {f"{names.get_name(n)}.weight": n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and names.get_name(n) is not None}
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=model.config.to_dict())
    for tensor in reader.tensors:
        module_name = linears.get(tensor.name)
        if module_name is None or tensor.tensor_type.name not in FORMATS:
            continue
        blocks = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first
        yield module_name, Int4Weights.from_gguf(tensor.tensor_type.name, blocks, shape)


def model_from_gguf(folder: str | Path, gguf: str | Path, cache_dir: Path, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> nn.Module:
    """The causal LM of `folder` (a float conversion of the GGUF file `gguf`: config and safetensors) with its Q4_0 /
    Q4_1 layers read from the GGUF and every other tensor from the folder, never building the float layers (peak
    memory: the INT4 model's, not the float one's). Built for `device`, in host memory."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from .checkpoint import assign_rest

    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (RoPE) real
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    int4_linears_from_gguf(model, gguf, cache_dir, device)
    wanted = {n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"}
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({k: handle.get_tensor(k).to(dtype) for k in handle.keys() if k in wanted})
    return assign_rest(model, tensors, folder)
