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


@dataclass
class CompileRecord:
    """What a compile step did: ``done`` with its outputs, or ``deferred`` with the reason."""

    kind: str  # e.g. "odix", "device-aot", "coremlcompiler"
    status: str  # "done" | "deferred" | "failed"
    reason: str = ""
    outputs: list[str] = field(default_factory=list)  # paths relative to the bundle


def package_path(bundle_dir: Path, stem: str, suffix: str) -> Path:
    return bundle_dir / f"{stem}{suffix}"
