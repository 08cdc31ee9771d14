"""How a runtime drives an MTP head (``convert.runtime.speculative.DrafterDriver``): ``accept`` over the newly
committed tokens, each with the target's hidden state of the position before it, returns the first draft;
``draft_step`` chains the rest from the head's own hidden output."""

from __future__ import annotations

import numpy as np

from convert.export.names import ARGMAX_IDS, DRAFT_IDS, HIDDEN, HIDDEN_OUT, INPUT_IDS, POSITION_IDS
from convert.models.drafting import ids_input, rows_input


class MTPDriver:
    def __init__(self, functions, widths: dict[str, int], embeddings=None):
        self.functions, self.widths = functions, widths
        self.next_draft, self.hidden = None, None

    def begin(self, prompt: list[int], out: dict[str, np.ndarray]) -> None:
        """A fresh session over the prompt and the target's first id (its prefill ``out``)."""
        self.functions.reset()
        self.next_draft, self.hidden = self.accept(prompt[1:] + [int(out[ARGMAX_IDS][-1])], out[HIDDEN], 1)

    def propose(self, text: list[int], position: int, count: int) -> list[int]:
        proposal = [self.next_draft]
        hidden = self.hidden
        for j in range(1, count):
            draft, hidden = self.step(proposal[-1], hidden, position + j)
            proposal.append(draft)
        return proposal

    def observe(self, accepted: list[int], verified: dict[str, np.ndarray], position: int) -> None:
        self.next_draft, self.hidden = self.accept(accepted, verified[HIDDEN][: len(accepted)], position + 1)

    def accept(self, tokens: list[int], hidden: np.ndarray, p0: int) -> tuple[int, np.ndarray]:
        """Rows (token at position p0+i, target hidden at p0+i-1); returns the last row's draft and hidden."""
        width = self.widths["accept"]
        for start in range(0, len(tokens), width):
            chunk = tokens[start : start + width]
            out = self.functions.call("accept", {
                INPUT_IDS: ids_input(chunk, width), HIDDEN: rows_input(hidden[start : start + width], width),
                POSITION_IDS: ids_input(list(range(p0 + start, p0 + start + len(chunk))), width),
            })
        last = len(chunk) - 1
        return int(np.asarray(out[DRAFT_IDS])[0, last]), np.asarray(out[HIDDEN_OUT])[0, last]

    def step(self, token: int, hidden: np.ndarray, position: int) -> tuple[int, np.ndarray]:
        out = self.functions.call("draft_step", {
            INPUT_IDS: np.asarray([[token]], dtype=np.int32), HIDDEN: hidden[None, None].astype(np.float16),
            POSITION_IDS: np.asarray([[position]], dtype=np.int32),
        })
        return int(np.asarray(out[DRAFT_IDS])[0, 0]), np.asarray(out[HIDDEN_OUT])[0, 0]
