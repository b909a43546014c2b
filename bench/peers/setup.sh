#!/usr/bin/env bash
# Builds the virtual environment the benchmarks' `--peer vllm` side runs in: vLLM 0.33.0 without
# its dependencies, plus only what its KV-cache core (BlockPool, KVCacheManager, Scheduler) imports,
# over the CPU build of torch. Safe to run again on the same DIR: it only adds what is missing.
# Usage: bash bench/peers/setup.sh DIR  (a few minutes, about 3 GB); then --peer-python DIR/bin/python
set -euo pipefail

readonly VLLM_VERSION=0.33.0
readonly TORCH_VERSION=2.13.0+cpu # a CUDA torch would add gigabytes the peer never uses
readonly TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# What `import vllm.v1.core.sched.scheduler` pulls in, and nothing else.
readonly VLLM_IMPORTS=(
  numpy packaging msgspec cbor2 xxhash 'pydantic>=2.12' psutil cachetools regex cloudpickle pyzmq
  blake3 py-cpuinfo tqdm pyyaml urllib3 'transformers>=5.16.1,<5.21.0' aiohttp requests
  openai-harmony openai pillow pybase64 uvloop prometheus_client xgrammar fastapi
  partial_json_parser llguidance einops uvicorn watchfiles orjson
)

usage() {
  echo "usage: bash bench/peers/setup.sh DIR" >&2
  echo "  builds (or completes) a vLLM ${VLLM_VERSION} peer environment in DIR" >&2
  exit 2
}

# True when DIR's vLLM is the pinned one and its KV-cache core imports on the CPU.
check_peer() {
  VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$1/bin/python" -c "
import importlib.metadata
import vllm.v1.core.block_pool, vllm.v1.core.kv_cache_manager, vllm.v1.core.sched.scheduler
assert importlib.metadata.version('vllm') == '$VLLM_VERSION', importlib.metadata.version('vllm')
"
}

[[ $# -eq 1 && -n $1 && $1 != -* ]] || usage
dir=$1

if [[ -x $dir/bin/python ]] && check_peer "$dir" 2>/dev/null; then
  echo "vLLM peer already ready: --peer-python $dir/bin/python"
  exit 0
fi
if [[ ! -x $dir/bin/python ]]; then
  if [[ -e $dir && -n $(ls -A "$dir") ]]; then
    echo "$dir exists and is not a virtual environment: expected a new or empty directory" >&2
    exit 1
  fi
  python3 -m venv "$dir"
fi
pip=("$dir/bin/python" -m pip install -q)

# The exact +cpu version is served by a local wheel or mirror when there is one, else by PyTorch's
# CPU index; PyPI's own torch wheel is the CUDA build.
"${pip[@]}" "torch==$TORCH_VERSION" 2>/dev/null \
  || "${pip[@]}" --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
# Pinning torch in every later install keeps a dependency from swapping in the CUDA build.
echo "torch==$TORCH_VERSION" >"$dir/torch-cpu-constraint.txt"
"${pip[@]}" --no-deps "vllm==$VLLM_VERSION"
# pip then reports vLLM's other requirements as missing: on purpose, the core never imports them.
"${pip[@]}" -c "$dir/torch-cpu-constraint.txt" "${VLLM_IMPORTS[@]}"

check_peer "$dir"
echo "vLLM peer ready: --peer-python $dir/bin/python"
