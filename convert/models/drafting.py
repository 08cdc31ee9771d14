"""What every drafter family's driver shares (``convert.runtime.speculative.DrafterDriver``): the inputs of a call as
the host passes them, padded to the function's width."""

from __future__ import annotations

import numpy as np


def ids_input(values: list[int], width: int, pad: int | None = None) -> np.ndarray:
    """int32 [1, width]: ``values`` right-padded by repeating the last one (or with ``pad``)."""
    filler = values[-1] if pad is None else pad
    return np.asarray([values + [filler] * (width - len(values))], dtype=np.int32)


def rows_input(rows: np.ndarray, width: int) -> np.ndarray:
    """[1, width, F] fp16: ``rows`` [n, F] padded by repeating the last row (same position, same values)."""
    pad = np.repeat(rows[-1:], width - len(rows), axis=0)
    return np.concatenate([rows, pad])[None].astype(np.float16)
