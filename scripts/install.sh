#!/usr/bin/env bash
# Create the virtual environment (if absent) and install the pinned
# dependencies into it. Safe to run again: pip skips what is installed.
#
# Environment:
#   PYTHON      interpreter that creates the venv   (default: python3)
#   VENV        venv folder                         (default: .venv)
#   TORCH_SPEC  pip arguments that install torch    (default: torch==2.13.0)
#               The default takes the index's torch: from PyPI on Linux, the
#               CUDA build with several GB of CUDA libraries. A CPU-only machine:
#               TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "Creating ${VENV} with $(${PYTHON} --version 2>&1)"
    "${PYTHON}" -m venv "${VENV}"
fi
pip=("${VENV}/bin/python" -m pip install --quiet)

# torch first and alone: TORCH_SPEC picks the build (CPU or CUDA). It is
# split into words on purpose, so that it can carry an --index-url.
# shellcheck disable=SC2086
"${pip[@]}" ${TORCH_SPEC}

# Pin the torch just installed while installing the rest, so that no other
# requirement can replace it with a different (e.g. CUDA) build.
constraints="$(mktemp)"
trap 'rm -f "${constraints}"' EXIT
"${VENV}/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' >"${constraints}"

"${pip[@]}" --constraint "${constraints}" -r requirements.txt -r requirements-dev.txt

"${VENV}/bin/python" - <<'PY'
import torch, transformers, ts.version, model_archiver.version
print(
    f"Installed torch {torch.__version__}, transformers {transformers.__version__}, "
    f"torchserve {ts.version.__version__}, "
    f"torch-model-archiver {model_archiver.version.__version__}"
)
PY
