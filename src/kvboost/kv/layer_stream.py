"""One layer at a time, the K/V a host block table holds, brought to the compute device for that layer's attention.

A streamed sequence (kv/streamed_kv.py: longer than the device may hold) keeps its K/V in host blocks, and its
first positions also in device blocks (`Resident`: as many as the device budget allows). Each forward needs, per
layer, positions [0, n) of that layer on the device next to the step's own K/V:

    take(layer, q) -> (keys, values) [1, kv_heads, n + q, d]   positions [0, n) filled; [n, n + q) for the caller

Positions the device blocks hold are read there; the rest cross from the host. On CUDA the copies of layer l + 1
are enqueued on a side stream while layer l computes (one strided copy per run of consecutive host blocks from
pinned memory into a device buffer in block layout: kv/host_copy.py; then one device-side permute into token
order); the compute stream waits on an event before reading them. Elsewhere the device is host memory and a
take is one concatenation of the blocks' slices.
Either way the values are the table's, bit for bit: attention over them is the model's own, as over a contiguous
workspace. Positions a forward brings from the host that the device blocks have room for are kept there too.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from .block_table import BlockTable
from .host_copy import RowCopier, row_copier


class Scratch:
    """Host-side K and V buffers [1, kv_heads, capacity, d] reused by every layer and forward of a sequence (a layer's
    attention is done with them before the next layer's take): a fresh multi-hundred-MB buffer per layer and step
    would be paid again in page faults each time."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def get(self, like: torch.Tensor, h: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.buffers or self.buffers[0].shape[2] < n or self.buffers[0].dtype != like.dtype:
            capacity = n + 256  # decode grows one position per step: reallocate now and then, not every step
            self.buffers = [torch.empty(1, h, capacity, d, dtype=like.dtype, device=like.device) for _ in range(2)]
        return self.buffers[0][:, :, :n], self.buffers[1][:, :, :n]


@dataclass
class Resident:
    """A streamed sequence's first positions in device blocks: `table` has room for table.length positions, of
    which [0, filled) hold the sequence's K/V (every layer)."""

    table: BlockTable
    filled: int = 0

    @property
    def capacity(self) -> int:
        return self.table.length

    def read(self, layer: int, n: int, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Positions [0, n) of `layer` into out's [1, H, >= n, d] K and V."""
        pool = self.table.pool
        runs = self.table.runs(0, n)
        with torch.no_grad():
            for cache, buf in zip((pool.keys(layer), pool.values(layer)), out):
                torch.cat([cache[b, :, off:off + m] for b, off, _, m in runs], dim=1, out=buf[0, :, :n])

    def keep(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, m, d] of positions [start, start + m), cut to the room there is."""
        m = min(keys.shape[-2], self.capacity - start)
        if m > 0:
            self.table.write(layer, start, keys[:, :m], values[:, :m])

    def release(self) -> None:
        self.table.release()
        self.filled = 0


class CudaTransfers:
    """Copies on a side stream, ordered against the compute stream by events (host memory must be pinned for
    the copies to be asynchronous)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def after_queued_work(self) -> None:
        """Copies issued from now on start after everything already queued on the compute stream."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def side_stream(self) -> AbstractContextManager:
        return torch.cuda.stream(self.side)

    def mark(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def consume(self, tensor: torch.Tensor, done: torch.cuda.Event | None) -> None:
        """The compute stream reads `tensor` (made on the side stream) once its copies are done."""
        main = torch.cuda.current_stream(self.device)
        main.wait_event(done)
        tensor.record_stream(main)  # its memory is reused only after both streams are done with it

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class InlineTransfers:
    """CudaTransfers' protocol where every copy completes as it is issued: runs the staged path on any device (the
    tests drive CUDA's code path on a CPU with it)."""

    def after_queued_work(self) -> None:
        pass

    def side_stream(self) -> AbstractContextManager:
        return nullcontext()

    def mark(self) -> None:
        return None

    def consume(self, tensor: torch.Tensor, done: None) -> None:
        pass

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        pass


def transfers_for(device: torch.device, host: torch.device) -> CudaTransfers | InlineTransfers | None:
    """How a device reads host blocks: staged copies on a side stream (CUDA), or None: one concatenation of the
    blocks' slices (the device is host memory, or has no streams: then one copy per layer)."""
    return CudaTransfers(device) if device.type == "cuda" and host.type == "cpu" else None


def consecutive_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(index in blocks, first block id, length) of each run of consecutive block ids: [5, 6, 7, 2] ->
    [(0, 5, 3), (3, 2, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for j, block in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, block, 1))
    return runs


class LayerStream:
    def __init__(self, table: BlockTable, n: int, device: torch.device, scratch: Scratch | None = None,
                 resident: Resident | None = None):
        if n > table.length:
            raise ValueError(f"cannot stream {n} positions of a {table.length}-position table")
        self.table, self.n, self.device = table, n, torch.device(device)
        self.pool = table.pool
        self.scratch = scratch or Scratch()
        self.resident = resident
        self.m = min(resident.filled, n) if resident is not None else 0  # positions [0, m) are on the device
        self.keep_to = min(resident.capacity, n) if resident is not None else 0  # device room for [m, keep_to)
        bs = self.pool.layout.block_size
        self.runs = table.runs(self.m, n)  # (block, offset in block, offset from m, tokens)
        self.first_block = self.m // bs  # host blocks copied on CUDA: [first_block, blocks_for(n))
        self.blocks = table.blocks[self.first_block:self.pool.layout.blocks_for(n)]
        self.transfers = transfers_for(self.device, self.pool.device)
        self.block_runs = consecutive_runs(self.blocks)
        self.copier = row_copier() if isinstance(self.transfers, CudaTransfers) else RowCopier.per_row()
        self.staged = self.transfers is not None  # block-layout copies a layer ahead, else concatenations
        self.pending: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.bytes_to_device = 0

    def take(self, layer: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V [1, kv_heads, n + q, d] on the device, positions [0, n) from the device blocks
        and the table; the next layer's copies start now (CUDA)."""
        if self.staged:
            staged = self._staged(layer)
            if layer + 1 < self.pool.layout.layers:
                self._prefetch(layer + 1)
            out = self._token_order(staged, q)
        else:
            out = self._concatenated(layer, q)
        if self.resident is not None:
            if self.m:
                self.resident.read(layer, self.m, out)
            if self.keep_to > self.m:  # brought from the host now: kept on the device for the next forwards
                self.resident.keep(layer, self.m, out[0][0, :, self.m:self.keep_to], out[1][0, :, self.m:self.keep_to])
        return out

    # ---- host memory is the device ---------------------------------------------------------------------
    def _concatenated(self, layer: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, d = self.pool.layout.kv_heads, self.pool.layout.head_dim
        caches = (self.pool.keys(layer), self.pool.values(layer))  # [blocks, H, bs, d]
        out = self.scratch.get(caches[0], h, self.n + q, d)
        if self.runs:
            with torch.no_grad():  # cat(out=) refuses inputs that require grad
                for cache, buf in zip(caches, out):
                    torch.cat([cache[b, :, off:off + m] for b, off, _, m in self.runs], dim=1,
                              out=buf[0, :, self.m:self.n])
        self.bytes_to_device += 2 * (self.n - self.m) * h * d * self.pool.storage.element_size()
        if self.device != caches[0].device:  # another accelerator without the CUDA path: one copy each
            return out[0].to(self.device), out[1].to(self.device)
        return out

    # ---- staged (CUDA): pinned host blocks -> device, a layer ahead ----------------------------------------
    def _prefetch(self, layer: int) -> None:
        if layer in self.pending or not self.blocks:
            return
        assert self.transfers is not None
        if not self.pending and not self.bytes_to_device:  # the first copy: after the work queued so far (e.g.
            self.transfers.after_queued_work()  # device blocks copied into the table)
        with self.transfers.side_stream():
            staged = torch.empty((len(self.blocks), *self.pool.storage.shape[2:]), dtype=self.pool.storage.dtype,
                                 device=self.device)  # [blocks, 2, H, bs, d]
            for j, block, k in self.block_runs:  # consecutive host blocks: one strided copy per run
                self.copier.copy_rows(staged[j:j + k], self.pool.storage[block:block + k, layer])
            done = self.transfers.mark()
        self.pending[layer] = (staged, done)
        self.bytes_to_device += staged.numel() * staged.element_size()

    def _staged(self, layer: int) -> torch.Tensor | None:
        if not self.blocks:
            return None
        assert self.transfers is not None
        self._prefetch(layer)  # the first layer (or a layer asked out of order)
        staged, done = self.pending.pop(layer)
        self.transfers.consume(staged, done)
        return staged

    def _token_order(self, staged: torch.Tensor | None, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, d = self.pool.layout.kv_heads, self.pool.layout.head_dim
        skip = self.m - self.first_block * self.pool.layout.block_size  # staged positions below m
        out = []
        for kind in (0, 1):
            buf = torch.empty(1, h, self.n + q, d, dtype=self.pool.storage.dtype, device=self.device)
            if staged is not None:  # [blocks, H, bs, d] -> [H, blocks * bs, d], positions [m, n)
                tokens = staged[:, kind].permute(1, 0, 2, 3).reshape(h, -1, d)
                buf[0, :, self.m:self.n].copy_(tokens[:, skip:skip + self.n - self.m])
            out.append(buf)
        return out[0], out[1]

    def close(self) -> None:
        """Drop copies prefetched but not taken (a forward that raised part-way)."""
        self.pending.clear()
