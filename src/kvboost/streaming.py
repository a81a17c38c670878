"""The engine's requests over contexts longer than the device holds (device_kv_max_tokens): the stored prefix
mapped into a table over host blocks (kv/streamed_kv.py), the rest run by a StreamedSequence, which brings the
K/V to the device one layer at a time (model/streamed_sequence.py). The caller holds the engine lock."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .kv.manager import KVCacheManager, Plan
from .model.streamed_sequence import StreamedSequence
from .results import GenerationMode


def streamed_prefill(kv: KVCacheManager, model: torch.nn.Module, attention: str, ids: Sequence[int],
                     salt: str | None, mode: GenerationMode, approximate: bool = False,
                     logits: bool = True) -> tuple[Plan, StreamedSequence, torch.Tensor | None]:
    """(plan, sequence, last-token logits [vocab]) after the prompt ran; logits=False (a warm): every id may be
    reused afterwards, so the last one runs too and no logits are returned."""
    ids = list(ids)
    plan = kv.lookup_streamed(ids if logits else ids + [0], salt, mode, approximate)
    assert plan.table is not None
    seq = StreamedSequence(model, plan.table, attention)
    out = None
    if plan.reuse_len < len(ids):
        out = seq.forward(ids[plan.reuse_len:], plan.reuse_len)
    return plan, seq, out if logits else None


def count_transfers(kv: KVCacheManager, seq: StreamedSequence) -> None:
    """A finished streamed request's forwards and bytes moved, into cache_stats()["paged_kv"]["streamed"]."""
    if kv.streamed is not None:
        kv.streamed.count(seq.forwards, seq.bytes_to_device, seq.bytes_to_host)


def streamed_warm(kv: KVCacheManager, model: torch.nn.Module, attention: str, ids: Sequence[int],
                  salt: str | None) -> tuple[int, int]:
    """warm() for a text longer than the device holds: computed over host blocks, kept there as host chunks."""
    plan, seq, _ = streamed_prefill(kv, model, attention, ids, salt, GenerationMode.CHUNK_KV_REUSE, logits=False)
    assert plan.table is not None
    stored = kv.write_back_streamed(plan.table, ids, salt)
    count_transfers(kv, seq)
    return stored
