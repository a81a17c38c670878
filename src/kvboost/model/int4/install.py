"""INT4 layers into a model: each Linear swapped for an Int4Linear, and sibling projections that read the same input
(q/k/v, gate/up) fused into one INT4 GEMV.

A decode step's projections are small matrix-vector products whose fixed cost per call (threads woken, the activation
rounded to bfloat16) is a large share of their time; one call over the siblings' rows concatenated computes every
output column exactly as the separate calls do. The model's attention and MLP modules still call `q_proj`, `k_proj`
and `v_proj` one after the other: each becomes a `SiblingOutput` whose first call with a new input runs the fused layer
and keeps the result until every sibling has read its columns of it (the siblings are called on the same tensor, so the
result is looked up by identity, never by value).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

from .linear import Int4Linear, replace_linear
from .weights import Int4Weights

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _FusedPass:
    """The fused layer and, per thread, the last input it ran on with the outputs not yet read."""

    def __init__(self, layer: Int4Linear, widths: list[int]):
        self.layer, self.widths = layer, widths
        self.local = threading.local()

    def __getstate__(self) -> dict:  # pickled with the model (the package build's job): without the per-thread results
        return {"layer": self.layer, "widths": self.widths}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layer"], state["widths"])

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        state = self.local
        if getattr(state, "input", None) is not x:
            state.input, state.parts = x, list(self.layer(x).split(self.widths, dim=-1))
            state.unread = set(range(len(self.widths)))
        state.unread.discard(index)
        out = state.parts[index]
        if not state.unread:  # every sibling has its columns: hold nothing between forwards
            state.input = state.parts = None
        return out


class SiblingOutput(nn.Module):
    """One sibling's columns of a fused INT4 projection. The first sibling holds the fused layer as its submodule
    (state_dict, .to() and layer streaming see it once); the others reach the same layer through the shared pass."""

    def __init__(self, shared: _FusedPass, index: int):
        super().__init__()
        if index == 0:
            self.fused = shared.layer
        self._shared, self.index = shared, index
        self.in_features, self.out_features = shared.layer.in_features, shared.widths[index]

    @property
    def layer(self) -> Int4Linear:
        return self._shared.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.output(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sibling {self.index}"


def _fuse(parent: nn.Module, children: tuple[str, ...], weights: dict[str, Int4Weights],
          device: torch.device | str | None, kernel: str | None) -> bool:
    """Install `parent`'s `children` as one fused layer; False, and nothing done, where they cannot fuse."""
    olds = [getattr(parent, c, None) for c in children]
    parts = [weights[c] for c in children]
    if not (all(isinstance(m, nn.Linear) and (m.out_features, m.in_features) == w.shape for m, w in zip(olds, parts))
            and len({w.group for w in parts}) == 1 and len({m.bias is None for m in olds}) == 1):
        return False
    fused = Int4Weights(torch.cat([w.codes for w in parts]), torch.cat([w.scales for w in parts]),
                        torch.cat([w.zeros for w in parts]), parts[0].group)
    bias = None if olds[0].bias is None else torch.cat([m.bias.detach() for m in olds])
    shared = _FusedPass(Int4Linear(fused, bias, device, kernel), [w.shape[0] for w in parts])
    for index, child in enumerate(children):
        setattr(parent, child, SiblingOutput(shared, index))
    return True


def install_int4(model: nn.Module, layers: Iterable[tuple[str, Int4Weights]],
                 device: torch.device | str | None = None, kernel: str | None = None) -> int:
    """Swap each named nn.Linear for an Int4Linear of its weights (replace_linear), built for `device` and `kernel`
    (default: the device's); siblings that read the same input and share a group size become one fused layer.
    `layers` may be a generator: siblings are held only until the last of them arrives. Returns how many Linear layers
    were replaced."""
    def each_alone(parent_name: str, group: dict[str, Int4Weights]) -> None:  # replace_linear refuses a wrong shape
        for c, w in group.items():
            replace_linear(model, f"{parent_name}.{c}" if parent_name else c, w, device, kernel)

    pending: dict[tuple[str, tuple[str, ...]], dict[str, Int4Weights]] = {}
    count = 0
    for name, weights in layers:
        count += 1
        parent_name, _, child = name.rpartition(".")
        children = next((group for group in SIBLINGS if child in group), None)
        if children is None:
            replace_linear(model, name, weights, device, kernel)
            continue
        waiting = pending.setdefault((parent_name, children), {})
        waiting[child] = weights
        if len(waiting) == len(children):
            del pending[(parent_name, children)]
            if not _fuse(model.get_submodule(parent_name), children, waiting, device, kernel):
                each_alone(parent_name, waiting)
    for (parent_name, _), waiting in pending.items():  # groups with a member left float
        each_alone(parent_name, waiting)
    return count


def quantize_linears(model: nn.Module, group: int = 128, skip: tuple[str, ...] = ("lm_head",),
                     device: torch.device | str | None = None) -> int:
    """Round every nn.Linear but those named in `skip` to INT4 (quantize_rtn), built for `device` (default: where each
    weight is); returns how many. A layer whose inputs the group does not divide stays float."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rpartition(".")[2] not in skip
             and m.in_features % group == 0]
    return install_int4(model, ((n, Int4Weights.quantize_rtn(model.get_submodule(n).weight, group)) for n in names),
                        device)
