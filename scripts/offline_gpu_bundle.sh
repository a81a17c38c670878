#!/usr/bin/env bash
# Bundle what a GPU machine without internet needs to run scripts/gpu_check.sh on this checkout.
#
#   scripts/offline_gpu_bundle.sh [PYTHON_VERSION]      (default 3.12: the GPU image's python3)
#
# Writes two git-ignored folders at the repository root, small enough to travel with the working tree:
#   .whl/            wheels of kvboost's dependencies that a torch + transformers + triton image lacks
#                    (the grammar library, the server stack, the GGUF reader, jsonschema, redis-py, openai),
#                    for Linux x86-64 and that Python version (no dependencies resolved: the list is explicit)
#   .gpu/tokenizer/  the embedded SmolLM2 tokenizer's files (a few MB; the 94 MB GGUF is not needed by the fast
#                    tests or by `--shape` benchmarks)
#   .gpu/setup.sh    to `source` on the machine from the repository root: installs the wheels into /tmp/site,
#                    sets PYTHONPATH (the wheels, src for kvboost, and the repository root for the `benchmarks`
#                    package that `kvboost bench` imports) and KVBOOST_TOKENIZER, prints the GPU and versions
# Then, on the machine, one command of at most 9 minutes (see scripts/gpu_check.sh for its steps and caps):
#   source .gpu/setup.sh && KVBOOST_GPU_CHECK_OUT=$OUT bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${1:-3.12}"
PYTHON="${PYTHON:-python}"

# name==version as installed here (the versions CI tests), for the packages a bare GPU image lacks
packages=(xgrammar apache-tvm-ffi gguf fastapi opentelemetry-api sse-starlette uvicorn starlette jsonschema referencing
          rpds-py jsonschema-specifications pydantic pydantic-core annotated-types typing-inspection redis openai
          distro jiter sniffio)
pins=()
for p in "${packages[@]}"; do
    v=$("$PYTHON" -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [[ -n "$v" ]] || { echo "$p is not installed here: pip install -e '.[all]' first" >&2; exit 1; }
    pins+=("$p==$v")
done
mkdir -p .whl .gpu/tokenizer
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"

model_dir=$("$PYTHON" -c "from kvboost.loading import embedded_model_dir; print(embedded_model_dir())")
for f in tokenizer.json tokenizer_config.json generation_config.json chat_template.jinja special_tokens_map.json; do
    [[ -f "$model_dir/$f" ]] && cp "$model_dir/$f" .gpu/tokenizer/
done

cat > .gpu/setup.sh <<'SETUP'
# source from the repository root on the GPU machine (written by scripts/offline_gpu_bundle.sh)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD KVBOOST_TOKENIZER=$PWD/.gpu/tokenizer PYTHONUNBUFFERED=1 PYTHON=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, triton, kvboost, benchmarks.gpu; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__, 'kvboost', kvboost.__version__)"
SETUP
du -sh .whl .gpu | sed 's/^/bundled: /'
