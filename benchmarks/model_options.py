"""The model options every ``kvboost bench`` command takes, and loading the engine they name.

Every bench command takes the same four options (``ModelOption``, ``ShapeOption``, ``DeviceOption``,
``DtypeOption``), turns them into a ``ModelChoice`` with ``model_choice`` (usage errors for bad values,
before anything loads) and hands it to ``load_engine``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvboost.cli_common import LOAD_ERRORS, MODEL_HELP, exit_cannot_load
from kvboost.cli_common import load_engine as load_checkpoint

from .shapes import SHAPES, UnknownShapeError, get_shape

if TYPE_CHECKING:
    from kvboost.engine import InferenceEngine

SHAPE_HELP = ("Random weights (fixed seed) of a named real architecture with the embedded tokenizer, instead of "
              f"--model: {', '.join(SHAPES)}.")
DEVICE_HELP = "Torch device: cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)."
DTYPE_HELP = ("float32, bfloat16, float16 or auto (default auto: fp32 on CPU; on a GPU the checkpoint's own, "
              "bf16 for --shape).")

ModelOption = Annotated[str | None, typer.Option("--model", "-m", help=MODEL_HELP)]
ShapeOption = Annotated[str | None, typer.Option("--shape", help=SHAPE_HELP)]
DeviceOption = Annotated[str | None, typer.Option("--device", help=DEVICE_HELP)]
DtypeOption = Annotated[str | None, typer.Option("--dtype", help=DTYPE_HELP)]

_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")


@dataclass(frozen=True)
class ModelChoice:
    """Which model a command runs: a checkpoint (--model, None = embedded) or a random-weight --shape."""

    model: str | None = None
    shape: str | None = None
    device: str | None = None
    dtype: str | None = None

    @property
    def label(self) -> str:
        if self.shape:
            return f"shape {self.shape} (random weights)"
        return self.model or "embedded SmolLM2-135M-Instruct"

    def record(self, engine: InferenceEngine | None = None) -> dict[str, Any]:
        """What every bench JSON says about the model: name, shape, and the device/dtype actually used."""
        device, dtype = self.device, self.dtype
        if engine is not None:
            device = str(engine.device)
            dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        return {"model": self.label, "shape": self.shape, "device": device, "dtype": dtype}


def as_choice(model: str | ModelChoice | None) -> ModelChoice:
    """Bench entry points take a ModelChoice or, as before, a bare --model value."""
    return model if isinstance(model, ModelChoice) else ModelChoice(model=model)


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise typer.BadParameter(f"{device!r} is not a torch device ({exc})", param_hint="--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(f"{device}: no CUDA device here (torch {torch.__version__}, CUDA runtime "
                                 f"{torch.version.cuda or 'none: a CPU-only build'})", param_hint="--device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise typer.BadParameter(f"{device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                                 param_hint="--device")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise typer.BadParameter(f"{device}: MPS is not available here", param_hint="--device")


def model_choice(model: str | None = None, shape: str | None = None, device: str | None = None,
                 dtype: str | None = None, *, refuse_shape: str | None = None) -> ModelChoice:
    """Validate the four model options into a ModelChoice; a bad value is a usage error (exit 2), raised
    before any weights load. refuse_shape: why this command cannot run on random weights (quality benches)."""
    if model is not None and shape is not None:
        raise typer.BadParameter("--model and --shape are mutually exclusive: a checkpoint or a random-weight "
                                 "shape, not both", param_hint="--shape")
    if shape is not None:
        if refuse_shape:
            raise typer.BadParameter(refuse_shape, param_hint="--shape")
        try:
            get_shape(shape)
        except UnknownShapeError as exc:
            raise typer.BadParameter(str(exc), param_hint="--shape") from None
    if dtype is not None and dtype not in _DTYPES:
        raise typer.BadParameter(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}",
                                 param_hint="--dtype")
    if device is not None:
        _check_device(device)
    return ModelChoice(model, shape, device, dtype)


QUALITY_REFUSAL = ("{command} compares output quality on real text, which random weights make meaningless; "
                   "use --model (a checkpoint) for it, and --shape for the timing benchmarks")


def load_engine(model: str | ModelChoice | None = None, device: str | None = None, dtype: str | None = None,
                shape: str | None = None, **options) -> InferenceEngine:
    """The engine for a model choice (KVBoost.from_pretrained, or a shape's random weights wrapped in KVBoost),
    with a one-line error instead of a traceback for a bad model argument. options go to the engine."""
    choice = model if isinstance(model, ModelChoice) else ModelChoice(model, shape, device, dtype)
    if choice.shape is None:
        return load_checkpoint(choice.model, device=choice.device, dtype=choice.dtype, **options)
    from kvboost import KVBoost

    from .shapes import build_shape_model

    try:
        hf_model, tokenizer = build_shape_model(choice.shape, choice.device, choice.dtype)
        return KVBoost(hf_model, tokenizer, **options)
    except LOAD_ERRORS as exc:
        exit_cannot_load(f"shape {choice.shape!r}", exc)
