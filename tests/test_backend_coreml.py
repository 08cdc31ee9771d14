"""Core ML backend on the toy: read-back, weight sharing, determinism, shipped constants, compile deferral.

The toy's own KV write (``key_cache[layer].index_copy_(1, pos, k)``) does not convert with coremltools 9,
so these tests use ``ScatterToyCore``: the same toy with the write as an ``index_put_`` that has an index
tensor for every cache dim, which converts here and also exports with torch.export (tested below).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
import torch

from convert.backends import coreml
from convert.errors import PackageError
from tests.helpers.toymodel import scatter_toy_functions, toy_functions

REPO = Path(__file__).resolve().parents[1]
MODEL_FILE = Path("Data/com.apple.CoreML/model.mlmodel")
WEIGHT_FILE = Path("Data/com.apple.CoreML/weights/weight.bin")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One package of the fp16 toy, built with non-zero live states that must come out untouched."""
    functions = scatter_toy_functions()
    module, spec = functions["prefill"]
    generator = torch.Generator().manual_seed(1)
    for state in spec.states:
        getattr(module, state.name).copy_(torch.randn(state.shape, generator=generator))
    live_before = {s.name: getattr(module, s.name).clone() for s in spec.states}
    path = tmp_path_factory.mktemp("coreml") / "toy.mlpackage"
    coreml.package(functions, path)
    return path, functions, live_before


def test_read_back_matches_the_specs(built):
    path, functions, _ = built
    assert coreml.read_back(path) == {name: spec for name, (_, spec) in functions.items()}
    assert list(coreml.read_back(path)) == ["prefill", "decode", "verify"]


def test_package_loads_without_the_runtime(built):
    path, _, _ = built
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    assert spec.description.defaultFunctionName == "prefill"
    assert [f.name for f in spec.description.functions] == ["prefill", "decode", "verify"]
    assert [s.name for s in spec.description.functions[1].state] == ["key_cache", "value_cache"]


def test_manifest_ids_are_derived_and_consistent(built):
    path, _, _ = built
    manifest = json.loads((path / "Manifest.json").read_text())
    entries = manifest["itemInfoEntries"]
    model_item, weights_item = "com.apple.CoreML/model.mlmodel", "com.apple.CoreML/weights"
    assert sorted(item["path"] for item in entries.values()) == [model_item, weights_item]
    assert entries[manifest["rootModelIdentifier"]]["path"] == model_item
    assert all(str(uuid.UUID(item_id)) == item_id for item_id in entries)


def test_packaging_leaves_live_states_and_weights_alone(built):
    _, functions, live_before = built
    module, spec = functions["prefill"]
    for state in spec.states:
        assert torch.equal(getattr(module, state.name), live_before[state.name])
    assert {p.dtype for p in module.parameters()} == {torch.float16}


def test_weights_are_stored_once(built, tmp_path):
    path, functions, _ = built
    single = tmp_path / "decode.mlpackage"
    coreml.package({"decode": functions["decode"]}, single)
    single_size = (single / WEIGHT_FILE).stat().st_size
    merged_size = (path / WEIGHT_FILE).stat().st_size
    parameter_bytes = sum(p.numel() * 2 for p in functions["decode"][0].parameters())
    assert parameter_bytes > 0.8 * single_size  # the weights dominate weight.bin, so the bound means something
    assert merged_size < 1.2 * single_size


def test_two_builds_in_two_processes_are_byte_identical(built, tmp_path):
    path, _, _ = built
    again = tmp_path / "again.mlpackage"
    script = (
        "import sys; from pathlib import Path; "
        "from tests.helpers.toymodel import scatter_toy_functions; from convert.backends import coreml; "
        "coreml.package(scatter_toy_functions(), Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "123"}
    subprocess.run([sys.executable, "-c", script, str(again)], check=True, env=env, cwd=REPO, capture_output=True)
    for name in (MODEL_FILE, WEIGHT_FILE, Path("Manifest.json")):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name
    assert coreml.stable_hash(again) == coreml.stable_hash(path)
    assert len(coreml.stable_hash(path)) == 64


def test_shipped_constants_equal_the_fp16_weights_bit_for_bit(built):
    path, functions, _ = built
    constants = coreml.function_constants(path, "decode")
    weights = [p.detach().to(torch.float16).numpy() for p in functions["decode"][0].parameters()]
    for shape in {w.shape for w in weights}:  # (32, 32) projections, (64, 32) embedding and head
        shipped = [c for c in constants.values() if c.shape == shape]
        assert all(c.dtype == np.float16 for c in shipped)
        assert sorted(c.tobytes() for c in shipped) == sorted(w.tobytes() for w in weights if w.shape == shape)


def test_compile_is_deferred_off_macos(built, tmp_path):
    if platform.system() == "Darwin":
        pytest.skip("coremlcompiler may be present on macOS")
    (record,) = coreml.compile(built[0], tmp_path)
    assert (record.kind, record.status, record.outputs) == ("coremlcompiler", "deferred", [])
    assert "macOS" in record.reason


def test_scatter_write_matches_the_toys_index_copy_in_torch():
    ids = torch.tensor([[5, 9, 1, 7, 3, 3, 60, 2]], dtype=torch.int32)
    outputs = []
    for functions in (toy_functions(torch.float32), scatter_toy_functions(torch.float32)):
        prefill, decode = functions["prefill"][0], functions["decode"][0]
        first = prefill(ids, torch.arange(8, dtype=torch.int32)[None])
        second = decode(ids[:, :1], torch.tensor([[8]], dtype=torch.int32))
        outputs.append([*first, *second, prefill.key_cache.clone(), prefill.value_cache.clone()])
    for plain, scatter in zip(*outputs, strict=True):
        assert torch.equal(plain, scatter)


def test_scatter_write_exports_with_torch_export_as_a_state_mutation():
    """The Core AI path (torch.export + coreai-torch's decompositions) sees both caches as mutated states."""
    coreai_torch = pytest.importorskip("coreai_torch")
    module, _ = scatter_toy_functions(torch.float32)["decode"]
    example = (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))
    program = torch.export.export(module, example).run_decompositions(coreai_torch.get_decomp_table())
    assert sorted(program.graph_signature.buffers_to_mutate.values()) == ["key_cache", "value_cache"]
    targets = {str(node.target) for node in program.graph.nodes}
    assert "aten.index_put.default" in targets and not any("index_copy" in t for t in targets)


def test_the_toys_index_copy_write_is_refused_with_the_function_named(tmp_path):
    with pytest.raises(PackageError, match="'decode'.*index_copy"):
        coreml.package({"decode": toy_functions(torch.float16)["decode"]}, tmp_path / "toy.mlpackage")


def test_fp32_states_are_refused_before_converting(tmp_path):
    with pytest.raises(PackageError, match="state 'key_cache' is float32.*float16 only"):
        coreml.package(scatter_toy_functions(torch.float32), tmp_path / "toy.mlpackage")


def test_packaging_leaves_no_temporary_files(tmp_path, monkeypatch):
    """coremltools keeps each converted function's temporary ``.mlpackage`` until the interpreter exits (an ``atexit``
    cleanup, which a worker process ending with ``os._exit`` never runs): packaging removes them as it goes."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    coreml.package(scatter_toy_functions(), tmp_path / "toy.mlpackage")
    assert sorted(p.name for p in private.iterdir()) == []
