"""The grammar as a drafter: the tokens a constraint's grammar forces next are certain drafts.

Where a row's grammar allows one token only (a JSON key, a closing bracket), that token is the
target's whatever it computes, so it is a free draft, one-hot like a look-up's
(docs/structured-outputs.md). The rows' grammars live with the rows (`handler.constraints`);
each asking row hands over its own (`DraftRow.forced`), so this drafter follows no row.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from handler.drafters import NO_DRAFTS, PROPOSER_GRAMMAR, DraftRow, Proposal


class GrammarDrafter:
    """Proposes the tokens each row's grammar forces."""

    name = PROPOSER_GRAMMAR

    def propose(self, rows: Sequence[DraftRow], sampling=None, keep_drafting=None) -> list[Proposal]:
        """Each row's forced tokens, up to its most drafts (NO_DRAFTS where its grammar forces none)."""
        proposals = []
        for row in rows:
            forced = row.forced(row.max_tokens) if row.forced is not None and row.max_tokens > 0 else []
            proposals.append(Proposal(list(forced)) if forced else NO_DRAFTS)
        return proposals

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        """Nothing to follow: a row's grammar moves with the row."""

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        """Nothing to follow: a row's grammar moves with the row."""

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        """Nothing to follow: a row's grammar moves with the row."""
