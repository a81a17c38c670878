"""The CPU batch-1 decode step compiled ahead of time (AOTInductor) into a package on disk, loaded in seconds.

torch.compile's frozen graphs (the packed GEMV kernels need the weights as constants) are never cached on disk, so
every load pays the compile; an AOTInductor package holds the compiled kernels and the packed weights and loads without
tracing. The step is the runner's: one token over the workspace's row-0 buffers [1, kv_heads, capacity, d], attending
to their first `end` columns and writing its K/V at `positions`. Capacity and end are the package's two dynamic axes
(a package built at one capacity silently misreads another's strides otherwise); `end` travels as the length of a
marker tensor, since a package takes tensors only.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from ..kv.static import StaticLayer
from .attention.static import static_attention
from .cache_arg import cache_kwargs
from .int4.linear import weight_formats

# Bumped when DecodeStep's inputs or outputs change, or what a package is built for: old ones are then never loaded.
PACKAGE_FORMAT = 4
_MAX_POSITIONS = 1 << 20


# cache [1, kv_heads, capacity, d] <- states [1, kv_heads, q, d] at columns `positions`, in place. An op of its own so
# that the exported step writes into the caller's buffer (an index_copy_ on the input is functionalized into a copy of
# the whole valid cache per layer and step). Defined through torch.library.Library rather than custom_op: the package
# calls it 2 x layers times per step, and custom_op's Python wrappers cost ~12 us a call.
_LIBRARY = torch.library.Library("kvboost", "FRAGMENT")
_LIBRARY.define("write_token(Tensor(a!) cache, Tensor positions, Tensor states) -> ()")


def _write_token(cache: torch.Tensor, positions: torch.Tensor, states: torch.Tensor) -> None:
    cache.index_copy_(2, positions, states)


_LIBRARY.impl("write_token", _write_token, "CPU")
_LIBRARY.impl("write_token", _write_token, "CUDA")
torch.library.register_fake("kvboost::write_token", lambda cache, positions, states: None)
write_token = torch.ops.kvboost.write_token


class _PackagedLayer(StaticLayer):
    """A StaticLayer over whole buffers that writes through write_token and attends to their first `end` columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int):
        super().__init__(keys, values, positions, 0)
        self.end = end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        write_token(self.keys, self.positions, key_states.to(self.dtype))  # the buffers' dtype: kv_dtype
        write_token(self.values, self.positions, value_states.to(self.dtype))
        return self.keys[:, :, :self.end], self.values[:, :, :self.end]


class DecodeStep(torch.nn.Module):
    """embeds [1, 1, hidden] (the token's input embedding), positions [1] int64, marker [end] (any dtype), keys /
    values: per layer [1, kv_heads, capacity, d] -> float32 logits [1, 1, vocab]. Writes the token's K/V into the
    buffers at `positions`. The embedding lookup stays outside: a package holds its own copy of every weight it reads,
    and an untied table (an INT4 model's, whose head is Int8Head) is the largest."""

    def __init__(self, model: torch.nn.Module, backend: str | None):
        super().__init__()
        self.model, self.backend = model, backend

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, marker: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> torch.Tensor:
        end = marker.shape[0]
        cache = Cache(layers=[_PackagedLayer(k, v, positions, end) for k, v in zip(keys, values)])
        out = self.model(inputs_embeds=embeds, position_ids=positions[None], **cache_kwargs(cache), use_cache=True,
                         logits_to_keep=1, kvboost_ends=None, kvboost_exact_views=True, kvboost_backend=self.backend)
        return out.logits.float()


def package_key(model: torch.nn.Module, backend: str | None, threads: int | None = None,
                kv_dtype: torch.dtype = torch.float32) -> str:
    """What a package depends on: its format, torch, this CPU's kernels, the threads its kernels are blocked for
    (default: torch's count now), the attention backend, the K/V buffers' dtype, the model's config and every weight's
    bytes (a model changed in memory gets a package of its own)."""
    import xxhash

    threads = torch.get_num_threads() if threads is None else threads
    digest = xxhash.xxh3_128()
    digest.update(f"{PACKAGE_FORMAT}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{threads}|"
                  f"{backend}|{kv_dtype}".encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def default_package_dir() -> Path:
    """$KVBOOST_CACHE_DIR/aot, else ~/.cache/kvboost/aot ($XDG_CACHE_HOME honoured)."""
    from ..loading import cache_root

    return cache_root() / "aot"


def build_package(model: torch.nn.Module, shapes: list, backend: str | None, path: Path,
                  threads: int | None = None, kv_dtype: torch.dtype = torch.float32) -> Path:
    """Export and compile the decode step of `model` (on the CPU; float32 weights or model/int4 layers) into the package
    `path`; shapes: the workspace's LayerShape per layer, its buffers in kv_dtype. threads: the count its kernels are
    blocked and parallelized for (default: torch's now), whatever this process runs on. Written to a temporary name and
    renamed, so a reader never sees half a package."""
    from torch._inductor import config as inductor_config

    from .compiled_step import PACKED_GEMM_OPTIONS

    capacity, end = 64, 16  # example sizes only: both axes are dynamic
    keys = [torch.zeros(1, s.kv_heads, capacity, s.head_dim_k, dtype=kv_dtype) for s in shapes]
    values = [torch.zeros(1, s.kv_heads, capacity, s.head_dim_v, dtype=kv_dtype) for s in shapes]
    embeds = torch.zeros(1, 1, model.get_input_embeddings().embedding_dim, dtype=next(model.parameters()).dtype)
    example = (embeds, torch.tensor([end - 1]), torch.empty(end, dtype=torch.uint8), keys, values)
    columns = torch.export.Dim("capacity", min=3, max=_MAX_POSITIONS)
    valid = torch.export.Dim("end", min=2, max=_MAX_POSITIONS)
    dynamic = (None, None, {0: valid}, [{2: columns}] * len(shapes), [{2: columns}] * len(shapes))
    step = DecodeStep(model, backend).eval()
    with torch.no_grad(), static_attention(model):
        program = torch.export.export(step, example, dynamic_shapes=dynamic, strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        options = {**PACKED_GEMM_OPTIONS, "cpp.threads": torch.get_num_threads() if threads is None else threads}
        if weight_formats(model):  # inductor's INT4 template takes some shapes only: ATEN's kernel for the others
            options["max_autotune_gemm_backends"] += ",ATEN"
        with inductor_config.patch(freezing=True, **options):
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)  # a failed build leaves nothing in the cache directory
    return path


class AotDecodeStep:
    """A loaded package: call it with the token id, its position, the valid length and the buffers (DecodeStep.forward's
    inputs) under torch.inference_mode(); `embedding` is the model's input embedding, looked up here."""

    def __init__(self, path: Path, embedding: torch.nn.Module):
        self.path, self.embedding = path, embedding
        self._run = torch._inductor.aoti_load_package(str(path))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, end: int, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> torch.Tensor:
        marker = torch.empty(end, dtype=torch.uint8)
        return self._run(self.embedding(ids), positions, marker, keys, values)
