"""Qwen3 dense: the checkpoint's keys checked against the config, and its tensors loaded into a core."""

from __future__ import annotations

import torch
from torch import nn

from convert.errors import InputError
from convert.models.layout import Layout
from convert.models.qwen3.config import Qwen3Args, expected_shapes


def sanitize(shapes_in_checkpoint: dict[str, tuple[int, ...]], args: Qwen3Args, where: str = "checkpoint") -> Layout:
    """Refuse a checkpoint whose keys or shapes are not exactly a Qwen3 model's, naming the tensor.

    A tied checkpoint may still carry ``lm_head.weight`` (some writers save it); it is ignored then, as are
    the tensors of an MTP head the config declares (``mtp.*`` or ``model.layers.{num_hidden_layers + i}.*``).
    """
    expected = expected_shapes(args)
    present = dict(shapes_in_checkpoint)
    ignored = ()
    if args.mtp_layers:
        head = ("mtp.", *(f"model.layers.{args.num_hidden_layers + i}." for i in range(args.mtp_layers)))
        present = {k: v for k, v in present.items() if not k.startswith(head)}
        ignored = (("MTP head", len(shapes_in_checkpoint) - len(present)),)
    if args.tie_word_embeddings:
        present.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in present:
            raise InputError(f"checkpoint: tensor {key!r} is missing (expected shape {list(shape)})")
        if tuple(present[key]) != shape:
            raise InputError(f"checkpoint: tensor {key!r} has shape {list(present[key])}, expected {list(shape)}")
    unknown = sorted(set(present) - set(expected))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise InputError(f"checkpoint: unexpected tensor {unknown[0]!r}{more} for a Qwen3 dense model")
    return Layout(ignored=ignored)


def load_checkpoint_tensors(core: nn.Module, tensors: dict[str, torch.Tensor], layout: Layout) -> None:
    """Fill a target core's parameters (named as the causal LM's keys without ``model.``) from checkpoint tensors
    stored under ``layout``'s keys; a tied lm_head is the embedding's tensor already."""
    by_canonical = {layout.canonical(k): v for k, v in tensors.items()}
    own = {"model." + k if not k.startswith("lm_head") else k: v for k, v in core.state_dict().items()}
    with torch.no_grad():
        for key, param in own.items():
            if key == "lm_head.weight" and core.args.tie_word_embeddings:
                continue
            param.copy_(by_canonical[key].to(param.dtype))
