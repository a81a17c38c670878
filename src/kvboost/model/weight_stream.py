"""Decoder layers whose weights live in host memory and reach the device, a layer at a time, as the forward needs them.

`plan_streaming` fits a weight budget: the embedding, the head and final norm stay resident (`fixed`); `depth` device
slots hold the streamed layers in flight; what is left keeps whole layers resident, spread
evenly so that streamed layers alternate with resident ones (a resident layer's compute hides the next copy). A
streamed layer's tensors (INT4 codes as they are) sit in one exactly sized page-locked host buffer; a slot is one
device buffer of the largest streamed layer's bytes, and a layer's tensors are views into it at fixed offsets, so a
layer crosses in one copy. Copies run on a side stream up to `depth - 1` layers ahead, in the order the forward meets
the streamed layers (cyclically, into the next step), each into the slot loaded longest ago; a layer's compute waits
only on its own copy's event, and a copy starts only after the compute issued before it (so after the compute that
last read its slot). With `fixed_slots` (decode steps under CUDA graphs) the i-th streamed layer always lives in slot
i % slots and prefetching stops at the forward's end: every step issues the same copies into the same addresses, and
every copy a step forks onto the side stream is joined by the compute that waits for it, as a capture requires. On a
CPU the same code copies synchronously (its logic is what CI tests). Outside a forward, a streamed layer's tensors are
its host copies, so state_dict and fingerprints read the weights, never a slot's stale contents.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
from torch import nn

from ..kv.pinned import ALIGN, byte_view, pinned_empty


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layer list (model.model.layers) to stream")
    return layers


def _tensors(layer: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, name, tensor) of every parameter and buffer of a layer, each once."""
    found: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}
    for module in layer.modules():  # torch leaves out None parameters and buffers
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            found.setdefault(id(t), (module, name, t))
    return list(found.values())


@dataclass
class StreamPlan:
    resident: list[int]  # decoder layer indices kept on the device
    streamed: list[int]  # in forward order
    slots: int  # device buffers for streamed layers in flight
    slot_bytes: int


def plan_streaming(layer_bytes: list[int], fixed_bytes: int, budget: int, depth: int = 2) -> StreamPlan:
    if fixed_bytes > budget:
        raise ValueError(f"weight_budget_bytes={budget:,}: the embedding, head and norms alone take {fixed_bytes:,}")
    n = len(layer_bytes)
    if fixed_bytes + sum(layer_bytes) <= budget:
        return StreamPlan(list(range(n)), [], 0, 0)
    slot = max(layer_bytes)
    slots = max(1, min(depth, n, (budget - fixed_bytes) // slot))  # a shallower prefetch before refusing
    room = budget - fixed_bytes - slots * slot
    if room < 0:
        raise ValueError(f"weight_budget_bytes={budget:,}: one slot of {slot:,} bytes does not fit beside the "
                         f"{fixed_bytes:,} resident bytes")
    keep = sum(total <= room for total in accumulate(sorted(layer_bytes)))  # the most layers that fit
    resident = sorted({round(i * (n - 1) / (keep - 1)) for i in range(keep)} if keep > 1 else ({0} if keep else set()))
    while sum(layer_bytes[i] for i in resident) > room:  # evenly spread ones may be the larger layers
        resident.pop()
    streamed = [i for i in range(n) if i not in resident]
    return StreamPlan(resident, streamed, min(slots, len(streamed)), slot)


@dataclass
class _Streamed:
    tensors: list[tuple[nn.Module, str, torch.Tensor]]  # owner, name, the host copy (a view of `host`)
    offsets: list[int]
    host: torch.Tensor  # uint8, the layer's bytes
    ready: object = None  # the copy's event (CUDA)


class WeightStreamer:
    """Streams the plan's layers through `plan.slots` device slots; installed by forward hooks on those layers."""

    def __init__(self, model: nn.Module, plan: StreamPlan, device: torch.device, fixed_slots: bool = False):
        self.plan, self.device, self.fixed_slots = plan, device, fixed_slots
        self.copies = self.bytes_copied = 0
        self.unpinned_reason: str | None = None  # why the host copies are not page-locked
        layers = decoder_layers(model)
        self.layers: list[_Streamed] = []
        for i in plan.streamed:
            tensors = _tensors(layers[i])
            *offsets, size = accumulate((-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, _, t in tensors),
                                        initial=0)
            host, why = pinned_empty((size,), torch.uint8) if device.type == "cuda" else \
                (torch.empty(size, dtype=torch.uint8), None)
            self.unpinned_reason = why or self.unpinned_reason
            entry = _Streamed([(owner, name, byte_view(host, offset, t).copy_(t.detach()))  # copy_ returns the view
                               for (owner, name, t), offset in zip(tensors, offsets)], offsets, host)
            self.layers.append(entry)
            self._point(entry, [t for _, _, t in entry.tensors])  # the device copies are freed
            layers[i].register_forward_pre_hook(partial(self._before, len(self.layers) - 1))
            layers[i].register_forward_hook(partial(self._after, len(self.layers) - 1))
        self.slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8, device=device) for _ in range(plan.slots)]
        if fixed_slots and plan.streamed and plan.streamed[0] > 0:
            # Fixed slots prefetch nothing across steps: the first streamed layers cross during the resident ones.
            layers[0].register_forward_pre_hook(lambda module, args: self._prefetch(0))
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.where: dict[int, int] = {}  # streamed layer -> the slot holding it
        self.next_slot = 0  # the slot loaded longest ago: the next copy's

    @staticmethod
    def _point(entry: _Streamed, tensors: list[torch.Tensor]) -> None:
        for (owner, name, _), t in zip(entry.tensors, tensors):
            current = getattr(owner, name)
            if isinstance(current, nn.Parameter):
                current.data = t
            else:
                setattr(owner, name, t)

    def _copy(self, k: int) -> None:
        """Make sure streamed layer k is in a slot, loading it into the slot loaded longest ago if not."""
        if k in self.where:
            return
        slot = k % len(self.slots) if self.fixed_slots else self.next_slot
        self.where = {m: s for m, s in self.where.items() if s != slot}  # the layer this slot held is gone
        entry = self.layers[k]
        if self.copy_stream is None:
            self.slots[slot][:entry.host.numel()].copy_(entry.host)
        else:
            # After the compute issued so far, which includes the last reader of this slot (the layer before the
            # one whose hook prefetches); under a capture, this is also the side stream's fork from the captured one.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self.slots[slot][:entry.host.numel()].copy_(entry.host, non_blocking=True)
                entry.ready = self.copy_stream.record_event()
        self.where[k] = slot
        self.next_slot = (slot + 1) % len(self.slots)
        self.copies += 1
        self.bytes_copied += entry.host.numel()

    def _prefetch(self, k: int) -> None:
        """Streamed layer k and the ones after it, up to the ring's size (fixed slots: not past the forward's last)."""
        n = len(self.layers)
        for m in range(k, min(k + len(self.slots), n) if self.fixed_slots else k + len(self.slots)):
            self._copy(m % n)

    def _before(self, k: int, module: nn.Module, args) -> None:
        self._prefetch(k)
        entry, slot = self.layers[k], self.slots[self.where[k]]
        # Waited for once: later compute is ordered after it, and a capture never waits on an earlier event.
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            entry.ready = None
        self._point(entry, [byte_view(slot, off, t) for off, (_, _, t) in zip(entry.offsets, entry.tensors)])

    def _after(self, k: int, module: nn.Module, args, output) -> None:
        entry = self.layers[k]
        self._point(entry, [t for _, _, t in entry.tensors])  # outside a forward: the host copies

    def as_dict(self) -> dict:
        return {"resident_layers": self.plan.resident, "streamed_layers": self.plan.streamed,
                "slots": self.plan.slots, "slot_bytes": self.plan.slot_bytes, "fixed_slots": self.fixed_slots,
                "copies": self.copies, "bytes_copied": self.bytes_copied, "pinned": self.unpinned_reason is None,
                "unpinned_reason": self.unpinned_reason}


def stream_weights(model: nn.Module, budget: int, device: torch.device, depth: int = 2,
                   fixed_slots: bool = False) -> WeightStreamer | None:
    """Place `model` on `device` within `budget` bytes of weights: what the plan keeps resident moves there, the
    streamed layers go to host memory (never to the device whole). None: everything fits, and is on the device.
    fixed_slots: each streamed layer in one slot for good (decode steps under CUDA graphs)."""
    layers = decoder_layers(model)
    layer_bytes = [sum(t.numel() * t.element_size() for _, _, t in _tensors(layer)) for layer in layers]
    total = sum(t.numel() * t.element_size() for _, _, t in _tensors(model))
    plan = plan_streaming(layer_bytes, total - sum(layer_bytes), budget, depth)
    held = {i: layers[i] for i in plan.streamed}
    for i in held:  # out of the model while it moves, so no streamed layer is ever whole on the device
        layers[i] = nn.Identity()
    model.to(device)
    for i, layer in held.items():
        layers[i] = layer
    return WeightStreamer(model, plan, device, fixed_slots) if plan.streamed else None
