"""The kernels compile for a real GPU target (sm_90) without a GPU: the interpreter accepts code that the
compiler rejects (types changing across branches, unsupported ops), so CI compiles them ahead of time too.

Runs in a subprocess: tests/model/conftest.py set TRITON_INTERPRET=1 for this process, and compiling needs the
kernels decorated as real JIT functions. One dtype/head-dim variant per kernel keeps this to seconds.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvboost.model.attention.support import triton_available

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvboost.model.attention import decode, prefill

def compile(fn, types, consts, **options):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=options)

dt = "bf16"
io = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "Out": f"*{dt}", "Ends": "*i32", "Valid": "*u8",
      "MidO": "*fp32", "MidL": "*fp32", "qk_scale": "fp32"}
flags = dict(HAS_ENDS=True, HAS_VALID=False, IEEE=False, DOT_F32=False)
k = compile(prefill._prefill_kernel, io, dict(HEAD_DIM=80, D_PAD=128, GROUP=8, BLOCK_M=128, BLOCK_N=64, **flags),
            num_warps=8, num_stages=3)
print("prefill", k.metadata.shared)
k = compile(decode._split_kernel, io, dict(HEAD_DIM=128, D_PAD=128, GROUP=8, BLOCK_M=128, BLOCK_N=64, **flags),
            num_warps=8, num_stages=3)
print("split", k.metadata.shared)
k = compile(decode._split_kernel, io, dict(HEAD_DIM=96, D_PAD=128, GROUP=4, BLOCK_M=16, BLOCK_N=64,
            HAS_ENDS=False, HAS_VALID=True, IEEE=False, DOT_F32=False), num_warps=4, num_stages=2)
k = compile(decode._reduce_kernel, io, dict(HEAD_DIM=128, D_PAD=128, GROUP=8, BLOCK_M=8, BLOCK_S=8,
            HAS_ENDS=True), num_warps=8)
print("reduce ok")
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install 'kvboost[gpu]')")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    assert lines[0] == "prefill" and int(lines[1]) <= 227 * 1024  # fits an H100's shared memory per block
    assert lines[2] == "split" and int(lines[3]) <= 227 * 1024
    assert "reduce" in run.stdout
