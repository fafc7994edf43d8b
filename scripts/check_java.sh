#!/usr/bin/env bash
# Check that a Java 17+ runtime is available: TorchServe's frontend is a Java
# program, and `torchserve --start` fails late and obscurely without one.
# Uses $JAVA_HOME/bin/java when JAVA_HOME is set, as torchserve does.
set -euo pipefail

REQUIRED_MAJOR=17

if [[ -n "${JAVA_HOME:-}" ]]; then
    java_bin="${JAVA_HOME}/bin/java"
else
    java_bin="$(command -v java || true)"
fi

how_to_install() {
    cat >&2 <<MSG

TorchServe needs a Java ${REQUIRED_MAJOR}+ runtime.
  Debian/Ubuntu:  sudo apt-get install -y openjdk-17-jre-headless
  Fedora/RHEL:    sudo dnf install -y java-17-openjdk-headless
  macOS:          brew install openjdk@17
  Other systems:  install any JDK or JRE ${REQUIRED_MAJOR} or newer, then put 'java' on
                  PATH or set JAVA_HOME.
MSG
}

if [[ -z "${java_bin}" || ! -x "${java_bin}" ]]; then
    echo "error: no Java runtime found (looked for ${java_bin:-java on PATH})." >&2
    how_to_install
    exit 1
fi

# The first line looks like: openjdk version "17.0.15" 2025-04-15
# (or "1.8.0_392" for Java 8, whose major version is the second number).
version_line="$("${java_bin}" -version 2>&1 | head -n 1)"
version="$(sed -E 's/.*version "([^"]+)".*/\1/' <<<"${version_line}")"
major="${version%%[^0-9]*}"  # "17.0.15" -> 17, "21-ea" -> 21
if [[ "${major}" == "1" ]]; then
    major="$(cut -d. -f2 <<<"${version}")"
fi

if ! [[ "${major}" =~ ^[0-9]+$ ]]; then
    echo "error: could not read the Java version from: ${version_line}" >&2
    how_to_install
    exit 1
fi
if (( major < REQUIRED_MAJOR )); then
    echo "error: found Java ${version} at ${java_bin}, but TorchServe needs ${REQUIRED_MAJOR}+." >&2
    how_to_install
    exit 1
fi
echo "Java ${version} found at ${java_bin}"
