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

# arctic-inference: the suffix drafter's C++ suffix tree. PyPI has only its source, and its
# default isolated build would pull an unpinned (CUDA) torch, so it is built here: in a build
# venv of its own that sees this venv's torch, with the build tools pinned, and without its
# optional dependencies (vLLM and the rest are never imported).
ARCTIC_SPEC="arctic-inference==0.3.0"
if ! "${VENV}/bin/python" -c 'import arctic_inference.suffix_decoding' 2>/dev/null; then
    if ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
        echo "error: building ${ARCTIC_SPEC} (the suffix drafter) needs a C++20 compiler, e.g." >&2
        echo "  sudo apt-get install g++    (Debian/Ubuntu; g++ 10 or newer)" >&2
        exit 1
    fi
    echo "Building ${ARCTIC_SPEC} (C++ suffix tree; about 30 s)"
    build="$(mktemp -d)"
    trap 'rm -f "${constraints}"; rm -rf "${build}"' EXIT
    "${VENV}/bin/python" -m venv "${build}/venv"
    "${build}/venv/bin/python" -m pip install --quiet \
        setuptools==84.2.1 wheel==0.48.0 ninja==1.13.2 cmake==4.4.5 nanobind==2.9.2
    # The build imports torch (for a path it does not use here): let it see this venv's.
    "${VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        >"$("${build}/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/serving-venv.pth"
    # CMake's FindPython would otherwise pick the first python3 on PATH, not the build venv's.
    CMAKE_ARGS="-DPython_EXECUTABLE=${build}/venv/bin/python" "${build}/venv/bin/python" -m pip wheel --quiet \
        --no-build-isolation --no-deps --no-binary arctic-inference -w "${build}/wheels" "${ARCTIC_SPEC}"
    "${pip[@]}" --no-deps "${build}"/wheels/arctic_inference-*.whl
fi

"${VENV}/bin/python" - <<'PY'
import torch, transformers, ts.version, model_archiver.version
print(
    f"Installed torch {torch.__version__}, transformers {transformers.__version__}, "
    f"torchserve {ts.version.__version__}, "
    f"torch-model-archiver {model_archiver.version.__version__}"
)
PY
