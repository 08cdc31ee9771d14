"""Where spec-convert keeps its files between commands: the build cache's default folder (no heavy import here: the CLI
reads it before any command runs)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPEC_CONVERT_CACHE"


def default_cache() -> Path:
    """``$SPEC_CONVERT_CACHE``, else ``$XDG_CACHE_HOME/spec-convert``, else ``~/.cache/spec-convert``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "spec-convert"
