import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3"
    write_checkpoint(directory)
    return directory
