"""The GPU smoke subset: the test files that exercise CUDA code, marked `gpu_smoke` at collection (tests/conftest.py).

scripts/gpu_check.sh runs `pytest --device cuda -m "gpu_smoke and not slow"` on a lent GPU, where the whole fast
suite no longer fits the time it has beside the benchmarks. A file is listed when on CUDA it runs code that a CPU
run does not (graphs, Triton kernels, page-locked memory, side streams) or that CUDA numerics can break (the
fidelity tests); each file's reason is beside it. Whole files rather than single tests: a test added to one of
these files is in the subset without anyone remembering to add it. tests/bench/test_gpu_check.py fails when a
listed file is gone or collects no test.
"""
from __future__ import annotations

GPU_SMOKE: dict[str, str] = {
    "tests/model/test_graphs.py": "CUDA graph capture, its refusal near a full device, recovery after a failed capture",
    "tests/model/test_runner.py": "the runner's bucketed static steps replayed as CUDA graphs",
    "tests/model/test_attention_kernels.py": "the Triton attention kernels compiled for the GPU, against float64",
    "tests/model/test_attention_backend.py": "backend choice on CUDA (Triton, SDPA fallback) and its HF wiring",
    "tests/model/test_forward.py": "the engine's forwards with the attention CUDA picks give HF's tokens",
    "tests/kv/test_placement.py": "placing stored chunks into the device workspace is a pure copy",
    "tests/kv/test_pinned.py": "page-locked host memory through the CUDA runtime, and its fallbacks",
    "tests/kv/test_host_workspace.py": "host workspaces staged through device buffers on a side stream",
    "tests/kv/test_streamed.py": "contexts streamed from host memory one layer at a time",
    "tests/store/test_host_tier.py": "host tier moves: asynchronous copies to and from page-locked memory",
    "tests/store/test_engine_host_tier.py": "reuse served from the host tier gives the all-on-device output",
    "tests/test_engine_fidelity.py": "exact reuse reproduces HF generate on the GPU (fp32, TF32 off)",
    "tests/test_devices.py": "device placement of models, tensors and the package's fallbacks",
    "tests/batch/test_generate_batch.py": "batched and continuous generation through the runner",
    "tests/batch/test_cascade.py": "shared-prefix (cascade) attention against plain attention on the device",
    "tests/batch/test_speculative_rows.py": "prompt-lookup rows verified in ragged steps by the batching runner",
    "tests/decoding/test_speculative.py": "speculative decoding through the runner's verify step, greedy-exact",
    "tests/model/int4/test_triton_w4a16.py": "the Triton W4A16 kernel compiled for the GPU, and Int4Linear over it",
    "tests/model/int4/test_linear.py": "Int4Linear's CUDA kernels (Triton, torch's int4 mm) against the dequantized "
                                       "product",
    "tests/model/int4/test_install.py": "q/k/v and gate/up fused into one layer of the device's INT4 kernel",
    "tests/model/int4/test_checkpoint.py": "AWQ / GPTQ folders loaded for CUDA, resident and streamed from host "
                                           "memory",
    "tests/model/test_weight_stream.py": "decoder layers streamed through device slots on a side stream, float and "
                                         "INT4",
}


def is_gpu_smoke(relative_path: str) -> bool:
    """Whether a test file (its path from the repository root, forward slashes) is in the subset."""
    return relative_path in GPU_SMOKE
