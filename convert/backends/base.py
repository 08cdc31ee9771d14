"""The one small interface every package backend (Core AI, Core ML) implements (``PackageBackend``; a backend
is a module of these, ``convert.backends.load``; ``tests/test_contracts.py`` checks each).

The pipeline hands a backend the same torch export modules for every format: one module per
function (prefill, decode, verify ...), all sharing the same parameter tensors, each with a static
shape. A module's ``forward(*inputs)`` takes the inputs in ``FunctionSpec.inputs`` order and returns
a tuple in ``FunctionSpec.outputs`` order; every state in ``FunctionSpec.states`` is a registered
buffer of the module under exactly that name, mutated in place by ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass
class CompileRecord:
    """What a compile step did: ``done`` with its outputs, or ``deferred`` with the reason."""

    kind: str  # e.g. "odix", "device-aot", "coremlcompiler"
    status: str  # "done" | "deferred" | "failed"
    reason: str = ""
    outputs: list[str] = field(default_factory=list)  # paths relative to the bundle


def package_path(bundle_dir: Path, stem: str, suffix: str) -> Path:
    return bundle_dir / f"{stem}{suffix}"


@runtime_checkable
class PackageBackend(Protocol):
    """A package format (its name and file suffix: ``convert.backends.SUFFIXES``). ``RUNS_HERE``: its runtime runs on
    this machine (Core AI's Linux reference), so the package check runs the package (``open_session``); otherwise it
    reads the package's constants back (``contents``)."""

    RUNS_HERE: bool

    def package(self, functions: dict, path: Path) -> None:
        """Write the package of the export modules' functions (name -> (module, spec)) at ``path``."""

    def read_back(self, path: Path) -> dict:
        """The functions' specs as the package declares them."""

    def compressed_weights(self, path: Path) -> dict:
        """Every stored weight a function holds (``convert.backends.stored.ShippedWeight``)."""

    def stored_weight_bytes(self, path: Path) -> int:
        """The bytes its weights take on disk."""

    def operation_types(self, path: Path) -> dict[str, set[str]]:
        """Each function's op types (the placement lint)."""

    def stable_hash(self, path: Path) -> str:
        """The identity of its bytes, what varies run to run left out."""

    def compile(self, path: Path, out_dir: Path) -> list[CompileRecord]:
        """The device compile, done or ``deferred`` (off a Mac)."""
