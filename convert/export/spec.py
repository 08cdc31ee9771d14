"""The functions' shape contract that every layer speaks: tensor and function specs, the dtypes a package computes
and stores in, and how the plan prints them. Below the models and the backends, so both use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert.export.names import HIDDEN_STATES, INPUT_IDS, POSITION_IDS, ROPE_COS

DTYPES = ("int32", "float16", "float32")


DTYPE_BYTES = {"int32": 4, "float16": 2, "float32": 4}


WIDTH_INPUTS = (POSITION_IDS, INPUT_IDS, HIDDEN_STATES)  # a function's width: [1, S] of the first it takes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # one of DTYPES

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    states: tuple[TensorSpec, ...] = ()

    @property
    def width(self) -> int:
        """Tokens (rows) per call: the width of its ``position_ids``, or of the ids or rows a part without layers
        takes, or the rows of the RoPE inputs an ane function takes in their place (every function has one of
        them)."""
        by_name = {t.name: t for t in self.inputs}
        if ROPE_COS in by_name:
            return by_name[ROPE_COS].shape[0]
        return next(by_name[n].shape[1] for n in WIDTH_INPUTS if n in by_name)


def function_lines(specs: list[FunctionSpec], host_buffers=()) -> list[str]:
    """A plan's lines for one part: each function's inputs and outputs, then the states they share, and the inputs
    named in ``host_buffers`` (the ane layout's history, which the host owns and writes)."""

    def tensors(ts: tuple[TensorSpec, ...]) -> str:
        return ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in ts)

    lines = []
    for spec in specs:
        lines += [f"    {spec.name}", f"      inputs:  {tensors(spec.inputs)}",
                  f"      outputs: {tensors(spec.outputs)}"]
    if specs[0].states:
        lines.append("    states (all functions):")
        lines += [f"      {t.name} {list(t.shape)} {t.dtype}: {size_text(t.nbytes)}" for t in specs[0].states]
    owned = buffer_specs(specs, host_buffers)
    if owned:
        lines.append("    host buffers (the host passes them and writes each call's rows into them):")
        lines += [f"      {t.name} {list(t.shape)} {t.dtype}: {size_text(t.nbytes)}" for t in owned]
    return lines


def buffer_specs(specs: list[FunctionSpec], host_buffers) -> list[TensorSpec]:
    """The inputs named in ``host_buffers`` (the host's history or ring in the ane layout), each at the largest any
    function takes it (a ladder's smaller entries take leading rows; a DFlash2 drafter's ring only its draft)."""
    largest: dict[str, TensorSpec] = {}
    for spec in specs:
        for t in spec.inputs:
            if t.name in host_buffers and (t.name not in largest or t.nbytes > largest[t.name].nbytes):
                largest[t.name] = t
    return list(largest.values())


def buffer_bytes(specs: list[FunctionSpec], host_buffers) -> int:
    """Bytes of the host's buffers (``buffer_specs``)."""
    return sum(t.nbytes for t in buffer_specs(specs, host_buffers))


def size_lines(parameters: int, backends: list[str], indent: str = "  ") -> list[str]:
    """A part's weights: its parameter count and the fp16 bytes each package stores (once, shared by its
    functions)."""
    return [f"{indent}parameters: {parameters:,}",
            f"{indent}packages: {', '.join(backends)}; about {size_text(2 * parameters)} of fp16 weights each"]


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


DTYPE_NAMES = {torch.float16: "float16", torch.float32: "float32"}


SHIP_DTYPE = torch.float16  # what the packages compute in (Apple's GPU and ANE)
TORCH_DTYPES = {"int32": torch.int32, "float16": torch.float16, "float32": torch.float32}
