"""Oasis's second pass (--shortlist): x_t's list is made resident, then ranked by its exact attention mass. A mixin
of OasisPolicy, kept apart so the policy's file holds its step; the methods use OasisPolicy's state."""
from __future__ import annotations

import torch


class OasisShortlist:
    def rank_resident_list(self, layer, q, scores, budget: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """--shortlist: x_t's list (its scores' best shortlist x budget blocks; the prediction was the draft's list),
        its blocks not on the GPU fetched first where this step fetches misses (cold rows; every row under "fetch"),
        then ranked by the exact mass of its resident blocks: listed blocks still not resident rank after those
        (as misses), blocks off the list never. With the whole list resident this is quest's second pass.
        Returns (the ranking, the residency table before the list's fetch, or None where nothing was fetched)."""
        width = scores.shape[1]
        _, listed = self.select_by(scores, self.cfg.shortlist_blocks(budget), count=False)
        before = None
        if self.fetches(dense=False):
            rows = torch.ones_like(self.cold) if self.fetch_every_miss else self.cold
            before = self.ws.table(layer, self.rows, width)
            resident = before.gather(1, listed.long().clamp(min=0)) >= 0
            with self.timer("gather"):
                fetched, _ = self.fetch(layer, torch.where((listed >= 0) & ~resident & rows[:, None], listed, -1),
                                        self.mask_of(listed))
            self.count("cold_fetched_blocks", fetched & self.cold[:, None])
            self.count("miss_fetched_blocks", fetched & ~self.cold[:, None])
        return self.rank_the_list(layer, q, listed, self.ws.table(layer, self.rows, width), width), before

    def count_list_fetches_as_misses(self, selection, before, resident) -> None:
        """The list's fetch ran before the residency check, which counted the selected blocks it brought as hits:
        they were misses, as they are without a list (and in retrieval, which counts before fetching)."""
        was_miss = (selection >= 0) & (before.gather(1, selection.long().clamp(min=0)) < 0) & (resident >= 0)
        brought = was_miss.sum(1)
        self.count("hits", -brought)
        self.count("misses", brought)
