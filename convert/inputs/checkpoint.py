"""A checkpoint's tensors by name for the streamed stages, whatever holds them: a safetensors checkpoint as stored
(``sources.CheckpointReader``), or the view of a pack too large to unfold in memory, unfolded as it is read
(``prism.UnfoldedPack``)."""

from __future__ import annotations

from pathlib import Path

import torch

from convert.inputs.prism import VIEW_FILE, UnfoldedPack
from convert.inputs.sources import CheckpointReader, tensor_shapes

Reader = CheckpointReader | UnfoldedPack


def open_checkpoint(directory: Path, device: torch.device | None = None) -> Reader:
    """A reader of ``directory``'s tensors (``get(key)``, ``rows(key, start, stop)``); a pack's view unfolds its
    matrices on ``device`` (``UnfoldedPack``; default the CPU)."""
    directory = Path(directory)
    return UnfoldedPack(directory, device) if (directory / VIEW_FILE).is_file() else CheckpointReader(directory)


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape (headers only; nothing is unfolded)."""
    directory = Path(directory)
    return UnfoldedPack(directory).shapes() if (directory / VIEW_FILE).is_file() else tensor_shapes(directory)
