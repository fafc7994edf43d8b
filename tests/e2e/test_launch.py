"""scripts.launch as a user runs it: a Llama pair from two folders, then from Hub ids in a cache,
offline, served by a real TorchServe that the launcher starts, with token authorization on.

- greedy over REST equal to Hugging Face `generate` on the target, in float32; the `openai`
  client's answer equal to the native route's;
- no weight copied: the model folder's model files are links, and TorchServe links the folder;
- a second run with other settings registers the pair again with them;
- the recipe in docs/models.md, run as written there with the tiny pair for its models, and the
  curl command and the `openai` lines it prints.

The server runs in a temporary folder (its key file, logs, pid file and model store) on free
ports, and is always stopped in teardown.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch

from handler.planning.measure import CACHE_FILE_PREFIX
from scripts.serving import torchserve
from tests.conftest import REPO_ROOT
from tests.e2e.conftest import HTTP_TIMEOUT_S
from tests.scripts.test_launch import add_to_hub_cache, tiny_llama_pair

PROMPTS = ["def fibonacci(n):", "x = [1, 2, 3]\nfor i in x:"]
NUM_TOKENS = 16
# The tiny random pair drafts badly, so a planner would stop drafting: fixed k here; one thread
# each, on a busy machine; float32 for exactness.
TEST_SETTINGS = ("--set", "adaptive_k=false", "--set", "cpu_threads=1", "--set", "dtype=float32")
HUB_TARGET, HUB_DRAFT = "tiny-org/llama-target", "tiny-org/llama-draft"


def consecutive_free_ports(count: int) -> int:
    """A port P such that P .. P + count - 1 are free on 127.0.0.1 (the launcher's layout)."""
    for _ in range(100):
        base = torchserve.free_ports(1)[0]
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


@dataclasses.dataclass
class Launcher:
    root: Path  # the launcher's working folder: key_file.json, logs/, model_store/
    env: dict[str, str]
    port: int
    target: Path
    draft: Path
    cache: Path

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """`python -m scripts.launch ARGS --port PORT` from the root folder."""
        command = [sys.executable, "-m", "scripts.launch", *args, "--port", str(self.port)]
        return subprocess.run(command, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=900)

    def keys(self) -> dict[str, str]:
        keys = torchserve.read_keys(self.root / "key_file.json")
        assert keys is not None, "token authorization is on: the server writes its keys"
        return keys

    def predict(self, model_name: str, body: dict) -> dict:
        headers = {"Authorization": f"Bearer {self.keys()['inference']}"}
        url = f"{self.inference_url}/predictions/{model_name}"
        response = requests.post(url, json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, f"{response.status_code}: {response.text}\n{self.log_tail()}"
        return response.json()

    def unregister(self, model_name: str) -> None:
        headers = {"Authorization": f"Bearer {self.keys()['management']}"}
        torchserve.unregister(f"http://127.0.0.1:{self.port + 1}", model_name, headers)

    def log_tail(self) -> str:
        return "\n".join(torchserve.log_tail(self.root / "logs" / name) for name in ("model_log.log", "console.log"))


def ran(result: subprocess.CompletedProcess, launcher: Launcher) -> str:
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{launcher.log_tail()}"
    return result.stdout


def stop(root: Path, env: dict[str, str]) -> None:
    """`torchserve --stop` as the launcher's server was started; then its process group, if left."""
    pid_file = Path(env["TMPDIR"]) / ".model_server.pid"
    pid = int(pid_file.read_text().strip()) if pid_file.is_file() else None
    torchserve.stop_server(cwd=root, env=env)
    if pid is not None:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def launcher(java_runtime, tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    temp_dir, cache = root / "tmp", root / "hub-cache"
    temp_dir.mkdir()
    target, draft = tiny_llama_pair(tmp_path_factory.mktemp("llama"))
    add_to_hub_cache(cache, HUB_TARGET, target)
    add_to_hub_cache(cache, HUB_DRAFT, draft)
    env = dict(os.environ)
    env.pop("TS_CONFIG_FILE", None)  # it would override the launcher's config.properties
    env.update(
        PYTHONPATH=str(REPO_ROOT),
        # TorchServe's pid file, the Java temp folder and the models' links go here.
        TMPDIR=str(temp_dir),
        TEMP=str(temp_dir),
        TMP=str(temp_dir),
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
    )
    try:
        yield Launcher(root, env, consecutive_free_ports(5), target, draft, cache)
    finally:
        stop(root, env)


@pytest.fixture(scope="module")
def reference(launcher) -> dict[str, list[int]]:
    """Each prompt's greedy continuation by `generate` on the target folder, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(launcher.target)
    model = AutoModelForCausalLM.from_pretrained(launcher.target, dtype=torch.float32).eval()
    continuations = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            output = model.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False)
        continuations[prompt] = output[0, len(ids) :].tolist()
    return continuations


def assert_greedy_equals_generate(launcher: Launcher, model_name: str, reference: dict) -> None:
    for prompt, expected in reference.items():
        answer = launcher.predict(model_name, {"prompt": prompt, "max_new_tokens": NUM_TOKENS, "temperature": 0})
        assert answer["token_ids"] == expected, prompt
        assert answer["speculative"]["draft_tokens"] > 0, answer  # the draft model drafted


def assert_linked(folder: Path, sources: dict[str, Path]) -> None:
    """Every model file in the folder is a link to the model's own; no weight is a file of its own."""
    for role, source in sources.items():
        files = sorted(path for path in (folder / role).rglob("*") if not path.is_dir())
        assert files, role
        assert all(path.is_symlink() for path in files), files
        assert {path.resolve() for path in files} == {path.resolve() for path in source.iterdir()}
    copied = [path for path in folder.rglob("*.safetensors") if not path.is_symlink()]
    assert copied == []


def test_a_llama_pair_from_two_folders_serves_rest_and_openai_equal_to_generate(launcher, reference):
    import openai

    args = ("--target", str(launcher.target), "--draft", str(launcher.draft), "--model-name", "llama-pair")
    out = ran(launcher.run(*args, *TEST_SETTINGS, "--drafter", "model"), launcher)
    assert "started TorchServe" in out and "curl -s" in out and "OpenAI(base_url=" in out

    assert_greedy_equals_generate(launcher, "llama-pair", reference)
    messages = [{"role": "user", "content": "Write a haiku"}]
    native = launcher.predict("llama-pair", {"messages": messages, "max_new_tokens": NUM_TOKENS, "temperature": 0})
    base_url = f"{launcher.inference_url}/predictions/llama-pair/1.0/v1"
    client = openai.OpenAI(base_url=base_url, api_key=launcher.keys()["inference"], timeout=HTTP_TIMEOUT_S)
    chat = client.chat.completions.create(model="llama-pair", messages=messages, max_tokens=NUM_TOKENS, temperature=0)
    assert chat.choices[0].message.content == native["text"]

    folder = launcher.root / "model_store" / "llama-pair"
    assert_linked(folder, {"target": launcher.target, "draft": launcher.draft})
    # TorchServe serves a no-archive folder through a link in its temp folder, not a copy.
    served = list((Path(launcher.env["TMPDIR"]) / "models").glob("*/llama-pair"))
    assert served and all(path.is_symlink() and path.resolve() == folder for path in served)


def test_a_second_run_with_other_settings_registers_the_pair_again(launcher, reference):
    args = ("--target", str(launcher.target), "--draft", str(launcher.draft), "--model-name", "llama-pair")
    settings = ("--set", "num_speculative_tokens=2", "--set", "max_new_tokens=5", "--drafter", "model")
    out = ran(launcher.run(*args, *TEST_SETTINGS, *settings), launcher)
    assert "TorchServe is running at" in out and "unregistering the running llama-pair" in out
    prompt = PROMPTS[0]
    answer = launcher.predict("llama-pair", {"prompt": prompt, "temperature": 0})  # the new defaults
    assert answer["token_ids"] == reference[prompt][:5]
    assert answer["speculative"]["num_speculative_tokens"] == 2
    launcher.unregister("llama-pair")


def test_hub_ids_serve_offline_from_a_populated_cache(launcher, reference):
    args = ("--target", HUB_TARGET, "--draft", HUB_DRAFT, "--drafter", "model")
    out = ran(launcher.run(*args, *TEST_SETTINGS), launcher)
    assert "served llama-target" in out  # the Hub repository's name
    assert_greedy_equals_generate(launcher, "llama-target", reference)
    snapshots = {role: next((launcher.cache / f"models--tiny-org--llama-{role}" / "snapshots").iterdir())
                 for role in ("target", "draft")}  # fmt: skip
    assert_linked(launcher.root / "model_store" / "llama-target", snapshots)
    launcher.unregister("llama-target")


def documented_launch() -> list[str]:
    """The launch command of the recipe in docs/models.md, as its words."""
    text = (REPO_ROOT / "docs" / "models.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if "scripts.launch" in line]
    assert lines, "docs/models.md shows the scripts.launch command"
    return shlex.split(lines[0])


def test_the_recipe_in_docs_models_md_runs_as_written(launcher):
    words = documented_launch()
    assert words[:3] == [".venv/bin/python", "-m", "scripts.launch"], words
    # The tiny pair, from the cache, for the models the recipe names.
    for flag, tiny in (("--target", HUB_TARGET), ("--draft", HUB_DRAFT)):
        words[words.index(flag) + 1] = tiny
    out = ran(launcher.run(*words[3:], "--model-name", "recipe"), launcher)

    # The curl command it prints answers.
    native = next(line.strip() for line in out.splitlines() if line.strip().startswith("curl") and "/v1/" not in line)
    answer = subprocess.run(["bash", "-c", native], capture_output=True, text=True, timeout=HTTP_TIMEOUT_S)
    assert '"text"' in answer.stdout and '"token_ids"' in answer.stdout, answer
    # So do the openai lines.
    start = out.splitlines().index("with the openai client:")
    snippet = "\n".join(line.strip() for line in out.splitlines()[start + 1 : start + 5])
    printed = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=HTTP_TIMEOUT_S)
    assert printed.returncode == 0 and printed.stdout.strip(), printed

    # The worker cached its cost table in the model folder; a second run keeps it, and reads it.
    folder = launcher.root / "model_store" / "recipe"
    tables = sorted(path.name for path in folder.glob(f"{CACHE_FILE_PREFIX}*.json"))
    assert tables, "adaptive_k (the template's) measured a cost table"
    # What the worker timed at start-up goes into the table's key: the second run names the same.
    log = (launcher.root / "logs" / "model_log.log").read_text()
    runner = re.findall(r"runner: auto chose (\w+)", log)[-1]
    quantization = re.findall(r"draft_quantization auto: .* -> (\w+)", log)[-1]
    settings = [f"runner={runner}", f"draft_quantization={quantization}", "max_new_tokens=8"]
    ran(launcher.run(*words[3:], "--model-name", "recipe", *(f"--set={item}" for item in settings)), launcher)
    assert sorted(path.name for path in folder.glob(f"{CACHE_FILE_PREFIX}*.json")) == tables
    assert "cost table read from" in (launcher.root / "logs" / "model_log.log").read_text()
    launcher.unregister("recipe")
