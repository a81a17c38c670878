"""A transformers Cache for one forward over a host workspace: each layer's K/V reaches the device as it runs (on a
CPU attention reads host views), a side stream copying layer i + 1 in and layer i's new K/V out while layer i runs."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .host_workspace import HostWorkspace, copy_heads
from .length_layer import LengthLayer


class HostStreamLayer(LengthLayer):
    def __init__(self, cache: HostStreamCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.length = cache.start  # positions before this forward's tokens; start + q once updated
        self.dtype, self.device = cache.host.dtype, cache.host.compute_device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.length != self.cache.start:
            raise RuntimeError("a host stream cache serves one forward; build a new one for the next")
        keys, values = self.cache.layer_kv(self.layer_idx, key_states, value_states)
        self.length = self.cache.end
        return keys, values


class HostStreamCache(Cache):
    """One forward of q tokens at [start, start + q) over `host`; call finish(ok) after it, raised or not."""

    def __init__(self, host: HostWorkspace, start: int, q: int):
        if start > host.capacity:
            raise ValueError(f"position {start} is past this host workspace's {host.capacity} positions")
        host.ensure_capacity(start + q, keep=start)  # before any copy is in flight: growth moves the buffers
        host.set_length(start)
        self.host, self.start, self.end = host, start, start + q
        self.feed = StagedFeed(host, start, self.end) if host.staged else None
        super().__init__(layers=[HostStreamLayer(self, i) for i in range(len(host.shapes))])

    def layer_kv(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new/v_new [1, kv_heads, q, d] -> layer layer_idx's K and V [1, kv_heads, start + q, d] on the device."""
        if k_new.shape[0] != 1 or k_new.shape[-2] != self.end - self.start:
            raise ValueError(f"this cache runs {self.end - self.start} tokens of one sequence; got K/V of shape "
                             f"{tuple(k_new.shape)}")
        if self.feed is not None:
            return self.feed.take(layer_idx, k_new, v_new)
        k_buf, v_buf = self.host.buffers(layer_idx)  # the device is the host: attention reads the buffers
        k_buf[:, :, self.start:self.end].copy_(k_new)
        v_buf[:, :, self.start:self.end].copy_(v_new)
        return k_buf[:, :, :self.end], v_buf[:, :, :self.end]

    def finish(self, ok: bool) -> None:
        """The forward is over: the sequence holds [0, start + q) if it completed, else [0, start) as before."""
        if self.feed is not None:
            self.feed.finish(ok)
        self.host.set_length(self.end if ok else self.start)
        if ok:
            self.host.stats.forwards += 1


class StagedFeed:
    """A staged forward's per-layer K/V on the device (see the module docstring)."""

    def __init__(self, host: HostWorkspace, start: int, end: int):
        assert host.copies is not None and host.scratch is not None
        self.host, self.start, self.end = host, start, end
        self.copies, self.scratch, self.resident = host.copies, host.scratch, host.resident
        self.m = min(self.resident.filled, start) if self.resident is not None else 0  # [0, m) on the device
        self.keep_to = min(self.resident.capacity, end) if self.resident is not None else 0  # kept: [m, keep_to)
        self.scratch.ensure(end)
        self.ready: dict[int, object] = {}  # layer -> event after its copy from the host
        self.copies.after_compute()  # the previous forward's attention is done with the scratch pairs
        self._prefetch(0)

    def take(self, i: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if i not in self.ready:  # layers run in order, but nothing breaks if one does not
            self.copies.after_compute()
            self._prefetch(i)
        self.copies.wait(self.ready.pop(i))
        keys, values = self.scratch.views(i, self.end)
        s, e, m = self.start, self.end, self.m
        if m:
            res_k, res_v = self.resident.buffers(i)
            keys[:, :, :m].copy_(res_k[:, :, :m])
            values[:, :, :m].copy_(res_v[:, :, :m])
        keys[:, :, s:e].copy_(k_new)
        values[:, :, s:e].copy_(v_new)
        if self.keep_to > m:  # what crossed (or was computed) below the resident capacity stays on the device
            res_k, res_v = self.resident.buffers(i)
            res_k[:, :, m:self.keep_to].copy_(keys[:, :, m:self.keep_to])
            res_v[:, :, m:self.keep_to].copy_(values[:, :, m:self.keep_to])
        self.copies.after_compute()  # the step's K/V is in scratch; layer i - 1 is done with the other pair
        with self.copies.on_side():
            host_k, host_v = self.host.buffers(i)
            copy_heads(host_k[0, :, s:e], keys[0, :, s:e])
            copy_heads(host_v[0, :, s:e], values[0, :, s:e])
            self.host.stats.bytes_to_host += keys[:, :, s:e].nbytes + values[:, :, s:e].nbytes
            if i + 1 < len(self.host.shapes):
                self._prefetch(i + 1)
        return keys, values

    def _prefetch(self, i: int) -> None:
        """Host positions [m, start) of layer i into its scratch pair, on the side stream."""
        if self.start == self.m:
            self.ready[i] = None
            return
        with self.copies.on_side():
            keys, values = self.scratch.views(i, self.end)
            host_k, host_v = self.host.buffers(i)
            copy_heads(keys[0, :, self.m:self.start], host_k[0, :, self.m:self.start])
            copy_heads(values[0, :, self.m:self.start], host_v[0, :, self.m:self.start])
            self.ready[i] = self.copies.mark()
        self.host.stats.bytes_to_device += keys[:, :, self.m:self.start].nbytes + values[:, :, self.m:self.start].nbytes

    def finish(self, ok: bool) -> None:
        self.ready.clear()  # copies prefetched but never taken (a forward that raised) finish before join's event
        self.host.pending = self.copies.join()
        if ok and self.resident is not None:
            self.resident.filled = max(self.m, self.keep_to)
