import os
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import write_checkpoint


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs a worker per core) each worker computes with one torch thread: two
    workers of two threads each on two cores spin-wait for each other (see ``one_torch_thread``)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


# The modules that take longest on the 2-core machine, longest first (their tests' seconds summed from a `make test`
# run with --durations, 2026-12-07). `make test` hands modules to its workers in collection order
# (``--no-loadscope-reorder``; pytest-xdist's default orders them by their count of tests): started first, a long
# module does not leave one worker running alone at the end.
LONGEST_FIRST = ("test_build.py", "test_exact_build.py", "test_drafter_calibration.py",
                 "test_progress.py", "test_device_gate.py", "test_rescaled_pair.py", "test_fp16.py",
                 "test_verify_bundle.py", "test_ane_drafters.py")


def pytest_collection_modifyitems(items):
    """The ``LONGEST_FIRST`` modules' tests first, in that order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3"
    write_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small torch ops (hidden 256, at most 64 tokens): one thread is as fast, and on this 2-core
    machine shared with other jobs two threads spin-wait for each other (a 64-token prefill went 25x slower,
    test_calibrate from 8 s to over 40 s; measured). Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def build_cache_in_tmp(tmp_path_factory):
    """Builds under test cache their stages in a directory of this session, never in the user's cache."""
    previous = os.environ.get("SPEC_CONVERT_CACHE")
    os.environ["SPEC_CONVERT_CACHE"] = str(tmp_path_factory.mktemp("build-cache"))
    yield
    if previous is None:
        os.environ.pop("SPEC_CONVERT_CACHE", None)
    else:
        os.environ["SPEC_CONVERT_CACHE"] = previous
