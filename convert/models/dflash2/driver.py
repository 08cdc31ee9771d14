"""How a runtime drives a DFlash2 drafter (``convert.runtime.speculative.DrafterDriver``): the target's tapped rows
into its context ring, then a draft of the block after each anchor (docs/drafters.md)."""

from __future__ import annotations

import numpy as np

from convert.export.names import ANCHOR_EMBEDDING, ANCHOR_ID, DRAFT_IDS, POSITION_IDS, TAPS
from convert.models.drafting import ids_input, rows_input


class DFlash2Driver:
    def __init__(self, functions, widths: dict[str, int], embeddings):
        self.functions, self.widths, self.embeddings = functions, widths, embeddings

    def begin(self, prompt: list[int], out: dict[str, np.ndarray]) -> None:
        """A fresh session, the prompt's taps (the target's prefill ``out``) written as context."""
        self.functions.reset()
        self.add_context(out[TAPS], 0, "context_update")

    def propose(self, text: list[int], position: int, count: int) -> list[int]:
        """The draft after the anchor ``text[-1]`` at ``position`` (``count``: the verify width's drafts)."""
        return self.draft(text[-1], position)

    def observe(self, accepted: list[int], verified: dict[str, np.ndarray], position: int) -> None:
        """The verify rows of the anchor and the accepted drafts (``accepted``: those and the bonus) as new context."""
        self.add_context(verified[TAPS][: len(accepted)], position, "context_append")

    def add_context(self, taps: np.ndarray, p0: int, function: str) -> None:
        width = self.widths[function]
        for start in range(0, len(taps), width):
            rows = taps[start : start + width]
            positions = list(range(p0 + start, p0 + start + len(rows)))
            self.functions.call(function, {TAPS: rows_input(rows, width),
                                           POSITION_IDS: ids_input(positions, width)})

    def draft(self, anchor: int, p0: int) -> list[int]:
        width = self.widths["draft"]
        out = self.functions.call("draft", {
            ANCHOR_EMBEDDING: self.embeddings[anchor][None, None].astype(np.float16),
            ANCHOR_ID: np.asarray([[anchor]], dtype=np.int32),
            POSITION_IDS: ids_input(list(range(p0, p0 + width)), width),
        })
        return [int(t) for t in np.asarray(out[DRAFT_IDS])[0]]
