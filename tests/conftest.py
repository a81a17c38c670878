"""Shared fixtures: tiny random models of several architectures and the embedded SmolLM2, on one device.

`pytest --device cuda` (default cpu; cuda:N and mps too) runs every model the fixtures build, and every tensor
the tests build, on that device (tests/devices.py). On CUDA the suite runs fp32 with TF32 off, so the
tolerances that hold on CPU hold there. A --device this machine cannot run is a usage error (exit 4).
Fixtures: `device` (torch.device, session), `smol`, `tokenizer`, `smol_dir`, `tiny` (one per architecture).
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# auto on a CPU would build each model's decode-step package in the background (minutes, a core each): the suite's
# engines decode eagerly, and tests/model/test_aot_build.py turns it on where it is the subject.
os.environ.setdefault("KVBOOST_AOT", "0")
if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the first test (any directory: the
    # kernel tests, `bench gpu`'s kernel timings...) imports kvboost's kernel modules. Without a GPU the kernels
    # can only run in the interpreter, so the whole session uses it.
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from . import devices  # noqa: E402
from .gpu_smoke import is_gpu_smoke  # noqa: E402
from .tiny_models import TINY_ARCHS, make_tiny_model  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", metavar="DEVICE",
                     help="torch device for the tests' models and tensors: cpu (default), cuda, cuda:N or mps")
    parser.addoption("--failures-log", default=None, metavar="PATH",
                     help="append each failing test's id and traceback to PATH as it fails (a run killed at a "
                          "time limit keeps what failed so far: scripts/gpu_check.sh)")


def pytest_runtest_logreport(report):
    """--failures-log: written by the process that reports (the xdist controller, not its workers)."""
    path = _failures_log
    if path is None or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.nodeid} [{report.when}]\n{report.longreprtext[-3000:]}\n")


_failures_log: str | None = None


def pytest_configure(config):
    global _failures_log
    _failures_log = config.getoption("--failures-log")
    try:
        dev = devices.parse_device(config.getoption("--device"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    devices.set_current(dev)
    if dev.type == "cuda":
        # fp32 means fp32: TF32 matmuls (10-bit mantissa) would break the 1e-4 logit tolerances.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        # The store's device tier defaults to 30% of the free device memory; the suite's engines are tiny and
        # pytest-xdist runs ~10 processes on one GPU, each holding several engines. 1% is still many times what a
        # test stores.
        from kvboost.kv import long_context

        long_context.DEFAULT_DEVICE_KV_FRACTION = 0.01


def pytest_collection_modifyitems(config, items):
    """Mark the GPU smoke subset (tests/gpu_smoke.py): `-m gpu_smoke` selects what scripts/gpu_check.sh runs."""
    root = config.rootpath
    for item in items:
        try:
            relative = item.path.relative_to(root).as_posix()
        except ValueError:  # a test outside the repository (a path given on the command line)
            continue
        if is_gpu_smoke(relative):
            item.add_marker(pytest.mark.gpu_smoke)


def pytest_report_header(config):
    dev = devices.current()
    if dev.type == "cuda":
        return f"kvboost test device: {dev} ({torch.cuda.get_device_name(dev)}), fp32, TF32 off"
    return f"kvboost test device: {dev}"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device every model and tensor of the suite lives on (--device)."""
    return devices.current()


@pytest.fixture(scope="session")
def smol_dir():
    from kvboost.loading import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tokenizer(request):
    """The embedded model's tokenizer; $KVBOOST_TOKENIZER (a folder of its files) stands in on a GPU machine that
    cannot carry the 94 MB GGUF, so every test but the slow (real-model) ones runs there."""
    import os

    from transformers import AutoTokenizer

    folder = os.environ.get("KVBOOST_TOKENIZER")
    return AutoTokenizer.from_pretrained(folder or request.getfixturevalue("smol_dir"))


@pytest.fixture(scope="session")
def smol(smol_dir, device):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on the test device, loaded once per session."""
    from kvboost.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(None, dtype="float32", device=str(device))


@pytest.fixture(params=TINY_ARCHS)
def tiny(request, tokenizer, device):
    return make_tiny_model(request.param, tokenizer, device=device), tokenizer
