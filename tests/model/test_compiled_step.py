"""CompiledStep: the CPU decode step's packed GEMV kernels, and the fall back to ATen's where they cannot compile."""
from __future__ import annotations

import pytest
import torch

from kvboost.model.compiled_step import CompiledStep


def _chain() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.SiLU(),
                               torch.nn.Linear(96, 64, bias=False)).eval()


def _cpu_only(device: torch.device) -> None:
    if device.type != "cpu":
        pytest.skip("the compiled decode step is the CPU path (CUDA runs graphs)")


def _needs_cpp_template() -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"inductor's C++ GEMM template needs AVX2 or AVX-512 (this CPU: "
                    f"{torch.backends.cpu.get_cpu_capability()})")


def test_packed_kernels_compute_the_eager_products(device):
    _cpu_only(device)
    _needs_cpp_template()
    torch._dynamo.reset()
    model = _chain()
    step = CompiledStep(lambda x: model(x))
    x = torch.randn(1, 1, 64)
    with torch.inference_mode():
        out = step(x)
        again = step(torch.ones(1, 1, 64))
        expected = model(x), model(torch.ones(1, 1, 64))
    assert step.packed and step.fallback is None
    assert step.description.startswith("packed")
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, expected[1], rtol=1e-5, atol=1e-5)


def test_a_template_that_cannot_compile_falls_back_to_aten_kernels(device):
    """A float64 model: inductor's C++ GEMM template takes no float64, so lowering finds no GEMM choice (an
    InductorError); the step compiles again over ATen's kernels, gives the same products, and says why."""
    _cpu_only(device)
    torch._dynamo.reset()
    model = _chain().double()
    step = CompiledStep(lambda x: model(x))
    x = torch.randn(1, 1, 64, dtype=torch.float64)
    with torch.inference_mode():
        out = step(x)
        expected = model(x)
    assert not step.packed
    assert step.fallback and "NoValidChoices" in step.fallback
    assert step.description.startswith("ATen GEMV (packed kernels failed: InductorError")
    torch.testing.assert_close(out, expected)


def test_an_error_of_the_function_itself_propagates(device):
    _cpu_only(device)
    torch._dynamo.reset()

    def broken(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)  # [1, 64] @ [3, 3]: a shape error, not a kernel choice

    step = CompiledStep(broken)
    with pytest.raises(Exception, match="size|shape|mat"), torch.inference_mode():
        step(torch.randn(1, 64))


def test_too_little_host_memory_for_a_packed_copy_keeps_atens_kernels():
    from kvboost.model.compiled_step import linear_weight_bytes, packing_refusal

    model = _chain()
    weights = linear_weight_bytes(model)
    assert weights == (64 * 96 + 96 * 64) * 4
    reason = packing_refusal(model, available=weights)
    assert reason is not None and "free host memory" in reason
    assert packing_refusal(model, available=100 * weights) is None
    step = CompiledStep(lambda x: model(x), packed=False, unpacked_reason=reason)
    assert step.description == f"ATen GEMV ({reason})"


def test_the_engine_reports_atens_kernels_when_packing_is_refused(monkeypatch, tokenizer, device):
    """make_runner asks packing_refusal; a refusal reaches cache_stats() (the step is not compiled to see it)."""
    _cpu_only(device)
    from kvboost.kv.workspace import KVWorkspace
    from kvboost.model import fast_path as fast_path_module
    from kvboost.model.fast_path import make_runner
    from kvboost.model.forward import probe_layer_shapes

    from ..tiny_models import make_tiny_model

    monkeypatch.setattr(fast_path_module, "packing_refusal", lambda model: "packing needs ~9 GiB, 1 GiB available")
    model = make_tiny_model("llama", tokenizer, device=device)
    shapes, dtype = probe_layer_shapes(model)
    runner, reason = make_runner("compiled", model, KVWorkspace(shapes, dtype, device), "sdpa")
    assert runner.decode_kernels == "ATen GEMV (packing needs ~9 GiB, 1 GiB available)"
    assert "over ATen GEMV" in reason


class _Doubler:
    """Two instances' steps compile the same method: one code object, unless CompiledStep gives each its own."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * 2


def test_each_step_compiles_its_own_graphs_against_its_own_limit(device):
    """Dynamo keeps graphs and counts recompile_limit per code object. A packed step freezes its model's weights
    into its graph, so two models need two graphs: with one shared code object, the second would find the limit
    (1 here) reached and not compile."""
    _cpu_only(device)
    _needs_cpp_template()
    torch._dynamo.reset()
    models = [_chain(), _chain()]
    x = torch.randn(1, 1, 64)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1), torch.inference_mode():
        steps = [CompiledStep(_Doubler(m).run) for m in models]
        for step, model in zip(steps, models):
            torch.testing.assert_close(step(x), model(x) * 2, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2


def test_a_step_past_its_recompile_limit_raises_step_not_compiled(device):
    _cpu_only(device)
    from kvboost.model.compiled_step import StepNotCompiled

    torch._dynamo.reset()
    model = _chain()
    step = CompiledStep(_Doubler(model).run, packed=False)
    with torch._dynamo.config.patch(recompile_limit=1), torch.inference_mode():
        step(torch.randn(1, 1, 64))
        with pytest.raises(StepNotCompiled, match="recompile_limit"):
            step(torch.randn(1, 1, 64, dtype=torch.float64))  # another dtype: a second graph, past the limit


def test_steps_over_the_same_model_share_its_graphs(device):
    """An engine created again on the same model (or a batch runner's steps) reuses the graphs its weights were
    frozen into rather than compiling them again; another model never does."""
    _cpu_only(device)
    _needs_cpp_template()
    torch._dynamo.reset()
    model, other = _chain(), _chain()
    x = torch.randn(1, 1, 64)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for m in (model, model, other):
            torch.testing.assert_close(CompiledStep(_Doubler(m).run, owner=m)(x), m(x) * 2, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
