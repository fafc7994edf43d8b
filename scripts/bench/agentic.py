#!/usr/bin/env python3
"""Benchmark an agentic trace: requests that repeat structure across requests, one at a time.

Agents and coding tools send requests that look like their earlier ones: the
same schema with another question, the same task with other names, a tool loop
that sends the conversation back with each tool result, an edit session that
sends the previous answer back with a change. This measures every drafter on
such a trace, against Hugging Face `generate` on the same models.

The trace is generated from --seed by templates with pools of names, so that no
one fixed text can be tuned for. --requests (default 14) are split across four
families in proportion 4:4:3:3, and the families are interleaved in a seeded
order, as an agent server sees them:

1. sql: one schema (five tables) in the system prompt, and questions drawn from
   templates with random thresholds, dates and countries;
2. coding: two or three task templates ("a function that reads the CSV file at
   ... and returns a dict mapping ... to the sum of ..."), each asked several
   times with other names;
3. tools: a loop with three tools (OpenAI `tools`): a user request, then the
   model's answer (its text, as the model wrote its call) and a tool result (a
   `tool` message) back, and again; the calls are not parsed, the results fit
   the user's request;
4. edit: a user asks for a small function, and each later turn sends the
   previous answer back as the assistant message and asks for a change
   (rename, a new parameter, a docstring, error handling).

With the demo pair (Qwen's tokenizer) prompts run from about 80 to 700 tokens.
--compact writes the schema as column names only and the tools as their
required parameters only, without descriptions, for a short context such as
the tiny test pair's 1,024 tokens; the same seed draws the same requests
either way.

Every request is made by the OpenAI chat route's own parsing (chat template,
tools, defaults; `scripts.bench.runner.ChatRoute`), greedy, up to
--max-new-tokens. Conversations include earlier answers, so the trace is built
once before timing: a reference pass runs every request in order with this
engine at k=0 (plain decoding) and its answers become the assistant messages
of later turns; that pass is also the warm-up. Every row then runs the same
prompt token ids in the same order.

Rows (--methods): `hf_target_only` (the baseline), `hf_prompt_lookup` (10
tokens), this engine with the `model`, `ngram`, `suffix` and `hybrid` drafters
(k and look-ups as the config sets them, planned from a cost table measured at
start for one row when the config has adaptive_k), `shipped`: the engine as the
config ships it but for its prefix cache, `model_prefix_cache` and
`shipped_prefix_cache`: the model drafter and the shipped config with the
config's prefix cache (the like-for-like pair), and `shipped_fixed_costs`: the
latter again with the cost table as measured at start, without the engine's
running correction (--draft-cost-skew F multiplies the table's draft step by F,
as a start-up at a busy moment would read it, to show what the correction
recovers). Every run of an engine row gets a fresh engine: the suffix drafter's
trees (and in the last three rows the prefix cache) learn from this trace
alone, in order. Every other row has no prefix cache and pays each prompt's
whole prefill, as `generate` does; the last three show what a server with the
prefix cache saves on a trace whose requests share their system prompts, tools
and histories.

--warm-requests N makes the server warm, as one that has served this workload
for a while: N earlier requests from the same generator (seed + 1000: other
names, values and order) are answered once before timing, and before each run
every fresh engine's suffix drafter is fed their prompts and answers, as
serving them would have. Nothing else is carried over: the prefix cache and
the calibrations start empty, and HF `generate` learns nothing across requests
anyway. The default, 0, times a server that starts with this trace.

Each request is timed from submission to its result; a run's tokens/s is its
completion tokens over its seconds; medians of --runs runs, the order of the
rows rotated each run. Greedy outputs are compared with HF target-only's (with
the reference pass's when that row is not run): in float32 they must be equal,
in bfloat16 a near-tie may flip a token. Outputs go to --out-dir: agentic.json
(every figure) and agentic.md (the table).

    python -m scripts.bench.agentic                    # the demo pair and its shipped config
    python -m scripts.bench.agentic --methods hf_target_only,hybrid,shipped --runs 1
    python -m scripts.bench.agentic --target models/tiny/target --draft models/tiny/draft \\
        --config model-config/model-config.yaml --dtype float32 --compact --requests 8 --max-new-tokens 6 --runs 1

With the defaults a run of the target-only row is 14 requests of up to 64
tokens: about 3-4 minutes at the demo pair's 4-5 tokens/s on a 2-core CPU, and
the whole benchmark (the reference pass, then 13 rows x 3 runs, most engine rows
about 1.5 minutes a run) about an hour.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import pathlib
import random
import statistics
import time

import yaml

from handler.config import handler_config_from_yaml_config
from handler.drafters import HYBRID, MODEL, NGRAM, SUFFIX
from handler.engine import (
    EngineOptions,
    GenerationRequest,
    SpeculativeEngine,
    SpeculativeStats,
    build_engine,
    engine_settings,
)
from handler.planning.cost_table import CostTable
from handler.runtime.loading import load_models
from scripts.bench import common as bench_common
from scripts.bench import runner as bench_runner
from scripts.bench.common import fmt, machine_info, start_up_cost_table
from scripts.bench.runner import ChatRoute

logger = logging.getLogger("bench_agentic")

BASELINE, SHIPPED = "hf_target_only", "shipped"
# The shipped config with its prefix cache as the config sets it: the only row that reuses the KV of
# earlier requests' prompts and answers (every other row pays each prompt's whole prefill).
SHIPPED_CACHED = "shipped_prefix_cache"
# The same, but planning from the cost table as measured at start, without the running correction
# (`handler.planning.cost_table.RunningCostTable`): what the correction brings, or costs.
SHIPPED_FIXED = "shipped_fixed_costs"
# The model drafter with the same prefix cache: what `shipped_prefix_cache` is compared with, like for like.
MODEL_CACHED = "model_prefix_cache"
SHIPPED_CACHED_ROWS = (SHIPPED_CACHED, SHIPPED_FIXED)
CACHED_ROWS = (MODEL_CACHED, *SHIPPED_CACHED_ROWS)
HF_ROWS = (BASELINE, "hf_prompt_lookup")
DRAFTER_ROWS = (MODEL, NGRAM, SUFFIX, HYBRID)
# The look-up drafters with speculative_tree off: chains only, beside their rows with trees.
CHAIN_SUFFIX = "_chain"
CHAIN_ROWS = tuple(f"{drafter}{CHAIN_SUFFIX}" for drafter in (NGRAM, SUFFIX, HYBRID))
ROWS = (*HF_ROWS, *DRAFTER_ROWS, *CHAIN_ROWS, SHIPPED, *CACHED_ROWS)
SHIPPED_ROWS = (SHIPPED, *SHIPPED_CACHED_ROWS)
# The rows `shipped` is compared with: the drafters a config could ship before the suffix drafter.
SHIPPED_ALTERNATIVES = (MODEL, NGRAM, HYBRID)
HF_PROMPT_LOOKUP_TOKENS = 10
# --warm-requests draws its earlier requests from the same generator with this added to --seed: other names,
# values and order, none of the timed trace's conversations.
WARM_SEED_OFFSET = 1000

# Requests per family in the default trace, scaled in proportion for other sizes.
FAMILY_WEIGHTS = {"sql": 4, "coding": 4, "tools": 3, "edit": 3}
FAMILIES = tuple(FAMILY_WEIGHTS)
DEFAULT_REQUESTS = sum(FAMILY_WEIGHTS.values())
MAX_LOOP_REQUESTS = 3  # a tool loop: the user's request, then two tool results
MAX_EDIT_TURNS = 4  # an edit session: the first ask, then three changes

# --------------------------------------------------------------------------- templates

SQL_HEADER = (
    "You are a SQL assistant for an online shop's PostgreSQL database. Answer with one query in a ```sql block, "
    "then one sentence on how it works. The schema:"
)
# Each table: its columns and their types, and its other constraints.
SCHEMA = (
    ("customers", (
        ("customer_id", "SERIAL PRIMARY KEY"),
        ("name", "TEXT NOT NULL"),
        ("email", "TEXT UNIQUE NOT NULL"),
        ("country", "TEXT NOT NULL"),
        ("signup_date", "DATE NOT NULL"),
    ), ()),
    ("products", (
        ("product_id", "SERIAL PRIMARY KEY"),
        ("name", "TEXT NOT NULL"),
        ("category", "TEXT NOT NULL"),
        ("unit_price", "NUMERIC(10, 2) NOT NULL"),
        ("stock", "INTEGER NOT NULL"),
    ), ()),
    ("orders", (
        ("order_id", "SERIAL PRIMARY KEY"),
        ("customer_id", "INTEGER NOT NULL REFERENCES customers (customer_id)"),
        ("order_date", "DATE NOT NULL"),
        ("status", "TEXT NOT NULL CHECK (status IN ('pending', 'shipped', 'delivered', 'cancelled'))"),
    ), ()),
    ("order_items", (
        ("order_id", "INTEGER NOT NULL REFERENCES orders (order_id)"),
        ("product_id", "INTEGER NOT NULL REFERENCES products (product_id)"),
        ("quantity", "INTEGER NOT NULL"),
        ("unit_price", "NUMERIC(10, 2) NOT NULL"),
    ), ("PRIMARY KEY (order_id, product_id)",)),
    ("reviews", (
        ("review_id", "SERIAL PRIMARY KEY"),
        ("product_id", "INTEGER NOT NULL REFERENCES products (product_id)"),
        ("customer_id", "INTEGER NOT NULL REFERENCES customers (customer_id)"),
        ("rating", "INTEGER NOT NULL CHECK (rating BETWEEN 1 AND 5)"),
        ("created_at", "TIMESTAMP NOT NULL"),
    ), ()),
)  # fmt: skip
SQL_QUESTIONS = (
    "Write a SQL query that returns the {n} customers who spent the most on orders with status '{status}' since "
    "{date}, with their name, email and total spent.",
    "Write a SQL query that returns, for each product category, the units sold and the revenue between {date} and "
    "{date2}, largest revenue first.",
    "Write a SQL query that returns the customers from {country} who signed up before {date} and have placed no "
    "order since then.",
    "Write a SQL query that returns the products in the category '{category}' with fewer than {stock} units in stock "
    "and an average rating of at least {rating}.",
    "Write a SQL query that returns the number of orders and the average order value per month of {year}, for "
    "customers from {country} only.",
    "Write a SQL query that returns the orders with more than {items} distinct products and a total above {amount}, "
    "with the customer's name and the order date.",
)
STATUSES = ("pending", "shipped", "delivered", "cancelled")
COUNTRIES = ("France", "Germany", "Japan", "Brazil", "Canada", "Kenya", "Spain", "India")
CATEGORIES = ("books", "garden", "kitchen", "toys", "electronics", "sports")

CODING_SYSTEM = (
    "You are a coding assistant inside an editor. Answer with one complete Python function in a ```python block, "
    "with type hints, and no explanation before the code. When asked to change code, answer with the complete new "
    "function."
)
# Each task: its text, and a pool of values for each of its fields.
CODING_TASKS = (
    (
        "Write a Python function `{fn}` that reads the CSV file at `{path}` and returns a dict mapping `{key}` to the "
        "sum of `{value}`.",
        {
            "fn": ("totals_by_region", "sum_sales_per_store", "revenue_by_customer", "hours_by_employee"),
            "path": ("data/sales.csv", "exports/orders_2024.csv", "reports/timesheets.csv", "finance/expenses.csv"),
            "key": ("region", "store_id", "customer", "employee", "department"),
            "value": ("amount", "revenue", "hours", "cost", "quantity"),
        },
    ),
    (
        "Write a Python function `{fn}` that loads the JSON Lines file at `{path}` and returns the records whose "
        "`{field}` is at least {threshold}, sorted by `{sort_key}`, newest first.",
        {
            "fn": ("large_orders", "top_scores", "slow_requests", "big_payments"),
            "path": ("logs/requests.jsonl", "data/users.jsonl", "exports/payments.jsonl", "data/games.jsonl"),
            "field": ("total", "score", "duration_ms", "amount"),
            "threshold": ("10", "250", "1000", "5000"),
            "sort_key": ("created_at", "timestamp", "updated_at"),
        },
    ),
    (
        "Write a Python function `{fn}` that reads the log file at `{path}`, where each line starts with an ISO "
        "timestamp and a level, and returns a dict mapping each hour ('YYYY-MM-DD HH') to the number of `{level}` "
        "lines.",
        {
            "fn": ("errors_per_hour", "hourly_warnings", "count_by_hour", "level_histogram"),
            "path": ("/var/log/app.log", "logs/worker.log", "logs/api-gateway.log", "/tmp/batch.log"),
            "level": ("ERROR", "WARNING", "CRITICAL", "INFO"),
        },
    ),
    (
        "Write a Python function `{fn}` that walks the directory `{path}` and returns the {n} largest files ending in "
        "`{ext}`, as (path, size in bytes) pairs, largest first.",
        {
            "fn": ("largest_files", "biggest_assets", "find_heavy_files", "top_files_by_size"),
            "path": ("assets/", "build/output/", "/srv/uploads/", "data/raw/"),
            "n": ("3", "5", "10", "20"),
            "ext": (".png", ".parquet", ".log", ".mp4"),
        },
    ),
)

TOOLS_SYSTEM = (
    "You are the support assistant of an online shop. Call the tools whenever you need a fact, one call at a time, "
    "and answer the customer briefly once you have what you need."
)
# Each tool: its name, description, parameters (JSON Schema) and required parameters.
TOOL_SPECS = (
    (
        "get_weather",
        "The current weather in a city",
        {
            "city": {"type": "string", "description": "The city's name, e.g. Lyon"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        ["city"],
    ),
    (
        "lookup_order",
        "An order's status, carrier and estimated delivery date",
        {"order_id": {"type": "string", "description": "The order number, e.g. A-10442"}},
        ["order_id"],
    ),
    (
        "search_docs",
        "Search the shop's help center; returns titles, links and snippets",
        {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        ["query"],
    ),
)
# Each loop: the user's request, and the tool results that come back after the model's answers.
TOOL_LOOPS = (
    ("What is the weather in {city} and in {city2} right now? I am choosing where to spend the weekend.",
     ("weather:{city}", "weather:{city2}")),
    ("Where is my order {order}? It is going to {city}; will the weather there delay it?",
     ("order:{order}:{city}", "weather:{city}")),
    ("How do I {task}? Look it up in the help center, then check my order {order}.",
     ("docs:{task}", "order:{order}:{city}")),
)  # fmt: skip
CITIES = ("Lyon", "Osaka", "Nairobi", "Porto", "Denver", "Krakow", "Hobart", "Quito")
DOC_TASKS = ("return a damaged item", "change my delivery address", "use a gift card", "cancel a subscription")
CONDITIONS = ("clear sky", "light rain", "overcast", "snow showers", "thunderstorms", "fog")
CARRIERS = ("DHL", "UPS", "La Poste", "FedEx")

EDIT_TASKS = (
    ("checks whether a string is a palindrome, ignoring case, spaces and punctuation",
     ("is_palindrome", "check_palindrome", "reads_the_same_backwards")),
    ("merges two sorted lists of integers into one sorted list without calling sort",
     ("merge_sorted", "merge_two_lists", "combine_sorted")),
    ("returns the {n} most common words of a text, lowercased, as (word, count) pairs",
     ("top_words", "most_common_words", "frequent_words")),
    ("splits a list into chunks of at most {n} items",
     ("chunk_list", "split_into_chunks", "batched")),
    ("parses a duration such as '1h30m' or '45s' and returns the number of seconds",
     ("parse_duration", "duration_to_seconds", "seconds_from_text")),
)  # fmt: skip
EDIT_CHANGES = (
    "Rename the function to `{rename}` and give its parameters more descriptive names.",
    "Add a keyword-only parameter `strict: bool = False`; when it is true, raise a ValueError on invalid input "
    "instead of ignoring it.",
    "Add a Google-style docstring with Args, Returns and one example.",
    "Handle errors: raise a TypeError with a clear message when an argument has the wrong type.",
    "Log the arguments at debug level with a module-level logger.",
)


@dataclasses.dataclass(frozen=True)
class TraceItem:
    """One request of the trace, before the reference pass fills in the answers.

    A conversation's first turn (turn 0) carries its opening messages; a later turn
    carries the messages that follow the model's previous answer (a tool result, or
    the user's next request), which goes back as an assistant message before them.
    """

    family: str
    conversation: str
    turn: int
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()


def family_sizes(num_requests: int) -> dict[str, int]:
    """Requests per family: in proportion to FAMILY_WEIGHTS (largest remainders), at least one each."""
    assert num_requests >= len(FAMILIES), num_requests
    total = sum(FAMILY_WEIGHTS.values())
    exact = {family: num_requests * weight / total for family, weight in FAMILY_WEIGHTS.items()}
    sizes = {family: max(1, int(share)) for family, share in exact.items()}
    by_remainder = sorted(FAMILIES, key=lambda family: exact[family] - int(exact[family]), reverse=True)
    for family in by_remainder[: num_requests - sum(sizes.values())]:
        sizes[family] += 1
    while sum(sizes.values()) > num_requests:  # the floor of one took a request from a larger family
        sizes[max(FAMILIES, key=sizes.__getitem__)] -= 1
    return sizes


def split_evenly(num_items: int, max_size: int) -> list[int]:
    """Sizes of the fewest groups of at most max_size that hold num_items, as even as possible."""
    num_groups = -(-num_items // max_size)
    return [num_items // num_groups + (i < num_items % num_groups) for i in range(num_groups)]


def _date(rng: random.Random, first_year: int = 2022, last_year: int = 2024) -> str:
    return f"{rng.randint(first_year, last_year)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def sql_system(compact: bool) -> str:
    """The schema as CREATE TABLE statements, or compact: each table's column names on one line."""
    if compact:
        tables = [f"{table}({', '.join(name for name, _ in columns)})" for table, columns, _ in SCHEMA]
    else:
        tables = []
        for table, columns, extra in SCHEMA:
            lines = [f"    {name} {column_type}" for name, column_type in columns] + [f"    {line}" for line in extra]
            tables.append(f"CREATE TABLE {table} (\n" + ",\n".join(lines) + "\n);")
    return SQL_HEADER + "\n\n" + "\n".join(tables)


def tools(compact: bool) -> tuple[dict, ...]:
    """The tools in OpenAI's format; compact: no descriptions, only the required parameters and their types."""
    specs = []
    for name, description, properties, required in TOOL_SPECS:
        if compact:
            properties = {key: {"type": properties[key]["type"]} for key in required}
        function = {"name": name, "parameters": {"type": "object", "properties": properties, "required": required}}
        if not compact:
            function = {"name": name, "description": description, **function}
        specs.append({"type": "function", "function": function})
    return tuple(specs)


def sql_items(rng: random.Random, num: int, compact: bool) -> list[TraceItem]:
    system = sql_system(compact)
    questions = rng.sample(SQL_QUESTIONS, len(SQL_QUESTIONS))
    items = []
    for i in range(num):
        first, second = sorted([_date(rng), _date(rng)])
        question = questions[i % len(questions)].format(
            n=rng.randint(3, 20),
            status=rng.choice(STATUSES),
            date=first,
            date2=second,
            country=rng.choice(COUNTRIES),
            category=rng.choice(CATEGORIES),
            stock=rng.randint(5, 50),
            rating=rng.choice((3, 3.5, 4, 4.5)),
            year=rng.randint(2020, 2024),
            items=rng.randint(2, 6),
            amount=rng.randrange(100, 2000, 50),
        )
        items.append(TraceItem("sql", f"sql-{i}", 0, (_system(system), _user(question))))
    return items


def coding_items(rng: random.Random, num: int, compact: bool) -> list[TraceItem]:
    """Two or three tasks (one when num < 4), asked in turn, each time with other names."""
    tasks = rng.sample(CODING_TASKS, min(3, max(1, num // 2)))
    # Each task's pools shuffled once: the j-th ask of a task takes the j-th names, unlike its earlier asks.
    names = [{field: rng.sample(pool, len(pool)) for field, pool in pools.items()} for _, pools in tasks]
    items = []
    for i in range(num):
        task, ask = i % len(tasks), i // len(tasks)
        question = tasks[task][0].format(**{field: pool[ask % len(pool)] for field, pool in names[task].items()})
        items.append(TraceItem("coding", f"coding-{i}", 0, (_system(CODING_SYSTEM), _user(question))))
    return items


def tool_result(rng: random.Random, spec: str) -> str:
    """A tool's JSON result, e.g. for "weather:Lyon"; the model's call is not parsed, the result fits the request."""
    kind, *values = spec.split(":")
    if kind == "weather":
        result = {
            "city": values[0],
            "temperature_c": rng.randint(-5, 32),
            "conditions": rng.choice(CONDITIONS),
            "wind_kph": rng.randint(0, 60),
        }
    elif kind == "order":
        result = {
            "order_id": values[0],
            "status": rng.choice(STATUSES[:3]),
            "carrier": rng.choice(CARRIERS),
            "destination": values[1],
            "estimated_delivery": _date(rng, 2025, 2025),
        }
    else:
        url = f"https://help.example.com/{values[0].replace(' ', '-')}"
        result = {"results": [{"title": f"How to {values[0]}", "url": url}]}
    return json.dumps(result)


def tool_items(rng: random.Random, num: int, compact: bool) -> list[TraceItem]:
    specs, items = tools(compact), []
    for loop, size in enumerate(split_evenly(num, MAX_LOOP_REQUESTS)):
        request, results = rng.choice(TOOL_LOOPS)
        city, city2 = rng.sample(CITIES, 2)
        names = {"city": city, "city2": city2, "order": f"A-{rng.randint(10000, 99999)}", "task": rng.choice(DOC_TASKS)}
        conversation = f"tools-{loop}"
        opening = (_system(TOOLS_SYSTEM), _user(request.format(**names)))
        items.append(TraceItem("tools", conversation, 0, opening, specs))
        assert size <= len(results) + 1, (size, results)
        for turn in range(1, size):
            content = tool_result(rng, results[turn - 1].format(**names))
            message = {"role": "tool", "tool_call_id": f"call_{turn}", "content": content}
            items.append(TraceItem("tools", conversation, turn, (message,), specs))
    return items


def edit_items(rng: random.Random, num: int, compact: bool) -> list[TraceItem]:
    items = []
    for session, size in enumerate(split_evenly(num, MAX_EDIT_TURNS)):
        task, names = rng.choice(EDIT_TASKS)
        name, rename = rng.sample(names, 2)
        ask = f"Write a Python function `{name}` that {task.format(n=rng.randint(3, 12))}."
        conversation = f"edit-{session}"
        items.append(TraceItem("edit", conversation, 0, (_system(CODING_SYSTEM), _user(ask))))
        for turn, change in enumerate(rng.sample(EDIT_CHANGES, size - 1), start=1):
            request = f"Rewrite the previous function. {change.format(rename=rename)} Show the complete function."
            items.append(TraceItem("edit", conversation, turn, (_user(request),)))
    return items


def _system(content: str) -> dict:
    return {"role": "system", "content": content}


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


FAMILY_ITEMS = {"sql": sql_items, "coding": coding_items, "tools": tool_items, "edit": edit_items}


def make_plan(seed: int, num_requests: int, compact: bool = False) -> list[TraceItem]:
    """The trace's requests in order: each family's, interleaved in a seeded order that keeps turns in order.

    Args:
        seed: picks the templates, the names and values in them, and the order.
        num_requests: split across the families by `family_sizes`.
        compact: the schema and the tools in short form (`sql_system`, `tools`); the same
            seed draws the same requests either way.
    """
    rng = random.Random(seed)
    sizes = family_sizes(num_requests)
    queues = {family: FAMILY_ITEMS[family](rng, size, compact) for family, size in sizes.items()}
    plan = []
    while any(queues.values()):
        # The next family with a chance proportional to its remaining requests: mixed all along the trace.
        families = [family for family in FAMILIES if queues[family]]
        family = rng.choices(families, weights=[len(queues[f]) for f in families])[0]
        plan.append(queues[family].pop(0))
    return plan


# --------------------------------------------------------------------------- the trace


@dataclasses.dataclass
class Trace:
    """The plan made concrete: each request as the chat route parsed it, and the reference answer."""

    items: list[TraceItem]
    requests: list[GenerationRequest]
    reference: list[list[int]]  # engine, k=0: plain greedy decoding
    answers: list[str]  # the reference's text: a later turn's assistant message
    reference_seconds: float

    def describe(self) -> dict:
        prompt_tokens = [len(request.prompt_ids) for request in self.requests]
        return {
            "num_requests": len(self.items),
            "families": {family: sum(item.family == family for item in self.items) for family in FAMILIES},
            "prompt_tokens_total": sum(prompt_tokens),
            "reference_completion_tokens": sum(len(tokens) for tokens in self.reference),
            "reference_seconds": self.reference_seconds,
            "requests": [
                {
                    "family": item.family,
                    "conversation": item.conversation,
                    "turn": item.turn,
                    "tools": [tool["function"]["name"] for tool in item.tools],
                    "new_messages": list(item.messages),
                    "prompt_tokens": num_tokens,
                    "reference_completion_tokens": len(tokens),
                    "reference_answer": answer,
                }
                for item, num_tokens, tokens, answer in zip(self.items, prompt_tokens, self.reference, self.answers)
            ],
        }


def build_trace(
    plan: list[TraceItem], route: ChatRoute, engine: SpeculativeEngine, max_new_tokens: int, plain: bool = True
) -> Trace:
    """Runs the plan in order, at k=0 when `plain` (else as the engine drafts by default); each answer's text
    goes back as the assistant message of the next turn."""
    history: dict[str, list[dict]] = {}
    answers: dict[str, str] = {}
    requests, reference, texts = [], [], []
    started = time.perf_counter()
    for item in plan:
        if item.turn == 0:
            messages = list(item.messages)
        else:
            answer = {"role": "assistant", "content": answers[item.conversation]}
            messages = [*history[item.conversation], answer, *item.messages]
        try:
            request = route.request(messages, list(item.tools), max_new_tokens)
        except ValueError as error:  # the route's own message, e.g. a prompt longer than the context
            raise ValueError(
                f"{item.conversation}, turn {item.turn}: {error} (--compact shortens the prompts)"
            ) from None
        # HF generate runs the same prompt: nothing may constrain the engine's output beyond it.
        assert request.constraint is None and not request.stop, request
        [result] = engine.generate([dataclasses.replace(request, num_speculative_tokens=0) if plain else request])
        history[item.conversation], answers[item.conversation] = messages, result.text
        requests.append(request)
        reference.append(result.token_ids)
        texts.append(result.text)
        logger.info(
            "trace %d/%d %s: %d prompt tokens", len(requests), len(plan), item.conversation, result.prompt_tokens
        )
    return Trace(plan, requests, reference, texts, time.perf_counter() - started)


def warm_suffix_trees(engine: SpeculativeEngine, warm: Trace) -> None:
    """Feeds the warm-up's prompts and answers to the engine's suffix drafter as serving them would have: each
    answer stays in the tree it shares across requests (unless the config keeps requests to themselves)."""
    drafter = engine.suffix_drafter
    for index, (request, answer) in enumerate(zip(warm.requests, warm.reference)):
        key = ("warm-up", index)
        drafter.add({key: request.prompt_ids})
        drafter.observe({key: answer})
        drafter.remove([key])


# --------------------------------------------------------------------------- rows


def row_methods(keys: list[str], config) -> list[bench_runner.Method]:
    """The selected rows, in ROWS order; engine rows take k, look-ups and planning from the config."""
    k, planned, lookup = config.num_speculative_tokens, config.adaptive_k, config.prompt_lookup_num_tokens
    methods = []
    for key in (key for key in ROWS if key in keys):
        if key == BASELINE:
            method = bench_runner.hf_target_only()
        elif key in HF_ROWS:
            method = dataclasses.replace(bench_runner.hf_prompt_lookup(HF_PROMPT_LOOKUP_TOKENS), key=key)
        else:
            if key in SHIPPED_ROWS:
                drafter = config.drafter
            else:
                drafter = MODEL if key == MODEL_CACHED else key.removesuffix(CHAIN_SUFFIX)
            # bench labels look-ups for the n-gram drafter; the suffix drafter's are drafted alike.
            method = bench_runner.engine_method(key, NGRAM if drafter == SUFFIX else drafter, k, planned, lookup)
            label = method.label.replace(f"{NGRAM} drafter", f"{drafter} drafter")
            if key in SHIPPED_ROWS:
                label = label.replace("this engine,", "this engine as shipped,")
            if key in CHAIN_ROWS:
                label += ", chains only (speculative_tree off)"
            elif drafter != MODEL and config.speculative_tree == "auto":
                label += ", trees"
            if key in CACHED_ROWS:
                label += ", prefix cache " + ("on" if config.prefix_cache else "off (as the config sets it)")
            if key == SHIPPED_FIXED:
                label += ", costs as measured at start (no running correction)"
            method = dataclasses.replace(method, drafter=drafter, label=label)
        methods.append(method)
    return methods


def skew_draft(table: CostTable, factor: float) -> CostTable:
    """The table with its draft step `factor` times as long: a start-up measured at a busy moment."""
    if table.draft is None:
        return table
    return dataclasses.replace(table, draft=tuple(seconds * factor for seconds in table.draft))


def run_engine(engine: SpeculativeEngine, method: bench_runner.Method, requests: list[GenerationRequest]) -> dict:
    """The trace through one fresh engine, one request at a time; the shipped rows keep each request's own
    drafter."""

    def generate(request: GenerationRequest) -> tuple[list[int], SpeculativeStats]:
        if method.key not in SHIPPED_ROWS:
            request = dataclasses.replace(request, drafter=method.drafter)
        if method.key in CHAIN_ROWS:
            request = dataclasses.replace(request, speculative_tree=False)
        [result] = engine.generate([request])
        return result.token_ids, result.stats

    run = bench_runner.timed_run(generate, requests)
    totals = run.totals.as_dict()
    by_drafter, trees = totals["by_drafter"], totals["tree"]
    stats = engine.prefix_cache_stats
    prefix = None if stats is None else {"prompt_tokens": stats.queries, "cached_tokens": stats.hits}
    return {
        "run": run,
        "by_drafter": by_drafter,
        "trees": trees,
        "prefix_cache": prefix,
        # The running correction at the end of the trace: (target, draft) observed / measured.
        "cost_scales": engine.cost_scales,
    }


def measure(
    methods: list[bench_runner.Method], trace: Trace, runner: bench_runner.Runner, new_engine, args
) -> dict[str, list]:
    """Every row over the whole trace, --runs times; run i starts at row i mod the number of rows."""
    runs: dict[str, list[dict]] = {method.key: [] for method in methods}
    prompts_ids = [request.prompt_ids for request in trace.requests]
    for index in range(args.runs):
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if method.is_engine:
                engine = new_engine(method.key in CACHED_ROWS, running_costs=method.key != SHIPPED_FIXED)
                record = run_engine(engine, method, trace.requests)
            else:
                record = {"run": runner.run(method, prompts_ids, args.max_new_tokens), "by_drafter": None}
            runs[method.key].append(record)
            logger.info(
                "run %d/%d %-16s %6.2f tokens/s", index + 1, args.runs, method.key, record["run"].tokens_per_second
            )
    return runs


def summarize(methods: list[bench_runner.Method], runs: dict[str, list[dict]], reference: list[list[int]]) -> dict:
    """Per row: medians over the runs, the ratio to target-only, acceptance, and outputs against the baseline."""
    medians = {key: statistics.median(r["run"].tokens_per_second for r in records) for key, records in runs.items()}
    baseline = runs[BASELINE][0]["run"].outputs if BASELINE in runs else reference
    rows = {}
    for method in methods:
        records = runs[method.key]
        first = records[0]["run"]
        differences = [
            {"request": i, "first_differing_token": d}
            for i, (a, b) in enumerate(zip(baseline, first.outputs))
            if (d := bench_common.first_difference(a, b)) is not None
        ]
        rows[method.key] = {
            "label": method.label,
            "drafter": method.drafter,
            "tokens_per_second": medians[method.key],
            "vs_target_only": medians[method.key] / medians[BASELINE] if BASELINE in medians else None,
            **bench_runner.acceptance(first),
            "same_output": len(baseline) - len(differences),
            "differences": differences,
            "same_as_reference": sum(a == b for a, b in zip(reference, first.outputs)),
            # Greedy decoding is deterministic: every run must give the first run's outputs.
            "same_outputs_every_run": all(r["run"].outputs == first.outputs for r in records),
            "runs": [
                {
                    "num_tokens": r["run"].num_tokens,
                    "seconds": r["run"].seconds,
                    "tokens_per_second": r["run"].tokens_per_second,
                    "draft_tokens": r["run"].draft_tokens,
                    "accepted_tokens": r["run"].accepted_tokens,
                    "target_passes": r["run"].target_passes,
                    "by_drafter": r["by_drafter"],
                    "trees": r.get("trees"),
                    "prefix_cache": r.get("prefix_cache"),
                    "cost_scales": r.get("cost_scales"),
                }
                for r in records
            ],
        }
    return rows


def shipped_against_best(rows: dict) -> dict | None:
    """`shipped` over the fastest of the model, n-gram and hybrid rows that ran."""
    present = [key for key in SHIPPED_ALTERNATIVES if key in rows]
    if SHIPPED not in rows or not present:
        return None
    best = max(present, key=lambda key: rows[key]["tokens_per_second"])
    return {"best": best, "ratio": rows[SHIPPED]["tokens_per_second"] / rows[best]["tokens_per_second"]}


# --------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    s, trace, rows = report["settings"], report["trace"], report["rows"]
    prompt_tokens = [request["prompt_tokens"] for request in trace["requests"]]
    families = ", ".join(f"{family} {num}" for family, num in trace["families"].items())
    planned = "planned from a cost table measured at start" if s["adaptive_k"] else "fixed"
    baseline = "target-only" if BASELINE in rows else "the reference pass (engine, k=0)"
    lines = [
        f"Date: {report['date']}. Machine: {report['machine']['description']}.",
        f"Models: target {s['target']}, draft {s['draft']}, {s['dtype']}; config {s['config']} (ships the "
        f"{s['drafter']} drafter; k {s['k']}, {planned}; look-ups up to {s['prompt_lookup_num_tokens'] or s['k']}).",
        f"Trace (seed {s['seed']}{', compact' if s['compact'] else ''}): {trace['num_requests']} requests "
        f"({families}), prompts of "
        f"{min(prompt_tokens)}-{max(prompt_tokens)} tokens (median {statistics.median(prompt_tokens):g}), up to "
        f"{s['max_new_tokens']} new tokens, greedy, one request at a time. Each request is timed from submission to "
        f"its result (prefill included); tokens/s = completion tokens / seconds over the trace, median of "
        f"{s['runs']} run(s), row order rotated each run; a fresh engine per run, prefix cache off "
        f"(but in the {', '.join(CACHED_ROWS)} rows, which have the config's).",
    ]
    warm = report.get("warm_up")
    if warm is not None:
        lines.append(
            f"Warm server: before each engine run, its suffix drafter was fed the prompts and answers of "
            f"{warm['num_requests']} earlier requests from the same generator (seed {s['warm_seed']}; "
            f"{warm['reference_completion_tokens']} answer tokens), as serving them would have. The prefix cache, "
            "the calibrations and the running cost correction start empty; the HF rows learn nothing across "
            "requests."
        )
    lines += [
        "",
        "| row | tokens/s (median) | x target-only | tokens per target pass | acceptance "
        f"| same output as {baseline} |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        # HF rows count no target passes: their cells stay blank.
        passes = fmt(row["tokens_per_pass"]) if row["drafter"] else ""
        acceptance = fmt(row["acceptance_rate"]) if row["drafter"] else ""
        ratio = fmt(row["vs_target_only"], "{:.2f}x")
        lines.append(
            f"| {key}: {row['label']} | {row['tokens_per_second']:.2f} | {ratio} | {passes} | {acceptance} "
            f"| {row['same_output']}/{trace['num_requests']} |"
        )
    versus = report["shipped_vs_best"]
    if versus is not None:
        alternatives = ", ".join(key for key in SHIPPED_ALTERNATIVES if key in rows)
        lines += ["", f"shipped / best of {alternatives} ({versus['best']}): {versus['ratio']:.2f}x."]
    if s.get("draft_cost_skew", 1.0) != 1.0:
        lines += [
            "",
            f"The start-up cost table's draft step was multiplied by {s['draft_cost_skew']:g} (--draft-cost-skew).",
        ]
    if SHIPPED_FIXED in rows and SHIPPED_CACHED in rows:
        ratio = rows[SHIPPED_CACHED]["tokens_per_second"] / rows[SHIPPED_FIXED]["tokens_per_second"]
        scales = [r["cost_scales"] for r in rows[SHIPPED_CACHED]["runs"] if r["cost_scales"] is not None]
        shown = ", ".join(f"target x{target:.2f} draft x{draft:.2f}" for target, draft in scales) or "none (no table)"
        lines += [
            "",
            f"{SHIPPED_CACHED} / {SHIPPED_FIXED} (the running cost correction): {ratio:.2f}x; "
            f"its correction at the end of each run: {shown}.",
        ]
    if MODEL_CACHED in rows and SHIPPED_CACHED in rows:
        ratio = rows[SHIPPED_CACHED]["tokens_per_second"] / rows[MODEL_CACHED]["tokens_per_second"]
        lines += ["", f"{SHIPPED_CACHED} / {MODEL_CACHED} (the same prefix cache): {ratio:.2f}x."]
    if SHIPPED_CACHED in rows:
        prefix = rows[SHIPPED_CACHED]["runs"][0]["prefix_cache"]
        if prefix is not None and prefix["prompt_tokens"]:
            lines += [
                "",
                f"{SHIPPED_CACHED}: {prefix['cached_tokens']} of {prefix['prompt_tokens']} prompt tokens "
                f"({prefix['cached_tokens'] / prefix['prompt_tokens']:.0%}) came from the prefix cache.",
            ]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(bench_common.DEFAULT_TARGET))
    parser.add_argument("--draft", default=str(bench_common.DEFAULT_DRAFT))
    parser.add_argument(
        "--config", default=str(bench_common.DEFAULT_CONFIG), help="model-config.yaml (default: the demo's)"
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="overrides the config")
    parser.add_argument("--draft-quantization", choices=["none", "int8", "auto"], help="overrides the config")
    parser.add_argument("--seed", type=int, default=7, help="the trace's templates, names and order")
    parser.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        help=f"requests in the trace, split across {', '.join(FAMILIES)} in proportion "
        f"{':'.join(map(str, FAMILY_WEIGHTS.values()))} (at least one each). The default takes about 3 minutes "
        "per run of the target-only row with the demo pair on a 2-core CPU",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--warm-requests",
        type=int,
        default=0,
        help="a warm server: feed every engine's suffix trees, before each run, the answers of this many earlier "
        f"requests from the same generator (seed + {WARM_SEED_OFFSET}), answered once before timing (default 0: "
        "every engine starts empty)",
    )
    parser.add_argument(
        "--compact",
        action="store_true",
        help="the schema as column names only, the tools as their required parameters without descriptions: for a "
        "short context such as the tiny test pair's 1,024 tokens",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of the whole trace per row; medians are reported")
    parser.add_argument("--methods", default=",".join(ROWS), help=f"rows, comma-separated: {', '.join(ROWS)}")
    parser.add_argument(
        "--suffix-estimate",
        choices=["tree", "tracker"],
        help="how the planner estimates a suffix look-up's acceptance (default: the engine's)",
    )
    parser.add_argument(
        "--draft-cost-skew",
        type=float,
        default=1.0,
        help="multiply the start-up cost table's draft step by this, as a table measured while something else ran "
        "would read it: shows what the running correction recovers (default 1: as measured)",
    )
    parser.add_argument("--out-dir", default="bench_results")
    args = parser.parse_args(argv)
    args.methods = [key.strip() for key in args.methods.split(",") if key.strip()]
    unknown = sorted(set(args.methods) - set(ROWS))
    if unknown or not args.methods:
        parser.error(f"--methods: unknown row {', '.join(unknown) or '(none given)'}; choose from {', '.join(ROWS)}")
    if args.requests < len(FAMILIES):
        parser.error(f"--requests must be at least {len(FAMILIES)}: one request per family")
    if args.draft_cost_skew <= 0:
        parser.error("--draft-cost-skew must be positive")
    if args.warm_requests and args.warm_requests < len(FAMILIES):
        parser.error(f"--warm-requests must be 0 or at least {len(FAMILIES)}: one request per family")
    if min(args.runs, args.max_new_tokens) < 1:
        parser.error("--runs and --max-new-tokens must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with open(args.config, encoding="utf-8") as f:
        shipped = handler_config_from_yaml_config(yaml.safe_load(f))
    # bench_config loads the draft model whatever the config's drafter: the model and hybrid rows need it.
    config = dataclasses.replace(bench_runner.bench_config(args), drafter=shipped.drafter)
    models = load_models(config, None)
    machine = machine_info()
    logger.info("machine: %s", machine["description"])
    cost_table = None
    if config.adaptive_k:  # as the handler measures it at start-up; this bench runs one request at a time
        cost_table = start_up_cost_table(models, config, 1)
        if args.draft_cost_skew != 1.0:
            cost_table = skew_draft(cost_table, args.draft_cost_skew)
            print(f"Draft step multiplied by {args.draft_cost_skew:g} (--draft-cost-skew)", flush=True)
    estimate = {} if args.suffix_estimate is None else {"suffix_estimate": args.suffix_estimate}
    settings = engine_settings(models, config)

    def new_engine(prefix_cache: bool = False, running_costs: bool = True) -> SpeculativeEngine:
        """A fresh engine; with `prefix_cache`, the config's own prefix cache (its budget), else none;
        `running_costs`: the engine's running correction of the cost table (its default) or none."""
        cache = {} if prefix_cache else {"prefix_cache_max_bytes": None}
        options = EngineOptions(running_costs=running_costs, **estimate)
        return build_engine(models, settings, cost_table=cost_table, options=options, **cache)

    methods = row_methods(args.methods, config)
    reference_engine = new_engine()
    missing = [m.key for m in methods if m.is_engine and m.drafter not in reference_engine.drafters]
    if missing:
        raise SystemExit(f"--methods: this engine has no {', '.join(missing)} drafter")
    route = ChatRoute(config, models)
    warm, warm_seed = None, args.seed + WARM_SEED_OFFSET if args.warm_requests else None
    if warm_seed is not None:
        warm_plan = make_plan(warm_seed, args.warm_requests, args.compact)
        warm = build_trace(warm_plan, route, reference_engine, args.max_new_tokens, plain=False)
    trace = build_trace(make_plan(args.seed, args.requests, args.compact), route, reference_engine, args.max_new_tokens)

    def warmed_engine(prefix_cache: bool = False, running_costs: bool = True) -> SpeculativeEngine:
        engine = new_engine(prefix_cache, running_costs)
        if warm is not None:
            warm_suffix_trees(engine, warm)
        return engine

    runs = measure(methods, trace, bench_runner.Runner(models, config, cost_table), warmed_engine, args)
    rows = summarize(methods, runs, trace.reference)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "settings": {
            "target": bench_common.shown(args.target),
            "draft": bench_common.shown(args.draft),
            "config": bench_common.shown(args.config),
            "dtype": str(models.dtype).replace("torch.", ""),
            "draft_quantization": models.draft_quantization,
            "seed": args.seed,
            "requests": args.requests,
            "warm_requests": args.warm_requests,
            "warm_seed": warm_seed,
            "max_new_tokens": args.max_new_tokens,
            "compact": args.compact,
            "runs": args.runs,
            "methods": [method.key for method in methods],
            "drafter": config.drafter,
            "k": config.num_speculative_tokens,
            "adaptive_k": config.adaptive_k,
            "prompt_lookup_num_tokens": config.prompt_lookup_num_tokens,
            "suffix_estimate": args.suffix_estimate,
            "draft_cost_skew": args.draft_cost_skew,
            "speculative_tree": config.speculative_tree,
            "trees_verified": reference_engine.trees,
        },
        "cost_table": None if cost_table is None else bench_common.describe_cost_table(cost_table),
        "trace": trace.describe(),
        "warm_up": None if warm is None else {k: v for k, v in warm.describe().items() if k != "requests"},
        "rows": rows,
        "shipped_vs_best": shipped_against_best(rows),
    }
    bench_common.write_report(pathlib.Path(args.out_dir), "agentic", report, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
