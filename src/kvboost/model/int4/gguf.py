"""A GGUF file's Q4_0 / Q4_1 Linear weights as Int4Linear layers, read from the file's blocks as stored.

Names map to the model's through transformers' GGUF tables, and rows are reordered as transformers reorders them
(llama's q/k projections are stored permuted for llama.cpp's RoPE): the permutation moves whole rows, so it applies
to the blocks before decoding. Other tensors (norms, the Q8_0 embedding) keep the model's float weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from .linear import replace_linear
from .weights import Int4Weights

FORMATS = ("Q4_0", "Q4_1")


def int4_linears_from_gguf(model: nn.Module, path: str | Path) -> int:
    """Replace every nn.Linear of `model` that the GGUF file at `path` stores as Q4_0 / Q4_1 by an Int4Linear of its
    stored codes; returns how many. `model` is the file's model (loaded from it, or from a conversion of it)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    replaced = 0
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name, "")
        if tensor.tensor_type.name not in FORMATS or not hf_name.endswith(".weight"):
            continue
        module_name = hf_name.removesuffix(".weight")
        if not isinstance(model.get_submodule(module_name), nn.Linear):
            continue  # a 4-bit embedding stays as loaded
        blocks = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first
        replace_linear(model, module_name, Int4Weights.from_gguf(tensor.tensor_type.name, blocks, shape))
        replaced += 1
    return replaced
