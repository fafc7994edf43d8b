"""End-to-end: scripts.serving.serve_pair, the serve section of the GPU check, on the CPU with the tiny pair.

It starts its own TorchServe (scripts.serving.torchserve.private_server, token auth on), registers the pair,
asks every route, times REST against the same engine in-process at C = 1, 4 and 16 (tiny sizes: a
check of the steps, not a figure), scales a static-batching archive's workers and unregisters both;
then `generate` on the greedy prompts.
"""

from __future__ import annotations

import json
import os
import tempfile

from scripts.serving import serve_pair

CONCURRENCIES = (1, 4, 16)


def test_serve_section_on_the_cpu(java_runtime, tiny_models_dir, tmp_path, monkeypatch):
    out = tmp_path / "serve"
    made = []  # the script's scratch folder (in the system's temp folder: a server's socket path must be short)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *args, **kwargs: made.append(mkdtemp(*args, **kwargs)) or made[-1])
    argv = [
        str(out), "--tiny", str(tiny_models_dir), "--concurrency", ",".join(map(str, CONCURRENCIES)),
        "--max-new-tokens", "8", "--requests-per-client", "1", "--set", "cpu_threads=1", "--set", "adaptive_k=false",
    ]  # fmt: skip

    exit_code = serve_pair.main(argv)

    tiny = json.loads((out / "serve.json").read_text())["tiny"]
    assert tiny["errors"] == [] and exit_code == 0, tiny["errors"]
    assert made and not any(map(os.path.exists, made)), "a run without errors leaves no weights or logs behind"
    assert tiny["java"] == java_runtime.describe()
    # Every native request counted once on /metrics; every OpenAI route generated.
    assert tiny["metrics"]["SpecRequests counted"] == tiny["metrics"]["requests sent"] == 6
    assert set(tiny["openai"]) == {"chat", "completions", "responses"} and all(tiny["openai"].values())
    assert tiny["workers"] == {"scaled_up": 2, "scaled_down": 1}
    assert tiny["unregistered"] is True
    assert tiny["greedy_equal_to_generate"] == {"equal": 3, "requests": 3}
    for row in (serve_pair.PLAIN, serve_pair.SHIPPED):
        cells = tiny["costs"][row]
        assert sorted(int(c) for c in cells) == list(CONCURRENCIES)
        for concurrency, cell in cells.items():
            assert cell["rest_tokens_per_s"] > 0 and cell["in_process_tokens_per_s"] > 0, (row, concurrency)
            # float32: REST and the engine in-process give the same greedy tokens, whatever the batching.
            assert cell["same_tokens"] == cell["requests"] == max(4, int(concurrency)), (row, concurrency)
    markdown = (out / "serve.md").read_text()
    assert "| row | C | in-process tok/s | REST tok/s | REST / in-process | same tokens |" in markdown
