"""The build cache's code fingerprint covers every project module a stage imports, not a hand-kept list (issue #22):
a change to the Hadamard rotation or to the Qwen3 layers a hybrid computes with gives a new package key."""

import pytest
import torch

from convert import cache
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3_5 import Qwen35Args
from convert.pipeline import packaging
from convert.weights.target import build_modules
from tests.helpers.qwen3_5_checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid") / "ckpt"
    write_checkpoint(directory)
    args = Qwen35Args.from_config(read_json(directory / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64)
    return build_modules(args, target, load_tensors(directory), torch.float16)


def changed(module: str, monkeypatch) -> None:
    """``module``'s source as the fingerprint reads it, with one function added."""
    original = cache.module_source

    def source(name: str) -> str:
        text = original(name)
        return text + "\n\ndef _added():\n    return 1\n" if name == module else text

    monkeypatch.setattr(cache, "module_source", source)


@pytest.mark.parametrize("module", ["convert.export.hadamard", "convert.models.qwen3.core", "convert.fp16",
                                    "quant.types"])
def test_a_change_in_an_imported_module_changes_the_package_key(hybrid, module, monkeypatch):
    assert module in cache.project_imports(packaging.CODE + ("convert.backends.coreai", "convert.models.qwen3_5"))
    before = packaging.package_key("coreai", hybrid, "t", "weights")
    changed(module, monkeypatch)
    assert packaging.package_key("coreai", hybrid, "t", "weights") != before


def test_a_module_the_stage_does_not_import_leaves_the_key(hybrid, monkeypatch):
    assert "convert.cli" not in cache.project_imports(packaging.CODE + ("convert.backends.coreai",
                                                                         "convert.models.qwen3_5"))
    before = packaging.package_key("coreai", hybrid, "t", "weights")
    changed("convert.cli", monkeypatch)
    assert packaging.package_key("coreai", hybrid, "t", "weights") == before


def test_imports_in_function_bodies_and_parent_packages_count():
    found = cache.project_imports(["convert.export.quantized"])
    assert "convert.export.hadamard" in found  # imported inside a function of convert.export.quantized
    assert {"convert", "quant"} <= set(found)  # the packages whose __init__ an import runs
    assert found == sorted(found)
