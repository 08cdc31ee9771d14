"""Package backends by recipe name. Each module implements the interface in base.py:
``package``, ``read_back``, ``stable_hash``, ``compile`` (and, where the runtime exists here, a session)."""

from __future__ import annotations

import importlib
from types import ModuleType

SUFFIXES = {"coreai": ".aimodel", "coreml": ".mlpackage"}


def load(name: str) -> ModuleType:
    """Import a backend on first use (coremltools alone takes seconds to import)."""
    return importlib.import_module(f"convert.backends.{name}")
