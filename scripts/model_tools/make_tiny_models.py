#!/usr/bin/env python3
"""Build a tiny random target/draft model pair for tests and demos, offline.

Writes two Hugging Face ``save_pretrained`` folders that share one tokenizer:

    OUT/target/   Qwen2ForCausalLM, hidden 64, 2 layers, vocab 384
    OUT/draft/    same architecture, vocab 360, weights = target + noise

The tokenizer is a byte-level BPE (so any UTF-8 text encodes) trained on a
small embedded corpus, with about 350 entries and the special tokens
``<|endoftext|>`` (EOS and padding), ``<|im_start|>`` and ``<|im_end|>``, plus
a ChatML chat template like Qwen's.

The vocab sizes differ on purpose, the way real checkpoints do: the target's
embedding is padded past the tokenizer length (as in Qwen checkpoints), and
the draft's is padded by a different amount. The padded rows of both output
heads are zero, so those ids get logit 0: never a greedy pick, but a small
probability under sampling.

The draft is a noisy copy of the target: each weight tensor gets Gaussian
noise with a standard deviation of ``--draft-noise`` times that tensor's own
standard deviation. The default (0.02) is chosen so that greedy speculative
decoding with K = 4 accepts about half of the draft tokens (46-63% for seeds
0-3), so both the accept and the reject paths run; at temperature 1 a draft
token is accepted with probability about 0.9. ``--measure`` prints these
figures for the pair just built.

Everything is seeded: the same ``--seed`` gives the same bytes.

Usage:
    python -m scripts.model_tools.make_tiny_models --out models/tiny [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

TOKENIZER_VOCAB_SIZE = 350
TARGET_VOCAB_SIZE = 384  # padded past the tokenizer, like real checkpoints
DRAFT_VOCAB_SIZE = 360  # differs from the target's on purpose

# Large enough that the logits of a random model are far from uniform, so
# greedy picks are decided by clear margins rather than float rounding.
INITIALIZER_RANGE = 0.2

# Chosen with --measure so that greedy acceptance is partial (see the docstring).
# The logit margins of a random model are small, so acceptance is sensitive:
# 0.01 gives about 75%, 0.05 about 25%.
DEFAULT_DRAFT_NOISE = 0.02

# Qwen2's pre-tokenizer split. transformers loads a qwen2 checkpoint's
# tokenizer as Qwen2Tokenizer, which rebuilds the pipeline with this regex, so
# training with the same pipeline makes every loader produce the same ids.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as in Qwen2 chat checkpoints, with Qwen2.5's rendering of tools: the
# function signatures in the system turn, an assistant's calls as <tool_call>
# blocks and tool results as <tool_response> blocks in a user turn. Without
# tools, tool calls or tool messages it renders plain ChatML.
CHAT_TEMPLATE = (
    "{%- set skip_first = tools and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if skip_first %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall a function with:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and skip_first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- (call['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CORPUS = [
    """Speculative decoding makes a large language model answer faster without
changing what it says. A small draft model guesses the next few tokens, and the
large target model checks all of them in a single forward pass. Every guess the
target agrees with is kept; at the first disagreement the target's own choice
is used instead, and the draft starts guessing again from there.""",
    """The quick brown fox jumps over the lazy dog. She sells sea shells by the
sea shore. A journey of a thousand miles begins with a single step. The weather
today is sunny with a light breeze from the west, and the forecast for tomorrow
says it will rain in the afternoon.""",
    """Once upon a time there was a little robot who wanted to learn how to
write poems. Every morning it read a book from the library, and every evening
it wrote one line. After a year it had a long poem about the stars, the moon
and the people it had met along the way.""",
    """Hello! How can I help you today? Please tell me what you need, and I will
do my best to answer. Thank you for your question. Here is a short summary of
the main points, followed by an example.""",
    '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")
''',
    """import json
import os

def load_config(path):
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)

config = load_config(os.path.join("configs", "model.json"))
result = {"name": config["name"], "size": len(config), "ok": True}
""",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE on CORPUS and wrap it for transformers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any UTF-8 text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so that the merges are not decided by single counts.
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return wrap_tokenizer(tokenizer)


def wrap_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """A `tokenizers` tokenizer as transformers loads the pair's: its special tokens and chat template."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=1024,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_config(vocab_size: int, eos_token_id: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        dtype="float32",
    )


def zero_padded_rows(model: Qwen2ForCausalLM, num_real_tokens: int) -> None:
    """Zero the embedding and head rows of ids the tokenizer never produces."""
    with torch.no_grad():
        model.get_input_embeddings().weight[num_real_tokens:] = 0.0
        model.get_output_embeddings().weight[num_real_tokens:] = 0.0


def build_draft(target: Qwen2ForCausalLM, config: Qwen2Config, noise: float, num_real_tokens: int) -> Qwen2ForCausalLM:
    """A draft model whose weights are the target's plus relative Gaussian noise."""
    draft = Qwen2ForCausalLM(config)
    target_state = target.state_dict()
    draft_state = draft.state_dict()
    with torch.no_grad():
        for name, draft_param in draft_state.items():
            target_param = target_state[name]
            if draft_param.shape != target_param.shape:
                # Embedding and head: copy the rows both vocabularies have.
                num_rows = min(draft_param.shape[0], target_param.shape[0])
                draft_param.zero_()
                draft_param[:num_rows] = target_param[:num_rows]
            else:
                draft_param.copy_(target_param)
            # Relative noise; tensors with no spread (the norm weights, all ones)
            # stay exact copies.
            scale = draft_param.float().std() if draft_param.numel() > 1 else 0.0
            draft_param.add_(torch.randn_like(draft_param) * noise * scale)
    zero_padded_rows(draft, num_real_tokens)
    return draft


def save_model(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    eos_token_id: int,
    out_dir: Path,
) -> None:
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


@torch.no_grad()
def measure_acceptance(
    target: Qwen2ForCausalLM,
    draft: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    num_speculative_tokens: int = 4,
    max_new_tokens: int = 32,
) -> dict[str, float]:
    """Greedy speculative decoding with full recomputation (no caches).

    Returns the fraction of draft tokens accepted, the per-position rate at
    which the draft's greedy pick equals the target's, and the mean per-token
    acceptance probability at temperature 1 (sum of min(target, draft) probs).
    """
    prompts = [
        "The quick brown fox",
        "def fibonacci(n):",
        "Once upon a time",
        "Hello! How can I",
        "import json",
        "The weather today",
        "A small draft model",
        "class Counter:",
    ]
    num_drafted = num_accepted = 0
    for prompt in prompts:
        token_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, seq]
        num_prompt_tokens = token_ids.shape[1]
        while token_ids.shape[1] - num_prompt_tokens < max_new_tokens:
            proposal = token_ids
            for _ in range(num_speculative_tokens):
                next_id = draft(proposal).logits[:, -1].argmax(-1, keepdim=True)
                proposal = torch.cat([proposal, next_id], dim=1)
            draft_ids = proposal[0, token_ids.shape[1] :]  # [k]
            # Target greedy picks at the k draft positions plus the bonus one.
            target_logits = target(proposal).logits[0, token_ids.shape[1] - 1 :]
            target_ids = target_logits.argmax(-1)  # [k + 1]
            num_ok = 0
            while num_ok < num_speculative_tokens and draft_ids[num_ok] == target_ids[num_ok]:
                num_ok += 1
            num_drafted += num_speculative_tokens
            num_accepted += num_ok
            new_ids = torch.cat([draft_ids[:num_ok], target_ids[num_ok : num_ok + 1]])
            token_ids = torch.cat([token_ids, new_ids[None]], dim=1)

    # Per-position agreement along the target's own greedy path.
    num_positions = num_agree = 0
    sum_overlap = 0.0
    for prompt in prompts:
        token_ids = tokenizer(prompt, return_tensors="pt").input_ids
        for _ in range(max_new_tokens):
            target_logits = target(token_ids).logits[0, -1]  # [target_vocab]
            draft_logits = draft(token_ids).logits[0, -1]  # [draft_vocab]
            target_id = target_logits.argmax()
            num_positions += 1
            num_agree += int(target_id == draft_logits.argmax())
            target_probs = target_logits.softmax(-1)
            draft_probs = torch.zeros_like(target_probs)
            draft_probs[: draft_logits.shape[0]] = draft_logits.softmax(-1)
            sum_overlap += float(torch.minimum(target_probs, draft_probs).sum())
            token_ids = torch.cat([token_ids, target_id.view(1, 1)], dim=1)

    return {
        "acceptance_rate": num_accepted / num_drafted,
        "mean_accepted_length": num_accepted / (num_drafted / num_speculative_tokens),
        "per_token_agreement": num_agree / num_positions,
        "sampled_acceptance_probability": sum_overlap / num_positions,
    }


def save_tokenizer(out: Path) -> None:
    """Only the tokenizer, with the target's config.json so that transformers loads it as it loads the pair's."""
    tokenizer = build_tokenizer()
    eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    out.mkdir(parents=True, exist_ok=True)
    build_config(TARGET_VOCAB_SIZE, eos_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)


def build(out: Path, seed: int, draft_noise: float):
    """Build and save the pair; returns (target, draft, tokenizer)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    num_real_tokens = len(tokenizer)
    assert num_real_tokens <= DRAFT_VOCAB_SIZE <= TARGET_VOCAB_SIZE, num_real_tokens
    eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    target = Qwen2ForCausalLM(build_config(TARGET_VOCAB_SIZE, eos_token_id))
    zero_padded_rows(target, num_real_tokens)
    draft = build_draft(target, build_config(DRAFT_VOCAB_SIZE, eos_token_id), draft_noise, num_real_tokens)
    target.eval()
    draft.eval()

    out.mkdir(parents=True, exist_ok=True)
    save_model(target, tokenizer, eos_token_id, out / "target")
    save_model(draft, tokenizer, eos_token_id, out / "draft")
    return target, draft, tokenizer


def build_cross_vocab_draft(
    tokenizer: PreTrainedTokenizerFast, draft: Qwen2ForCausalLM, out: Path, seed: int, num_changed: int
) -> None:
    """A draft from "another family": the draft's weights with its tokenizer's ids shuffled,
    `num_changed` merged tokens taken out (their text then tokenizes as their parts) and as many
    merged tokens added that the target lacks (each predicted as often as its first part).

    The ids differ from the target's everywhere, special tokens included, and each side has
    tokens the other lacks, so the draft's distribution restricted to the shared tokens differs
    from its own: what `handler.drafters.cross_vocab` must handle.
    """
    generator = torch.Generator().manual_seed(seed)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in spec["model"]["merges"]]
    parts = {part for merge in merges for part in merge}
    # A merge's result that no other merge uses can go with its merge, and the rest still tokenizes.
    leaves = [merge for merge in merges if "".join(merge) not in parts]
    order = torch.randperm(len(leaves), generator=generator).tolist()
    removed = {"".join(leaves[index]) for index in order[:num_changed]}
    # New merges of two merged tokens, last in priority: the draft's own longer tokens.
    merged = ["".join(merge) for merge in merges if "".join(merge) not in removed]
    added = []
    for first, second in zip(merged, merged[1:] + merged[:1]):
        if len(added) < num_changed and first + second not in vocab:
            added.append((first, second))
    kept = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1]) if token not in removed]
    tokens = kept + [first + second for first, second in added]
    shuffle = torch.randperm(len(tokens), generator=generator).tolist()
    new_id = {token: shuffle[index] for index, token in enumerate(tokens)}
    spec["model"]["vocab"] = {token: new_id[token] for token in tokens}
    spec["model"]["merges"] = [list(merge) for merge in merges if "".join(merge) not in removed]
    spec["model"]["merges"] += [[first, second] for first, second in added]
    for special in spec["added_tokens"]:
        special["id"] = new_id[special["content"]]
    draft_tokenizer = wrap_tokenizer(Tokenizer.from_str(json.dumps(spec)))
    eos_token_id = new_id[EOS_TOKEN]
    moved = Qwen2ForCausalLM(build_config(draft.config.vocab_size, eos_token_id))
    moved.load_state_dict(draft.state_dict())
    with torch.no_grad():
        for weights, source in (
            (moved.get_input_embeddings().weight, draft.get_input_embeddings().weight),
            (moved.get_output_embeddings().weight, draft.get_output_embeddings().weight),
        ):
            weights.zero_()
            for token in kept:
                weights[new_id[token]] = source[vocab[token]]
            for first, second in added:
                weights[new_id[first + second]] = source[vocab[first]]
    moved.eval()
    save_model(moved, draft_tokenizer, eos_token_id, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--draft-noise",
        type=float,
        default=DEFAULT_DRAFT_NOISE,
        help="draft noise, relative to each tensor's std "
        f"(default {DEFAULT_DRAFT_NOISE}; 0 makes the draft equal the target)",
    )
    parser.add_argument(
        "--cross-vocab",
        type=int,
        default=0,
        metavar="N",
        help="also write OUT/cross-draft: the draft with its vocabulary shuffled, N merged tokens removed and N added",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also print the greedy acceptance rate of the pair (slower)",
    )
    args = parser.parse_args(argv)
    if args.draft_noise < 0:
        parser.error("--draft-noise must be >= 0")

    target, draft, tokenizer = build(args.out, args.seed, args.draft_noise)
    print(
        f"wrote {args.out / 'target'} (vocab {TARGET_VOCAB_SIZE}) and "
        f"{args.out / 'draft'} (vocab {DRAFT_VOCAB_SIZE}); "
        f"tokenizer length {len(tokenizer)}"
    )
    if args.cross_vocab:
        build_cross_vocab_draft(tokenizer, draft, args.out / "cross-draft", args.seed, args.cross_vocab)
        print(
            f"wrote {args.out / 'cross-draft'} (its own vocabulary: {args.cross_vocab} merged tokens out, as many in)"
        )
    if args.measure:
        print(json.dumps(measure_acceptance(target, draft, tokenizer), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
