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
                     max_new_tokens: int | None = None) -> tuple[Plan, StreamedSequence, torch.Tensor | None]:
    """(plan, sequence, last-token logits [vocab]) after the prompt ran. max_new_tokens None (a warm): every id
    may be reused afterwards, so the last one runs too, no logits are returned, and no positions are kept on the
    device (there is no next forward to read them)."""
    assert kv.streamed is not None
    ids = list(ids)
    logits = max_new_tokens is not None
    plan = kv.lookup_streamed(ids if logits else ids + [0], salt, mode, approximate)
    assert plan.table is not None
    resident = kv.streamed.resident(len(ids) + max_new_tokens) if logits else None
    seq = StreamedSequence(model, plan.table, attention, resident)
    out = None
    if plan.reuse_len < len(ids):
        try:
            out = seq.forward(ids[plan.reuse_len:], plan.reuse_len)
        except BaseException:
            seq.close()
            raise
    return plan, seq, out if logits else None


def finish_streamed(kv: KVCacheManager, seq: StreamedSequence) -> None:
    """A streamed request is over: its device blocks go back, its forwards and bytes moved are counted in
    cache_stats()["paged_kv"]["streamed"]."""
    seq.close()
    if kv.streamed is not None:
        kv.streamed.count(seq.forwards, seq.bytes_to_device, seq.bytes_to_host)


def streamed_warm(kv: KVCacheManager, model: torch.nn.Module, attention: str, ids: Sequence[int],
                  salt: str | None) -> tuple[int, int]:
    """warm() for a text longer than the device holds: computed over host blocks, kept there as host chunks."""
    plan, seq, _ = streamed_prefill(kv, model, attention, ids, salt, GenerationMode.CHUNK_KV_REUSE)
    assert plan.table is not None
    stored = kv.write_back_streamed(plan.table, ids, salt)
    finish_streamed(kv, seq)
    return stored
