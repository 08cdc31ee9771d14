"""The one small interface every package backend (Core AI, Core ML) implements.

The pipeline hands a backend the same torch export modules for every format: one module per
function (prefill, decode, verify ...), all sharing the same parameter tensors, each with a static
shape. A module's ``forward(*inputs)`` takes the inputs in ``FunctionSpec.inputs`` order and returns
a tuple in ``FunctionSpec.outputs`` order; every state in ``FunctionSpec.states`` is a registered
buffer of the module under exactly that name, mutated in place by ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("int32", "float16", "float32")
DTYPE_BYTES = {"int32": 4, "float16": 2, "float32": 4}


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
        takes (every function has one of them)."""
        by_name = {t.name: t for t in self.inputs}
        return next(by_name[n].shape[1] for n in ("position_ids", "input_ids", "hidden_states") if n in by_name)


def function_lines(specs: list[FunctionSpec]) -> list[str]:
    """A plan's lines for one part: each function's inputs and outputs, then the states they share."""

    def tensors(ts: tuple[TensorSpec, ...]) -> str:
        return ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in ts)

    lines = []
    for spec in specs:
        lines += [f"    {spec.name}", f"      inputs:  {tensors(spec.inputs)}",
                  f"      outputs: {tensors(spec.outputs)}"]
    lines.append("    states (all functions):")
    lines += [f"      {t.name} {list(t.shape)} {t.dtype}: {size_text(t.nbytes)}" for t in specs[0].states]
    return lines


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


@dataclass
class CompileRecord:
    """What a compile step did: ``done`` with its outputs, or ``deferred`` with the reason."""

    kind: str  # e.g. "odix", "device-aot", "coremlcompiler"
    status: str  # "done" | "deferred" | "failed"
    reason: str = ""
    outputs: list[str] = field(default_factory=list)  # paths relative to the bundle


class PackageError(RuntimeError):
    """A package could not be written or failed its read-back check; the message names what."""


def package_path(bundle_dir: Path, stem: str, suffix: str) -> Path:
    return bundle_dir / f"{stem}{suffix}"
