"""`kvboost bench gpu`: the GPU fast path's numbers side by side in one process (issue 14, point 1).

One module per section (fidelity, chat, prefix, decode, kernels), the settings and time budgets, the tables
(view) and the plot; command.py runs them in order and writes the JSON.
"""
from __future__ import annotations

from .command import bench_gpu_command, run_gpu_bench
from .settings import GpuBenchSettings

__all__ = ["GpuBenchSettings", "bench_gpu_command", "run_gpu_bench"]
