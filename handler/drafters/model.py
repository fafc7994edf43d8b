"""The draft-model drafter: a small causal LM samples up to k draft tokens, one forward pass each.

It keeps its own ragged KV cache, one row per request it has drafted for. A
request joins the cache when it first drafts (`fill`), not when it arrives:
under load a batch may decode plainly for a long time, and the draft's
prefill of every prompt would be time spent for nothing (on a CPU an int8
draft prefills about as slowly as the target). Tokens committed by the
engine that the draft model has not processed yet are its pending tokens:
the last token of what it prefilled at first, then whatever the target
emitted that differs from what the draft fed itself (the recovered or bonus
token, or look-up drafts accepted in hybrid mode). They are fed at the start
of the next proposal, so the cache never has to recompute a prefix.
"""

from __future__ import annotations

import bisect
import functools
from typing import Callable, Hashable, Mapping, Sequence

import torch

from handler.caches.kv_cache import chunk_of
from handler.caches.prefix_cache import PrefixCache, prefill_with_cache
from handler.caches.rollback import draft_rollback
from handler.drafters import MODEL, DeviceDrafts, DraftRow, Proposal
from handler.logits_processors import ChainPenalties
from handler.runners import BatchCache, DynamicRunner
from handler.sampler import SamplingBatch, argmax_vocab, host_to_device, sample_from_probs


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [batch, positions, draft_vocab]
    """Puts draft logits on the target's vocabulary: extra ids cut, missing ids impossible."""
    draft_vocab = logits.shape[-1]
    if draft_vocab > vocab_size:
        return logits[..., :vocab_size]
    if draft_vocab < vocab_size:
        padding = logits.new_full((*logits.shape[:-1], vocab_size - draft_vocab), float("-inf"))
        return torch.cat([logits, padding], dim=-1)
    return logits


def confidence_tensors(
    logits: torch.Tensor,
    sampled: torch.Tensor,  # [rows, n, vocab], [rows, n]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device: the draft model's own probability of each draft (softmax of its logits, before
    warping), and its likeliest other token with that token's probability; each [rows, n]."""
    raw_probs = torch.softmax(logits.float(), dim=-1)  # [rows, n, vocab], a tensor of its own
    confidence = raw_probs.gather(-1, sampled[..., None])[..., 0]
    # The likeliest token other than the draft: the largest once the draft's own entry is below every
    # probability. An argmax, not a top two: on a CPU `topk` costs 16x `amax` over a real vocabulary.
    raw_probs.scatter_(-1, sampled[..., None], -1.0)
    other_ids = argmax_vocab(raw_probs)  # [rows, n]
    return confidence, other_ids, raw_probs.gather(-1, other_ids[..., None])[..., 0]


def draft_confidences(
    logits: torch.Tensor,
    sampled: torch.Tensor,  # [rows, n, vocab], [rows, n]
) -> tuple[list[list[float]], list[list[int]], list[list[float]]]:
    """`confidence_tensors` read by the host; each [rows][n]."""
    confidence, other_ids, other_probs = confidence_tensors(logits, sampled)
    return confidence.tolist(), other_ids.tolist(), other_probs.tolist()


class ModelDrafter:
    """Proposes draft tokens sampled from a draft model, with their draft distributions.

    One draft KV cache holds every row it drafts for, all in one forward pass per
    draft token.
    """

    name = MODEL

    def __init__(
        self,
        model,
        vocab_size: int,
        pad_token_id: int,
        prefix_cache: PrefixCache | None = None,
        runner=None,
        guesser=None,
        stop_by_mask: bool | None = None,
        prefill_model=None,
        prefill_speedup: float = 1.0,
    ) -> None:
        """`vocab_size` is the target's: draft distributions are put on it. `prefix_cache` holds
        the draft model's KV of earlier prompts and completions (keyed by the ids it was fed).
        `runner` holds the running batch (`handler.runners`); None: the dynamic one. `guesser`: the
        look-up whose `continuation` guesses a guessing row's next drafts (guessed drafting), or None.
        `stop_by_mask`: see the attribute; None: True where the draft model runs on CUDA.
        `prefill_model`: another form of the draft's weights that prefills joining rows (the float
        form of an int8 draft, `handler.runtime.cpu_speed.choose_draft_quantization`), their KV then
        cast to the draft's; the prefix cache holds its KV. None: the draft prefills. `prefill_speedup`:
        how much faster it prefilled than the draft at start-up (the planner's price of the draft's own
        wide passes, from the prefills' seconds a token)."""
        self.model = model
        self.prefill_model = model if prefill_model is None else prefill_model
        self.prefill_speedup = prefill_speedup
        self.guesser = guesser
        self.runner = runner or DynamicRunner(model)
        self.vocab_size = vocab_size
        self.draft_vocab_size = model.config.get_text_config().vocab_size
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        # How a proposal that measures confidences meets its stop rule (`keep_drafting`). True: its chains
        # run all k passes on the device and are read once, and the rule is applied to what was read, the
        # drafts past the stop dropped (`_propose_chains`). False: the host reads every pass and stops
        # drafting where the rule says. On a GPU a read per pass stalls the queue of passes; on a CPU a
        # read costs nothing and a stop saves whole passes.
        self.stop_by_mask = self.device.type == "cuda" if stop_by_mask is None else stop_by_mask
        # Whether chains that measure no confidences leave their drafts on the device into the verify
        # pass, read with the verdict (`DeviceDrafts`): on a GPU that saves the step a wait for the device;
        # on a CPU a read costs nothing, and lists are cheaper to handle than a tensor's rows (0.1 to
        # 0.2 ms a step of the tiny pair's own time). True where the draft model runs on CUDA.
        self.drafts_on_device = self.device.type == "cuda"
        self.cache: BatchCache | None = None
        self.order: list[Hashable] = []  # request ids, in cache row order
        self.pending: dict[Hashable, list[int]] = {}
        # Drafts fed to the cache by the last proposal, beyond the committed tokens.
        self.fed: dict[Hashable, list[int]] = {}
        # Pending tokens the last proposal fed, in case the row then commits nothing.
        self.fed_pending: dict[Hashable, list[int]] = {}
        self.prefix_cache = prefix_cache
        self.prefix_handles: dict[Hashable, object] = {}  # locked prefix-cache nodes, by request id
        # Requests not in the cache yet: their prompt and the tokens committed since (`fill`).
        self.unfilled: dict[Hashable, list[int]] = {}
        # Per row of the last proposal's `sampling`: its drafts after each pass, and the drafts the
        # proposal kept for every row.
        self.last_draft_counts: dict[Hashable, list[int]] = {}
        self.last_num_drafts = 0
        # Passes the last proposal ran after its drafts were decided (a stop by mask runs all k).
        self.last_passes_past_stop = 0

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        """Takes the new requests' prompts; each joins the cache when it first drafts (`fill`). A row's
        cache serves it alone (`private` changes nothing)."""
        for request_id, prompt_ids in prompts.items():
            assert request_id not in self.unfilled and request_id not in self.pending, request_id
            self.unfilled[request_id] = list(prompt_ids)

    def unfilled_tokens(self, request_id: Hashable) -> int:
        """The tokens `fill` would prefill for a request not in the cache yet (0 for one in it)."""
        return len(self.unfilled.get(request_id, ()))

    def fill(self, request_ids: Sequence[Hashable]) -> None:
        """Prefills the requests' sequences so far, all but the last token, and appends their rows."""
        ids = [request_id for request_id in request_ids if request_id in self.unfilled]
        if ids:
            self._join({request_id: self._start_row(request_id, self.unfilled.pop(request_id)) for request_id in ids})

    def _start_row(self, request_id: Hashable, sequence: list[int]) -> list[int]:
        """A joining row's bookkeeping; returns its prefill, in the draft's ids (its last token stays pending)."""
        self.pending[request_id] = list(sequence[-1:])
        self.fed[request_id] = []
        self.fed_pending[request_id] = []
        return self._draft_ids(sequence[:-1])

    def _join(self, prefixes: Mapping[Hashable, Sequence[int]]) -> None:
        """Prefills each joining row's prefix, in the draft's ids, through the prefix cache, and appends
        the rows to the batch in that order."""
        ids = list(prefixes)
        prefill_ids = [prefixes[r] for r in ids]
        filled = prefill_with_cache(self.prefill_model, self.prefix_cache, prefill_ids, self.pad_token_id)
        if self.prefill_model is not self.model:
            filled.cache.hand_to(self.model)
        if self.cache is None:
            self.cache = self.runner.adopt(filled.cache)
        else:
            self.cache.extend(filled.cache)
        for request_id, handle in zip(ids, filled.handles):
            if handle is not None:
                self.prefix_handles[request_id] = handle
            self.order.append(request_id)

    @property
    def num_rows(self) -> int:
        return len(self.order)

    @property
    def max_pending(self) -> int:
        """The most tokens a row feeds the next proposal's first pass (1 but after steps without drafts)."""
        return max([len(tokens) for tokens in self.pending.values()], default=1) or 1

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        """Drops the rows of `request_ids`.

        Args:
            sequences: request id -> prompt + completion, for rows whose cache is
                consistent (after a step): what the draft cache holds of it goes
                into the prefix cache. None after a failed step.
        """
        for request_id in request_ids:
            self.unfilled.pop(request_id, None)
        gone = set(request_ids) & set(self.order)
        if not gone:
            return
        if self.prefix_cache is not None:
            for slot, request_id in enumerate(self.order):
                if request_id not in gone:
                    continue
                if sequences is not None and request_id in sequences:
                    # The cache holds the sequence but for its pending tokens, the last one at least.
                    tokens = self._draft_ids(list(sequences[request_id]))
                    num_cached = min(int(self.cache.lengths[slot]), len(tokens) - 1)
                    if num_cached > 0:
                        # In the prefill's dtype: the prefix cache's KV serves prefills alone.
                        self.prefix_cache.insert(
                            tokens[:num_cached],
                            lambda start, end, slot=slot: self.cache.row_kv(slot, start, end).to(
                                self.prefill_model.dtype
                            ),
                        )
                handle = self.prefix_handles.pop(request_id, None)
                if handle is not None:
                    self.prefix_cache.unlock(handle)
        keep = [slot for slot, request_id in enumerate(self.order) if request_id not in gone]
        self.order = [self.order[slot] for slot in keep]
        for request_id in gone:
            self._forget(request_id)
        if not self.order:
            self.cache = None  # an empty batch restarts from a fresh cache
        else:
            self.cache.select_rows(keep)

    def propose(
        self,
        rows: Sequence[DraftRow],
        sampling: SamplingBatch,
        keep_drafting: Callable[[int, dict[Hashable, float]], bool] | None = None,
    ) -> list[Proposal]:
        """Samples up to k draft tokens for every row of the cache, k the most any row in `rows` wants.

        With `guesser`, a guessing row's draft pass may also run over tokens the draft model is
        likely to draft next (a look-up's continuation of the drafts so far): the
        pass gives the logits after each of them, so while the row's draws equal the
        guesses, one pass yields several drafts (`handler.drafters`, guessed drafting). Every
        draft is still drawn from the draft model's own distribution with that
        draft's own uniform: the guesses change how many passes the drafts take,
        never which drafts they are (up to the rounding of a wider pass).

        The vocabulary's part is in a few methods that a draft with another vocabulary overrides
        (`handler.drafters.cross_vocab`): the first feeds, the ids a pass reads, the logits on the
        target's vocabulary, what a draft feeds back, and the cache after the last pass.

        Args:
            rows: the rows whose drafts will be verified, each with its most drafts (>= 1), its slot in
                `sampling` (whose `uniforms` hold its draws), its rules on the draft's logits (`shape`,
                called once per draft, in order, so that it can follow the drafts; a shaped row takes no
                guesses; where they are its penalties alone, `penalties`, which the chains apply instead),
                how many guessed drafts a pass may carry for it (0: it does not guess) and whether its
                confidences are measured (a softmax over the vocabulary per draft; without,
                no `keep_drafting`). Other rows of the cache draft greedily and their drafts are only
                fed to keep the batch rectangular.
            sampling: the step's settings, rows in the step's order.
            keep_drafting: f(drafts so far, request id -> confidence of its latest draft, for the
                asking rows) -> whether to draft one more; None: draft k. With `stop_by_mask` the k
                passes all run and the rule is asked after them, draft by draft: the same drafts stay.

        Returns:
            each row's `Proposal` of n <= k drafts, with their distributions (None where no row of the
            batch samples: one-hot at the drafts; and confidences and runners-up where measured); the
            number of draft passes they took is `last_num_passes`.
        """
        assert rows and self.cache is not None
        wanted = {row.request_id: row for row in rows}
        with_confidence = any([row.measure_confidence for row in rows])
        assert with_confidence or keep_drafting is None
        k = max([row.max_tokens for row in rows])
        num_rows = len(self.order)
        asking = [slot for slot, request_id in enumerate(self.order) if request_id in wanted]
        # A row that runs ahead of the others on its guesses draws beyond k before it is cut back to
        # the step's drafts: each pass gives every row one draft at least, and there are at most k passes.
        settings = sampling.select(
            [wanted[r].slot if r in wanted else None for r in self.order],
            [wanted[r].max_tokens if r in wanted else 0 for r in self.order],
            2 * k + 1,
        )
        shaped = {slot: wanted[self.order[slot]].shape for slot in asking if wanted[self.order[slot]].shape}
        guess_of, max_guesses = {}, {}
        if self.guesser is not None:
            guess_of = {
                slot: functools.partial(self.guesser.continuation, self.order[slot])
                for slot in asking
                if wanted[self.order[slot]].guesses and slot not in shaped
            }
            max_guesses = {slot: wanted[self.order[slot]].guesses for slot in guess_of}
        texts = self._texts(asking, settings, shaped)
        # Rows whose only rules are their logit bias and penalties keep to the chains: those apply them on
        # the device. A grammar's mask is the host's, asked draft by draft: the loop below reads each pass.
        penalized = {slot: wanted[self.order[slot]].penalties for slot in shaped}
        only_penalties = all([history is not None for history in penalized.values()])
        if (
            not (guess_of or texts)
            and only_penalties
            and (self.stops_by_mask if with_confidence else self._feeds_drafts)
        ):
            penalties = self._chain_penalties(penalized) if penalized else None
            return self._propose_chains(rows, settings, k, asking, with_confidence, keep_drafting, penalties)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        probs_of: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
        confidences: list[list[float]] = [[] for _ in range(num_rows)]
        runners_up: list[list[tuple[int, float]]] = [[] for _ in range(num_rows)]
        # Rows that draft no more: a draw the draft cannot read (a grammar left it no token of its own),
        # a text whose draft drew a special token.
        stalled: set[int] = set()
        feeds = self._first_feeds()
        # Where no row samples, a draw is the argmax and its distribution one-hot at the draft: no
        # distributions are built, and a proposal without `draft_probs` says so (`_propose_chains`).
        greedy = settings.all_greedy
        num_drafts, num_passes = 0, 0  # drafts decided for the batch: every asking row has at least as many
        counts = {slot: [] for slot in asking}  # drafts after each pass
        # A text row's last target token may be unfinished: one pass more finishes its k-th.
        max_passes = k + 1 if texts else k
        while True:
            tried = [[] for _ in range(num_rows)]
            for slot, guess in guess_of.items():
                room = min(k - len(drafts[slot]) - 1, max_guesses[slot])
                if room > 0:
                    tried[slot] = list(guess(drafts[slot], room))[:room]
            num_kept = 1 + max(len(tokens) for tokens in tried)
            input_ids, chunk_mask = chunk_of([feed + extra for feed, extra in zip(feeds, tried)], self.pad_token_id)
            draft_logits = self.cache.forward(self._pass_ids(input_ids), chunk_mask, logits_to_keep=num_kept)
            num_passes += 1
            self._fed(feeds)
            logits = self._target_logits(draft_logits)  # [rows, num_kept, vocab]
            if shaped:
                logits = logits.clone()
                for slot, shape in shaped.items():
                    previous = drafts[slot][-1] if drafts[slot] else None
                    logits[slot, -1] = shape(logits[slot, -1], previous)
            # Column c of the kept logits follows the row's guess number c - offset (-1: its feed).
            offsets = [num_kept - 1 - len(tokens) for tokens in tried]
            if greedy:
                sampled = argmax_vocab(logits)  # [rows, num_kept]
            else:
                # The draft draws from the distribution the target's is warped to: min-p included.
                probs = settings.warp(logits)  # [rows, num_kept, vocab]
                index = torch.tensor(
                    [
                        [min(len(drafts[slot]) + max(c - offsets[slot], 0), 2 * k) for c in range(num_kept)]
                        for slot in range(num_rows)
                    ]
                )
                step_uniforms = settings.uniforms.gather(1, index).to(self.device)  # [rows, num_kept]
                sampled = sample_from_probs(probs.flatten(0, 1), step_uniforms.flatten()).view(num_rows, num_kept)
            if with_confidence:
                confidence, other_ids, other_probs = draft_confidences(logits, sampled)
            own = self._own_choices(draft_logits, with_confidence)
            sampled_ids = sampled.tolist()
            lengths = self.cache.lengths.clone()
            for slot in range(num_rows):
                if slot in texts and slot not in stalled:
                    if not texts[slot].take(own[0][slot], own[1][slot] if with_confidence else 0.0):
                        stalled.add(slot)
                    drafts[slot], confidences[slot] = texts[slot].target_ids, texts[slot].confidences
                if slot in stalled or slot in texts:
                    feeds[slot] = [own[0][slot]]
                    continue
                for column in range(offsets[slot], num_kept):
                    token = sampled_ids[slot][column]
                    feed = self._feed_of(token)
                    if feed is None:
                        stalled.add(slot)
                        break
                    drafts[slot].append(token)
                    if not greedy:
                        probs_of[slot].append(probs[slot, column])
                    feeds[slot] = [feed]
                    if with_confidence:
                        confidences[slot].append(confidence[slot][column])
                        runners_up[slot].append((other_ids[slot][column], other_probs[slot][column]))
                    number = column - offsets[slot]  # this draft's guess was tried[slot][number]
                    if number >= len(tried[slot]) or token != tried[slot][number]:
                        # The guesses from here on were fed for nothing: out of the cache.
                        lengths[slot] -= len(tried[slot]) - number
                        break
                if slot in stalled:
                    feeds[slot] = [own[0][slot]]
            if any(tried):
                self.cache.rollback(lengths)
            out_of_passes = num_passes >= max_passes or all(slot in stalled for slot in asking)
            num_drafts, stop = agree_on_drafts(
                self.order, asking, drafts, confidences, counts, num_drafts, k, keep_drafting, stop=out_of_passes
            )
            if stop:
                break
        if num_drafts < k and out_of_passes:
            # Out of passes, or every row stalled, before each row had k: each keeps what it has.
            num_drafts = min(k, max(len(drafts[slot]) for slot in asking))
        self.last_draft_counts = {self.order[slot]: counts[slot] for slot in asking}
        self.last_num_drafts = num_drafts
        self.last_passes_past_stop = 0
        self._end_proposal(drafts, num_drafts)
        proposals = {}
        for slot in asking:
            token_ids = drafts[slot][:num_drafts]
            if slot in texts or not token_ids:
                # A re-tokenized draft is the draft's greedy choice: its distribution is one-hot.
                draft_probs = torch.zeros((len(token_ids), self.vocab_size), device=self.device)  # [n, vocab]
                draft_probs[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)] = 1.0
            elif greedy:
                draft_probs = None
            else:
                draft_probs = torch.stack(probs_of[slot][: len(token_ids)])  # [n, vocab]
            proposals[self.order[slot]] = Proposal(
                token_ids,
                draft_probs=draft_probs,
                confidences=confidences[slot][: len(token_ids)] if with_confidence else None,
                runners_up=runners_up[slot][: len(token_ids)] if with_confidence else None,
            )
        return [proposals[row.request_id] for row in rows]

    def _propose_chains(
        self,
        rows: Sequence[DraftRow],
        settings: SamplingBatch,
        k: int,
        asking: list[int],
        with_confidence: bool = False,
        keep_drafting: Callable[[int, dict[Hashable, float]], bool] | None = None,
        penalties: ChainPenalties | None = None,
    ) -> list[Proposal]:
        """`propose` where every row drafts one token a pass and feeds it to the next: no guesses, no
        rules but the rows' logit bias and penalties (`penalties`: applied on the device, the drafts so
        far counted pass by pass), a draft the draft model reads. The drafts stay on the device across
        the k passes: the same drafts as the general loop's (row i's draft j drawn with uniform j), without
        a wait for the device per pass. Without confidences and with `drafts_on_device` (a GPU) they stay there into
        the verify pass, and the host has them from the step's one read, with the verdict
        (`DeviceDrafts`: each proposal's tokens, and the feeds `observe` compares, are read then);
        otherwise the host reads them once, after the last pass (with confidences: for the stop rule
        and the runners-up).

        With confidences (where `stop_by_mask`), they are measured where the passes' logits are, once
        over all k passes (`confidence_tensors`: a dozen device calls, a pass's or the chain's), and
        read with the drafts. The stop rule is then asked on the host, pass by
        pass, as the general loop asks it (`agree_on_drafts`: the same calls, of a rule that keeps
        state), and the drafts past its stop are dropped with the cache's feeds of them
        (`_end_proposal`): the proposals, the counts and the cache are the general loop's. The passes
        past the stop still ran, and `last_num_passes` counts them.
        """
        input_ids, chunk_mask = chunk_of(self._first_feeds(), self.pad_token_id)
        # Where no row samples, a draw is the argmax, and its distribution is one-hot at the draft itself:
        # a proposal without `draft_probs` says so, as a look-up's does.
        greedy = settings.all_greedy
        uniforms = None if greedy else host_to_device(settings.uniforms[:, :k], self.device)  # [rows, k]
        sampled_per_pass, probs_per_pass, logits_per_pass = [], [], []
        for number in range(k):
            draft_logits = self.cache.forward(self._pass_ids(input_ids), chunk_mask, logits_to_keep=1)
            logits = self._target_logits(draft_logits)  # [rows, 1, vocab]
            if penalties is not None:
                logits = penalties.apply(logits)  # [rows, 1, vocab]
            if greedy:
                sampled = argmax_vocab(logits)  # [rows, 1]
            else:
                probs = settings.warp(logits)  # [rows, 1, vocab]
                sampled = sample_from_probs(probs[:, 0], uniforms[:, number])[:, None]  # [rows, 1]
                probs_per_pass.append(probs[:, 0])
            if penalties is not None and number < k - 1:
                penalties.add(sampled)
            sampled_per_pass.append(sampled)
            if with_confidence:
                logits_per_pass.append(logits)
            input_ids = sampled  # [rows, 1]: the next pass reads the draft where it is
            chunk_mask = None  # one draft a row: no padding
        drafted = torch.cat(sampled_per_pass, dim=1)  # [rows, k]
        if with_confidence:
            # The stop rule and the runners-up are the host's, before the verify pass: the proposal's one
            # wait for the device. float64 holds the ids (below 2**53) and the float32 probabilities exactly.
            measured = confidence_tensors(torch.cat(logits_per_pass, dim=1), drafted)  # 3 x [rows, k]
            read = torch.stack([values.double() for values in (drafted, *measured)]).tolist()  # [4][rows][k]
            drafts = [[int(token) for token in row] for row in read[0]]
            confidences, other_ids, other_probs = read[1:]
        elif self.drafts_on_device:
            # No wait at all: the drafts stay on the device into the verify pass, and the host has them
            # from the step's one read, with the verdict (`DeviceDrafts`).
            on_device = DeviceDrafts(drafted)
            drafts = [on_device.chain(slot, k) for slot in range(len(self.order))]
        else:
            drafts = drafted.tolist()  # [rows][k]: the proposal's one wait for the device
        draft_probs = None if greedy else torch.stack(probs_per_pass, dim=1)  # [rows, k, vocab]
        num_drafts = num_passes = k
        counts = {slot: list(range(1, k + 1)) for slot in asking}
        if with_confidence:
            # The general loop's decisions, pass by pass, on the drafts it would have had by then.
            counts = {slot: [] for slot in asking}
            num_drafts, num_passes, stop = 0, 0, False
            while not stop:
                num_passes += 1
                so_far = [row[:num_passes] for row in drafts]
                num_drafts, stop = agree_on_drafts(
                    self.order, asking, so_far, confidences, counts, num_drafts, k, keep_drafting, stop=num_passes >= k
                )
            if num_passes >= k:
                num_drafts = k  # out of passes with k drafts a row: the general loop keeps them all
        self.last_draft_counts = {self.order[slot]: counts[slot] for slot in asking}
        self.last_num_drafts = num_drafts
        # The passes past the stop ran over the whole batch, and the draft seconds hold them: the step's
        # record and the cost table's draft scale (`handler.engine.propose`) take all k, so that the
        # scale is the seconds of a pass that ran. A row's own passes (`passes_needed`, its draft_passes)
        # stay those its drafts needed, as the general loop counts a row that needed fewer than the batch.
        self.last_passes_past_stop = k - num_passes
        self._end_proposal(drafts, num_drafts)
        proposals = {
            self.order[slot]: Proposal(
                drafts[slot][:num_drafts],
                draft_probs=None if greedy else draft_probs[slot, :num_drafts],
                confidences=confidences[slot][:num_drafts] if with_confidence else None,
                runners_up=(
                    [(int(token), prob) for token, prob in zip(other_ids[slot], other_probs[slot][:num_drafts])]
                    if with_confidence
                    else None
                ),
            )
            for slot in asking
        }
        return [proposals[row.request_id] for row in rows]

    def _chain_penalties(self, penalized: dict[int, tuple]) -> ChainPenalties:
        """The chains' logit bias and penalties for the cache rows `penalized` (slot -> `DraftRow.penalties`)."""
        slots = list(penalized)
        params, counts, seen = zip(*[penalized[slot] for slot in slots])
        return ChainPenalties(slots, params, counts, seen, self.vocab_size, self.device)

    @property
    def stops_by_mask(self) -> bool:
        """Whether a proposal without guesses or shaping that measures confidences runs its k passes and
        applies the stop rule after them (`stop_by_mask`, where the chains serve it), not pass by pass."""
        return self.stop_by_mask and self._feeds_drafts

    @property
    def _feeds_drafts(self) -> bool:
        """Whether every draft is fed back as it is and nothing notes the feeds: the chains skip both
        `_feed_of` and `_fed`, so a drafter that overrides either (`cross_vocab`) takes the general loop."""
        return type(self)._feed_of is ModelDrafter._feed_of and type(self)._fed is ModelDrafter._fed

    # The vocabulary's part of the draft loop (`handler.drafters.cross_vocab` overrides it).

    def _first_feeds(self) -> list[list[int]]:
        """Each cache row's first feed of a proposal: its pending tokens."""
        return [list(self.pending[request_id]) for request_id in self.order]

    def _pass_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [rows, width]
        """The ids a draft pass reads, from the feeds."""
        return self._draft_ids(input_ids)

    def _fed(self, feeds: list[list[int]]) -> None:
        """Takes note of what a pass fed the cache (the feeds, guesses apart)."""

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [rows, n, draft_vocab]
        """A pass's logits on the target's vocabulary [rows, n, vocab]."""
        return fit_vocab(draft_logits, self.vocab_size)

    def _own_choices(self, draft_logits: torch.Tensor, with_confidence: bool):
        """What a row that drafts no proposal tokens feeds instead (per row: the id, and its confidence);
        None here, where every row feeds its draft."""
        return None

    def _feed_of(self, token: int) -> int | None:
        """What a draft feeds the next pass (None: the draft cannot read it, and the row stalls)."""
        return token

    def _texts(self, asking: list[int], settings: SamplingBatch, shaped: dict) -> dict:
        """Rows that draft text in the draft's own tokens (`handler.drafters.cross_vocab`): none here."""
        return {}

    def _end_proposal(self, drafts: list[list[int]], num_drafts: int) -> None:
        """Cuts every row back to the step's drafts; the cache keeps all of them but the last."""
        dropped = []
        for slot, request_id in enumerate(self.order):
            num = min(len(drafts[slot]), num_drafts)
            dropped.append(len(drafts[slot]) - num)
            self.fed_pending[request_id] = self.pending[request_id]
            self.pending[request_id] = []
            self.fed[request_id] = drafts[slot][: num - 1]
        self._drop(dropped)

    def passes_needed(self, request_id: Hashable, num_drafts: int) -> int:
        """The passes of the last proposal after which the row had its first `num_drafts` drafts."""
        if num_drafts <= 0:
            return 0
        counts = self.last_draft_counts[request_id]  # drafts so far after each pass: never decreasing
        return min(bisect.bisect_left(counts, num_drafts) + 1, len(counts))

    @property
    def last_num_passes(self) -> int:
        """The draft passes the last proposal took: until its slowest row had its drafts, and those it
        ran past its stop (`stop_by_mask`)."""
        needed = max([self.passes_needed(r, self.last_num_drafts) for r in self.last_draft_counts], default=0)
        return needed + self.last_passes_past_stop

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        """Takes each row's newly committed tokens and rolls the cache back to what it got right (`_sync`).
        A row absent from `committed` committed nothing.

        After a step without a proposal nothing was fed and nothing is dropped: the cache is left as it
        is, as a plain step leaves it (the committed tokens only join the pending ones); holes a leaving
        row left are re-packed by the next roll-back, at the end of the next proposal at the latest."""
        for request_id, tokens in self.unfilled.items():
            tokens.extend(committed.get(request_id, ()))
        if self.cache is None:
            return
        self._drop([self._sync(request_id, committed.get(request_id, ())) for request_id in self.order])

    def _drop(self, dropped: list[int]) -> None:
        """Drops the last `dropped[slot]` tokens of each cache row."""
        if any(dropped):
            self.cache.rollback(self.cache.lengths - torch.tensor(dropped, dtype=torch.long))

    def _sync(self, request_id: Hashable, tokens: Sequence[int]) -> int:
        """Takes a row's committed tokens; returns how many tokens its cache drops.

        The drafts a row fed itself stay cached as far as they match the committed
        tokens, but never the last committed token: the next proposal needs the
        logits that follow it, so it stays pending. The unseen committed tokens
        become pending. The arithmetic is `handler.caches.rollback.draft_rollback`.
        """
        num_dropped, self.pending[request_id] = draft_rollback(
            self.fed_pending[request_id], self.fed[request_id], self.pending[request_id], tokens
        )
        self.fed[request_id] = []
        self.fed_pending[request_id] = []
        return num_dropped

    def _forget(self, request_id: Hashable) -> None:
        """Drops a row's bookkeeping as it leaves the cache."""
        del self.pending[request_id], self.fed[request_id], self.fed_pending[request_id]

    def _draft_ids(self, token_ids):
        """Target ids the draft has no embedding for (a padded target vocabulary) become the pad id.

        They are never real tokens; the substitution only costs acceptance.
        """
        if self.vocab_size <= self.draft_vocab_size:
            return token_ids  # every target id has an embedding: nothing to substitute
        if isinstance(token_ids, torch.Tensor):
            return token_ids.masked_fill(token_ids >= self.draft_vocab_size, self.pad_token_id)
        return [t if t < self.draft_vocab_size else self.pad_token_id for t in token_ids]


def agree_on_drafts(
    order: list[Hashable],
    asking: list[int],
    drafts: list[list[int]],
    confidences: list[list[float]],
    counts: dict[int, list[int]],
    num_drafts: int,
    k: int,
    keep_drafting: Callable[[int, dict[Hashable, float]], bool] | None,
    stop: bool = False,
) -> tuple[int, bool]:
    """After a pass: records each asking row's drafts so far (`counts`), and moves the drafts the batch
    agrees on up while every asking row has one more and `keep_drafting` says one more pays
    (`order`: the request ids by cache row).

    Returns:
        the agreed number of drafts, and whether to stop drafting (k reached, or the rule said so).
    """
    for slot in asking:
        counts[slot].append(len(drafts[slot]))
    while not stop and all([len(drafts[slot]) > num_drafts for slot in asking]):
        num_drafts += 1
        stop = num_drafts >= k or (
            keep_drafting is not None
            and not keep_drafting(num_drafts, {order[slot]: confidences[slot][num_drafts - 1] for slot in asking})
        )
    return num_drafts, stop
