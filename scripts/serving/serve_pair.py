"""A target/draft pair served by a real TorchServe, every route a user calls, and what serving costs.

    python -m scripts.serving.serve_pair OUT_DIR                                  # the tiny pair, float32
    python -m scripts.serving.serve_pair OUT_DIR --pairs tiny,0.5B-1.5B,0.5B-7B   # on a GPU: Qwen2.5 shapes, bf16
    python -m scripts.bench.gpu_check OUT_DIR --sections serve                  # the same three, in the GPU check

The tiny pair (scripts.model_tools.make_tiny_models) is packaged into a `.mar` by
scripts.model_tools.package_mar, with model-config.yaml in float32; the random-weight Qwen2.5 shapes
(scripts.bench.gpu_check's, nothing downloaded), with the shipped qwen-coder.yaml in bf16, go into
TorchServe's no-archive layout with their files linked (as scripts.launch writes it), since zipping
and unzipping 16 GB twice would take longer than the whole check. Then, through scripts.serving.torchserve, on free
loopback ports with token authorization on:

1. `torchserve --start`, and the archive registered through the management API;
2. native REST, greedy, not streamed and streamed: the same tokens both ways, and the handler's
   request counter on `/metrics` up by as many requests;
3. the OpenAI chat, completions and Responses routes through the `openai` client;
4. what serving costs, over REST: tokens/s of a closed loop at each concurrency C, for plain
   decoding (`num_speculative_tokens: 0`) and for the config as shipped;
5. the workers scaled to 2 and back to 1 through the management API, answering at each count, on
   a second archive of the pair with `continuousBatching: false`; both unregistered, the server
   stopped. (Under continuous batching TorchServe 0.12 stalls a model with 2 workers: an idle
   worker waits for the next request while holding the job queue's lock, and the busy worker
   cannot take its next step until one arrives; docs/operations.md.)

Then in-process, on the engine the handler builds from the same config and folders (the same
cost-table measurement, prefix-cache budget and runner choice): the same requests of step 4 through
`scripts.bench.runner.drive`, with at most batchSize in flight, as TorchServe feeds a worker; and, for
the tiny pair in float32, Hugging Face `generate` on each prompt of step 2, which REST must equal
token for token. REST's tokens/s over the in-process figure is TorchServe's share of a request: its
frontend, batching, the worker's socket and the JSON.

A failed or malformed answer, a refused call or an unequal output is an error; `serve.json` and
`serve.md` go to OUT_DIR, and the exit status is 1 with any error. The real shapes' random weights
make their drafts rejected and their text noise: their rows time the serving path, not a speedup.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import requests
import yaml

from scripts.serving import torchserve

logger = logging.getLogger("serve_pair")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY, PAIR_05_15, PAIR_05_7 = "tiny", "0.5B-1.5B", "0.5B-7B"
PAIRS = (TINY, PAIR_05_15, PAIR_05_7)
PLAIN, SHIPPED = "plain", "shipped"
HTTP_TIMEOUT_S = 600.0
# Prompts whose answers are compared with `generate`; each goes over REST twice (plain, streamed).
GREEDY_PROMPTS = ("def fibonacci(n):", "The quick brown fox", "Once upon a time there was a little robot")
TASKS = (
    "merges two sorted lists",
    "checks whether a string is a palindrome",
    "flattens a nested list",
    "returns the n-th Fibonacci number",
    "implements binary search",
    "removes duplicates from a list, keeping their order",
    "converts a Roman numeral to an integer",
    "transposes a matrix",
)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A pair as it is packaged: the folder with target/ and draft/, the model config and its dtype."""

    name: str
    folder: pathlib.Path
    config: pathlib.Path
    dtype: str

    @property
    def model_name(self) -> str:
        return f"spec-{self.name}"

    @property
    def exact(self) -> bool:
        """Greedy over REST must equal `generate` (float32: no rounding differs between the two)."""
        return self.dtype == "float32"


def tiny_pair(folder: pathlib.Path | None, scratch: pathlib.Path) -> Pair:
    """The tiny pair in `folder`, else built into `scratch` by scripts.model_tools.make_tiny_models."""
    if folder is None:
        from scripts.model_tools import make_tiny_models

        folder = scratch / "tiny"
        make_tiny_models.main(["--out", str(folder)])
    return Pair(TINY, folder, REPO_ROOT / "model-config" / "model-config.yaml", "float32")


def shaped_pair(name: str, scratch: pathlib.Path, gpu_id: int | None) -> Pair:
    """Random-weight Qwen2.5 shapes (scripts.bench.gpu_check.SHAPES) saved in bf16 with the tiny tokenizer."""
    import torch

    from scripts.bench import gpu_check

    draft_shape, target_shape = name.split("-")
    folder = scratch / name
    device = torch.device("cpu" if gpu_id is None else f"cuda:{gpu_id}")
    tokenizer = gpu_check.text_tokenizer()
    for role, shape in (("draft", draft_shape), ("target", target_shape)):
        model = gpu_check.build_model(gpu_check.SHAPES[shape], device, torch.bfloat16)
        model.save_pretrained(folder / role)
        tokenizer.save_pretrained(folder / role)
        del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Pair(name, folder, REPO_ROOT / "model-config" / "qwen-coder.yaml", "bfloat16")


def model_config(pair: Pair, overrides: dict[str, Any]) -> dict:
    """The pair's model-config.yaml with its dtype and `overrides` (handler keys) applied."""
    config = yaml.safe_load(pair.config.read_text())
    config["handler"].update(dtype=pair.dtype, **overrides)
    return config


def package(pair: Pair, archive: str, model_yaml: dict, root: pathlib.Path, store: pathlib.Path) -> str:
    """The pair in the model store as TorchServe registers it; returns the url to register.

    The tiny pair goes into a `.mar` by torch-model-archiver, the product's own path. The real shapes'
    gigabytes would be zipped (and unzipped at registration) twice over, so they go into TorchServe's
    no-archive layout with their files linked, as `scripts.launch` writes it."""
    if pair.exact:
        from scripts.model_tools import package_mar

        config_file = root / f"{archive}.yaml"
        config_file.write_text(yaml.safe_dump(model_yaml, sort_keys=False))
        package_mar.package(archive, pair.folder / "target", pair.folder / "draft", config_file, store)
        return f"{archive}.mar"
    from scripts import launch

    store.mkdir(parents=True, exist_ok=True)
    launch.write_model_folder(store / archive, archive, model_yaml, pair.folder / "target", pair.folder / "draft")
    return archive


def bodies(tag: str, num: int, max_new_tokens: int, extra: dict) -> list[dict]:
    """`num` distinct greedy native requests: no two share more than a few prompt tokens."""
    return [
        {
            "prompt": f"Request {tag}-{index}. Write a Python function that {TASKS[index % len(TASKS)]}.",
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            **extra,
        }
        for index in range(num)
    ]


ROW_EXTRA = {PLAIN: {"num_speculative_tokens": 0}, SHIPPED: {}}


class Story:
    """What one pair's run saw: the errors, the checks' figures, and the REST answers to compare later."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.data: dict[str, Any] = {}

    def error(self, what: str, detail: Any) -> None:
        message = f"{what}: {detail}"
        logger.error("%s", message)
        self.errors.append(message[:2000])


def rest_load(
    server: torchserve.PrivateServer, name: str, load: list[dict], concurrency: int, story: Story, what: str
) -> tuple[list[torchserve.Answer | None], float]:
    """`load` over REST, a closed loop of `concurrency` clients; the answers (None: failed) and the wall time."""
    local = threading.local()
    headers = server.headers()

    def one(body: dict) -> torchserve.Answer | None:
        if not hasattr(local, "session"):  # one keep-alive session per client thread
            local.session = requests.Session()
        try:
            answer = torchserve.generate(
                server.inference_url, name, body, headers, server.key_file, HTTP_TIMEOUT_S, session=local.session
            )
        except (torchserve.ClientError, requests.RequestException, ValueError) as error:
            story.error(what, f"{type(error).__name__}: {error}")
            return None
        if answer.problems:
            story.error(what, "; ".join(answer.problems))
        return answer

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(one, load))
    return answers, time.perf_counter() - start


def native_checks(
    server: torchserve.PrivateServer, name: str, max_new_tokens: int, exact: bool, story: Story
) -> list[list[int]]:
    """Native REST, not streamed and streamed, and the request counter on /metrics; the answers' tokens.

    The streamed request comes second and finds its prompt in the prefix cache, so its prompt's last
    positions are computed in another shape: in bf16 that may flip a near-tie, and random weights are
    all near-ties. Equal tokens are required where `exact` (float32), else counted."""
    before = spec_requests(server)
    outputs, same = [], 0
    for prompt in GREEDY_PROMPTS:
        body = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0}
        [plain], _ = rest_load(server, name, [body], 1, story, "native REST")
        [streamed], _ = rest_load(server, name, [{**body, "stream": True}], 1, story, "native REST, streamed")
        if plain is None or streamed is None:
            outputs.append(None)
            continue
        if streamed.num_lines < 2:
            story.error("native REST, streamed", f"{streamed.num_lines} line(s) for {len(streamed.token_ids)} tokens")
        same += streamed.token_ids == plain.token_ids
        if exact and streamed.token_ids != plain.token_ids:
            story.error("native REST", f"streamed {streamed.token_ids} != not streamed {plain.token_ids}")
        outputs.append(plain.token_ids)
    story.data["streamed_same_as_not"] = f"{same} of {len(GREEDY_PROMPTS)}"
    counted = spec_requests(server) - before
    story.data["metrics"] = {"SpecRequests counted": counted, "requests sent": 2 * len(GREEDY_PROMPTS)}
    if counted != 2 * len(GREEDY_PROMPTS):
        story.error("/metrics", f"SpecRequests grew by {counted} for {2 * len(GREEDY_PROMPTS)} requests")
    return outputs


def worker_runner(server: torchserve.PrivateServer) -> str | None:
    """The runner the worker chose at start (`runner: auto`), from its log; None if it logged no choice."""
    log = server.root / "logs" / "model_log.log"
    found = re.findall(r"runner: auto chose (\w+)", log.read_text(errors="replace")) if log.is_file() else []
    return found[-1] if found else None


def spec_requests(server: torchserve.PrivateServer) -> float:
    """The handler's request counter, summed over its labels (model, worker, host)."""
    samples = torchserve.metric_samples(server.metrics_url)
    return sum(value for sample, _, value in samples if sample == "SpecRequests")


def openai_checks(server: torchserve.PrivateServer, name: str, story: Story) -> None:
    """The chat, completions and Responses routes through the official client, with the inference key."""
    import openai

    from scripts.serving import openai_demo

    client = openai.OpenAI(
        base_url=openai_demo.base_url(server.inference_url, name),
        api_key=(server.keys or {}).get("inference", "unused"),
        timeout=HTTP_TIMEOUT_S,
        max_retries=0,
    )
    ask = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    calls = {
        "chat": lambda: client.chat.completions.create(model=name, messages=ask, max_completion_tokens=16).usage,
        "completions": lambda: client.completions.create(model=name, prompt="def add(a, b):", max_tokens=16).usage,
        "responses": lambda: client.responses.create(model=name, input="Say hello.", max_output_tokens=16).usage,
    }
    answered = {}
    for route, call in calls.items():
        try:
            usage = call()
        except openai.OpenAIError as error:
            story.error(f"OpenAI {route}", f"{type(error).__name__}: {error}")
            continue
        tokens = getattr(usage, "completion_tokens", None) or getattr(usage, "output_tokens", 0)
        answered[route] = tokens
        if not tokens:
            story.error(f"OpenAI {route}", f"no tokens generated ({usage})")
    story.data["openai"] = answered


def rest_costs(
    server: torchserve.PrivateServer, name: str, concurrencies: list[int], num_requests, max_new_tokens: int, story
) -> dict[str, dict[int, dict]]:
    """Tokens/s over REST at each C, plain and as shipped, after a warm-up round at the largest C."""
    top = max(concurrencies)
    for row, extra in ROW_EXTRA.items():
        rest_load(server, name, bodies(f"warm-{row}", num_requests(top), max_new_tokens, extra), top, story, "warm-up")
    costs: dict[str, dict[int, dict]] = {row: {} for row in ROW_EXTRA}
    for concurrency in concurrencies:
        for row, extra in ROW_EXTRA.items():
            load = bodies(f"{row}-{concurrency}", num_requests(concurrency), max_new_tokens, extra)
            answers, seconds = rest_load(server, name, load, concurrency, story, f"REST load, {row}, C={concurrency}")
            tokens = [answer.token_ids if answer else None for answer in answers]
            done = sum(len(t) for t in tokens if t)
            costs[row][concurrency] = {"rest_tokens_per_s": done / seconds, "rest_tokens": tokens}
    return costs


def scaling(
    server: torchserve.PrivateServer, name: str, url: str, outputs: list, max_new_tokens: int, exact: bool, story: Story
) -> None:
    """The static-batching archive `name` registered, scaled to 2 workers and back to 1 through the management
    API, answering the greedy prompts at each count (the same tokens as the continuous archive where `exact`,
    or else the count of those that are),
    then unregistered."""
    management = server.headers("management")
    load = [
        {"prompt": GREEDY_PROMPTS[index % len(GREEDY_PROMPTS)], "max_new_tokens": max_new_tokens, "temperature": 0}
        for index in range(4)
    ]
    seen, same = {}, {}
    try:
        torchserve.register(server.management_url, url, name, management)
        for label, count in (("scaled_up", 2), ("scaled_down", 1)):
            torchserve.scale_workers(server.management_url, name, count, management)
            workers = torchserve.model_workers(server.management_url, name, management)
            seen[label] = sum(worker.get("status") == "READY" for worker in workers)
            if seen[label] != count or len(workers) != count:
                story.error(f"scaling to {count} workers", f"{seen[label]} ready: {workers}")
            what = f"REST with {count} worker(s), static batching"
            answers, _ = rest_load(server, name, load, len(load), story, what)
            equal = 0
            for index, answer in enumerate(answers):
                expected = outputs[index % len(outputs)]
                if answer is None or expected is None:
                    continue
                equal += answer.token_ids == expected
                if exact and answer.token_ids != expected:
                    story.error(what, f"{answer.token_ids} != continuous batching's {expected}")
            same[label] = f"{equal} of {len(load)}"
        torchserve.unregister(server.management_url, name, management)
        if name in torchserve.registered_models(server.management_url, management):
            story.error("unregister", f"{name} is still listed")
    except torchserve.ClientError as error:
        story.error("scaling", error)
    story.data["workers"] = seen
    story.data["static_same_as_continuous"] = same


def in_process(pair: Pair, config: dict, gpu_id: int | None):
    """The pair loaded and the engine built from `config` as the handler's `initialize` builds them."""
    from handler.config import handler_config_from_yaml_config
    from handler.engine import engine_from_config
    from handler.runtime.loading import load_models

    handler_config = handler_config_from_yaml_config(config)
    models = load_models(handler_config, str(pair.folder), gpu_id)
    engine = engine_from_config(models, handler_config, max_batch_size=int(config.get("batchSize", 1)))
    return models, handler_config, engine


def in_process_costs(models, handler_config, engine, costs, batch_size, num_requests, max_new_tokens) -> None:
    """The requests of `rest_costs` on the engine itself, through the same request parser, at most
    batch_size in flight (TorchServe's batch); tokens/s and whether each output equals REST's."""
    from handler.api.native import parse_request
    from scripts.bench.runner import drive

    def requests_for(load: list[dict]):
        return [parse_request(body, handler_config, models.tokenizer, models.max_context).generation for body in load]

    concurrencies = sorted(next(iter(costs.values())))
    top = max(concurrencies)
    for row, extra in ROW_EXTRA.items():
        warm = bodies(f"warm-{row}", num_requests(top), max_new_tokens, extra)
        drive(engine, requests_for(warm), None, min(top, batch_size))
    for concurrency in concurrencies:
        for row, extra in ROW_EXTRA.items():
            load = bodies(f"{row}-{concurrency}", num_requests(concurrency), max_new_tokens, extra)
            traffic = drive(engine, requests_for(load), None, min(concurrency, batch_size))
            outputs = [list(result.token_ids) for result in traffic.results]
            cell = costs[row][concurrency]
            cell["in_process_tokens_per_s"] = sum(len(o) for o in outputs) / max(traffic.done_at)
            cell["rest_over_in_process"] = cell["rest_tokens_per_s"] / cell["in_process_tokens_per_s"]
            cell["same_tokens"] = sum(rest == mine for rest, mine in zip(cell.pop("rest_tokens"), outputs))
            cell["requests"] = len(outputs)


def greedy_against_generate(models, handler_config, outputs: list, max_new_tokens: int, story: Story) -> None:
    """Hugging Face `generate` on each greedy prompt, against REST's answer, token for token."""
    from handler.api.native import parse_request
    from scripts.bench.runner import Runner, hf_target_only

    prompts = [
        parse_request({"prompt": prompt}, handler_config, models.tokenizer, models.max_context).generation.prompt_ids
        for prompt in GREEDY_PROMPTS
    ]
    reference = Runner(models, handler_config, None).run(hf_target_only(), prompts, max_new_tokens).outputs
    equal = sum(rest == expected for rest, expected in zip(outputs, reference))
    story.data["greedy_equal_to_generate"] = {"equal": equal, "requests": len(prompts)}
    for prompt, rest, expected in zip(GREEDY_PROMPTS, outputs, reference):
        if rest != expected:
            story.error("greedy over REST against generate", f"{prompt!r}: REST {rest}, generate {expected}")


def serve(
    pair: Pair,
    root: pathlib.Path,
    *,
    concurrencies: list[int],
    max_new_tokens: int,
    requests_per_client: int,
    overrides: dict[str, Any],
    gpu_id: int | None,
) -> dict:
    """One pair's whole story (the module's steps); returns the report's data, errors included."""
    story = Story()
    config = model_config(pair, overrides)
    batch_size = int(config.get("batchSize", 1))
    store = root / "model_store"
    static_name = f"{pair.model_name}-static"
    urls = {}
    for archive, model_yaml in ((pair.model_name, config), (static_name, {**config, "continuousBatching": False})):
        urls[archive] = package(pair, archive, model_yaml, root, store)

    def num_requests(concurrency: int) -> int:
        return max(4, requests_per_client * concurrency)

    # Greedy float32 output must not depend on how requests were batched where the kernels round each row
    # alike whatever the batch (the CPU's). cuBLAS picks its kernels by shape, so on CUDA a batch can round a
    # near-tie of the random tiny model the other way: there the counts are reported, and the one-request
    # answers must still equal `generate`.
    batch_invariant = pair.exact and gpu_id is None
    story.data["batch_invariant_checked"] = batch_invariant
    name, started = pair.model_name, time.perf_counter()
    outputs, costs = [None] * len(GREEDY_PROMPTS), {}
    try:
        with torchserve.private_server(root / "server", store) as server:
            story.data["java"] = server.process.java.describe()
            management = server.headers("management")
            story.data["registered"] = torchserve.register(server.management_url, urls[name], name, management)
            story.data["register_s"] = time.perf_counter() - started
            story.data["worker_runner"] = worker_runner(server)
            outputs = native_checks(server, name, max_new_tokens, pair.exact, story)
            openai_checks(server, name, story)
            costs = rest_costs(server, name, concurrencies, num_requests, max_new_tokens, story)
            torchserve.unregister(server.management_url, name, management)
            scaling(server, static_name, urls[static_name], outputs, max_new_tokens, batch_invariant, story)
            registered = torchserve.registered_models(server.management_url, management)
            if registered:
                story.error("unregister", f"still registered: {registered}")
            story.data["unregistered"] = not registered
    except torchserve.ClientError as error:
        story.error("server", error)
    if story.data.get("worker_runner"):
        # `runner: auto` times both runners at start, and on a busy machine two timings can choose apart.
        config["handler"]["runner"] = story.data["worker_runner"]
    models, handler_config, engine = in_process(pair, config, gpu_id)
    if costs:
        in_process_costs(models, handler_config, engine, costs, batch_size, num_requests, max_new_tokens)
        for row, cells in costs.items():
            for concurrency, cell in cells.items():
                # Lossless in float32: every row's greedy output is the target's, batched as it came or not.
                if batch_invariant and cell["same_tokens"] != cell["requests"]:
                    story.error(f"in-process against REST, {row}, C={concurrency}", f"{cell['same_tokens']} equal")
    if pair.exact:
        greedy_against_generate(models, handler_config, outputs, max_new_tokens, story)
    del models, engine
    release_memory(gpu_id)
    story.data["costs"] = costs
    story.data["errors"] = story.errors
    story.data["settings"] = {
        "dtype": pair.dtype,
        "config": pair.config.name,
        "overrides": overrides,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "requests_per_client": requests_per_client,
    }
    return story.data


def release_memory(gpu_id: int | None) -> None:
    """The in-process pair's GPU memory back, before the next pair's server loads."""
    import gc

    import torch

    gc.collect()
    if gpu_id is not None:
        torch.cuda.empty_cache()


def markdown(pair: Pair, data: dict) -> list[str]:
    """One pair's lines of serve.md: the checks, then the cost table."""
    settings = data["settings"]
    lines = [
        f"{pair.name} pair, {settings['dtype']}, {settings['config']} (overrides {settings['overrides'] or 'none'}), "
        f"batchSize {settings['batch_size']}, {settings['max_new_tokens']} new tokens a request; "
        f"TorchServe on {data.get('java', '?')}.",
        "",
        f"- errors: {len(data['errors'])}" + "".join(f"\n  - {error[:300]}" for error in data["errors"]),
        f"- /metrics: {data.get('metrics')}",
        f"- native REST, streamed answers equal to the not-streamed ones: {data.get('streamed_same_as_not')}",
        f"- OpenAI routes, tokens generated: {data.get('openai')}",
        f"- workers ready after scaling (static batching): {data.get('workers')}; "
        f"unregistered: {data.get('unregistered', False)}",
        f"- greedy answers of the static-batching archive equal to continuous batching's: "
        f"{data.get('static_same_as_continuous')}"
        + ("" if data.get("batch_invariant_checked", True) else " (reported: CUDA kernels round by batch shape)"),
    ]
    if "greedy_equal_to_generate" in data:
        greedy = data["greedy_equal_to_generate"]
        lines.append(f"- greedy over REST equal to HF `generate`: {greedy['equal']} of {greedy['requests']}")
    rows = []
    for row, cells in data["costs"].items():
        for concurrency, cell in sorted(cells.items()):
            rows.append(
                f"| {row} | {concurrency} | {cell.get('in_process_tokens_per_s', 0):.1f} | "
                f"{cell['rest_tokens_per_s']:.1f} | {cell.get('rest_over_in_process', 0):.2f} | "
                f"{cell.get('same_tokens', '-')} of {cell.get('requests', '-')} |"
            )
    if rows:
        lines += [
            "",
            "| row | C | in-process tok/s | REST tok/s | REST / in-process | same tokens |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    return lines


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` handler settings, each value read as YAML (`adaptive_k=false`, `cpu_threads=1`)."""
    overrides = {}
    for item in items:
        key, separator, value = item.partition("=")
        if not separator:
            raise argparse.ArgumentTypeError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    return overrides


def run(out_dir: pathlib.Path, pairs: list[str], args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Every pair in turn; (data by pair, markdown lines), written to OUT_DIR as each pair ends.

    The pairs' weights (gigabytes for the real shapes) and the servers' logs go to a scratch folder,
    removed at the end unless a pair reported an error: then its servers' logs stay there, named
    in the log.
    """
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="serve-pair-"))
    failed = True
    try:
        data, lines = _run_pairs(out_dir, pairs, args, scratch)
        failed = any(pair["errors"] for pair in data.values())
        return data, lines
    finally:
        if failed:
            logger.error("kept %s: the servers' logs are under */server/logs", scratch)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_pairs(
    out_dir: pathlib.Path, pairs: list[str], args: argparse.Namespace, scratch: pathlib.Path
) -> tuple[dict, list[str]]:
    data, lines = {}, ["# TorchServe serving the pairs", ""]
    for name in pairs:
        pair = tiny_pair(args.tiny, scratch) if name == TINY else shaped_pair(name, scratch, args.gpu_id)
        root = scratch / f"{name}-run"
        root.mkdir()
        data[name] = serve(
            pair,
            root,
            concurrencies=args.concurrency,
            max_new_tokens=args.max_new_tokens,
            requests_per_client=args.requests_per_client,
            overrides=args.overrides,
            gpu_id=args.gpu_id,
        )
        lines += [f"## {name}", "", *markdown(pair, data[name]), ""]
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "serve.json").write_text(json.dumps(data, indent=1))
        (out_dir / "serve.md").write_text("\n".join(lines))
    return data, lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path, help="folder for serve.json and serve.md")
    parser.add_argument("--pairs", default=TINY, help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--tiny", type=pathlib.Path, help="an existing tiny pair folder (default: built afresh)")
    parser.add_argument("--gpu-id", type=int, default=None, help="the in-process engine's GPU (default: the CPU)")
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop client counts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests per client at each C (4 at least)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="KEY=VALUE: a handler setting, for every pair"
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.pairs = [name.strip() for name in args.pairs.split(",") if name.strip()]
    unknown = sorted(set(args.pairs) - set(PAIRS))
    if unknown:
        parser.error(f"unknown pairs {unknown}; known: {', '.join(PAIRS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    try:
        args.overrides = parse_overrides(args.overrides)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    data, lines = run(args.out_dir, args.pairs, args)
    print("\n".join(lines), flush=True)
    return 0 if all(not pair["errors"] for pair in data.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
