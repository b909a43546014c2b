#!/usr/bin/env bash
# The one GPU command: `bash bench/gpu_run.sh [gpu_check flags]`, from the project's root, on a
# bare GPU machine that has torch, transformers, safetensors, tokenizers, jinja2 and uvloop but
# no package access. What it lacks comes from .whl/, filled beforehand on a machine with PyPI:
#   bash ../shared/gpu/fetch-wheels.sh pytest pytest-timeout pluggy iniconfig packaging \
#       pygments hypothesis sortedcontainers attrs
# It installs them into a scratch folder (never into the machine's Python), runs the project
# from its tree (python -m, no console scripts), and ends with bench.gpu_check's exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
ls .whl/*.whl >/dev/null 2>&1 || {
  echo "no wheels in .whl/: run ../shared/gpu/fetch-wheels.sh (see this script's header)" >&2
  exit 2
}
site=$(mktemp -d)/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD"
export PATH="$site/bin:$PATH"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
exec python3 -m bench.gpu_check "$@"
