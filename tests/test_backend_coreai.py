"""Core AI backend on the toy: weight sharing, runtime parity with state carried, read-back, rebuilds, compile."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from convert.backends import coreai
from convert.errors import PackageError
from convert.export.spec import TensorSpec
from tests.helpers.toymodel import HIDDEN, toy_functions

REPO = Path(__file__).resolve().parents[1]
# Measured (see convert/backends/coreai.py): fp32 2.9e-6 on logits up to ~11, fp16 0.039 (~5 ulps).
FP32_LOGITS_BOUND = 1e-5
FP16_LOGITS_BOUND = 0.08
BUILD_IN_SUBPROCESS = (
    "import sys; from pathlib import Path; from convert.backends import coreai; "
    "from tests.helpers.toymodel import toy_functions; coreai.package(toy_functions(), Path(sys.argv[1]))"
)


@pytest.fixture(scope="module")
def fp32_package(tmp_path_factory):
    functions = toy_functions()
    path = tmp_path_factory.mktemp("fp32") / "toy.aimodel"
    coreai.package(functions, path)
    return functions, path


def call_both(session, functions, name, ids, positions):
    """One call on the runtime and on the torch module; returns (max |delta logits|, argmax ids equal)."""
    inputs = {
        "input_ids": np.asarray(ids, dtype=np.int32)[None],
        "position_ids": np.asarray(positions, dtype=np.int32)[None],
    }
    got = session.call(name, inputs)
    with torch.no_grad():
        argmax_ids, logits = functions[name][0](*(torch.from_numpy(v) for v in inputs.values()))
    delta = np.abs(got["logits"].astype(np.float64) - logits.double().numpy()).max()
    return float(delta), np.array_equal(got["argmax_ids"], argmax_ids.numpy())


def prefill_decode_verify_rollback(session, functions):
    """Prefill 8 tokens, decode 3, verify 4 drafts at 11..14, then roll back and verify at 9..12."""
    results = [call_both(session, functions, "prefill", [3, 10, 17, 24, 31, 38, 45, 52], range(8))]
    for position in (8, 9, 10):
        results.append(call_both(session, functions, "decode", [position * 5 % 64], [position]))
    results.append(call_both(session, functions, "verify", [7, 5, 9, 17], range(11, 15)))
    results.append(call_both(session, functions, "verify", [1, 2, 3, 4], range(9, 13)))
    return results


def test_runtime_matches_torch_with_states_carried(fp32_package):
    functions, path = fp32_package
    with coreai.open_session(path) as session:
        results = prefill_decode_verify_rollback(session, functions)
        states = session.states()
    assert [same for _, same in results] == [True] * 6
    assert max(delta for delta, _ in results) < FP32_LOGITS_BOUND
    decode_module = functions["decode"][0]
    for name, state in states.items():
        assert np.abs(state - getattr(decode_module, name).numpy()).max() < FP32_LOGITS_BOUND
    assert np.abs(states["key_cache"][:, :, 15:]).max() == 0  # never written: started as zeros


def test_fp16_prefill_and_decode_match_torch(tmp_path):
    functions = toy_functions(torch.float16, widths={"prefill": 8, "decode": 1})
    coreai.package(functions, tmp_path / "fp16.aimodel")
    with coreai.open_session(tmp_path / "fp16.aimodel") as session:
        results = [
            call_both(session, functions, "prefill", [3, 10, 17, 24, 31, 38, 45, 52], range(8)),
            call_both(session, functions, "decode", [40], [8]),
        ]
    assert [same for _, same in results] == [True, True]
    assert max(delta for delta, _ in results) < FP16_LOGITS_BOUND


def test_shared_weights_stored_once_and_live_kv_untouched(tmp_path):
    functions = toy_functions()
    module, spec = functions["prefill"]
    module.core.embed = nn.Parameter(torch.randn(4096, HIDDEN))  # 512 KiB: the weights dominate the program
    module.key_cache.fill_(3.0)
    live_cache = module.key_cache
    coreai.package(functions, tmp_path / "wide.aimodel")
    one_function_weights = sum(p.nbytes for p in module.parameters())
    assert (tmp_path / "wide.aimodel" / "main.mlirb").stat().st_size < 1.2 * one_function_weights
    assert functions["decode"][0].key_cache is live_cache
    assert bool((live_cache == 3.0).all())


def test_read_back_matches_specs(fp32_package):
    functions, path = fp32_package
    assert coreai.read_back(path) == {name: spec for name, (_, spec) in functions.items()}


def test_rebuild_in_another_process_is_byte_identical(fp32_package, tmp_path):
    _, path = fp32_package
    rebuilt = tmp_path / "toy.aimodel"
    subprocess.run([sys.executable, "-c", BUILD_IN_SUBPROCESS, str(rebuilt)], cwd=REPO, check=True, capture_output=True)
    files = sorted(p.name for p in path.iterdir())
    assert files == ["main.hash", "main.mlirb", "metadata.json"]
    for name in files:
        assert (rebuilt / name).read_bytes() == (path / name).read_bytes(), name
    assert coreai.stable_hash(rebuilt) == coreai.stable_hash(path)
    assert '"creationDate" : "19700101T000000Z"' in (path / "metadata.json").read_text()


def test_compile_writes_odix(fp32_package, tmp_path):
    _, path = fp32_package
    odix = coreai.compile(path, tmp_path)[0]
    assert (odix.kind, odix.status) == ("odix", "done")
    assert "toy.aimodelx/main-universal.odix" in odix.outputs
    assert all((tmp_path / output).stat().st_size > 0 for output in odix.outputs)


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac may have coreai-build and compile for real")
def test_compile_defers_device_aot_off_macos(fp32_package, tmp_path):
    _, path = fp32_package
    device = coreai.compile(path, tmp_path)[1:]
    assert [(r.kind, r.status) for r in device] == [("device-aot-ios", "deferred"), ("device-aot-macos", "deferred")]
    assert all("needs macOS with Xcode's coreai-build" in r.reason and not r.outputs for r in device)


def test_session_rejects_wrong_inputs_and_reset_zeroes_states(fp32_package):
    _, path = fp32_package
    with coreai.open_session(path) as session:
        good = {"input_ids": np.zeros((1, 1), np.int32), "position_ids": np.full((1, 1), 5, np.int32)}
        session.call("decode", good)
        assert np.abs(session.states()["key_cache"][:, :, 5]).max() > 0
        session.reset()
        assert all(not state.any() for state in session.states().values())
        with pytest.raises(PackageError, match="decode input 'position_ids' must be int32"):
            session.call("decode", {**good, "position_ids": np.zeros((1, 1), np.int64)})
        with pytest.raises(PackageError, match="no function 'draft'"):
            session.call("draft", good)


def test_package_rejects_a_state_the_module_lacks(tmp_path):
    functions = toy_functions(widths={"decode": 1})
    module, spec = functions["decode"]
    spec = replace(spec, states=(*spec.states, TensorSpec("conv_state", (1, 4), "float32")))
    with pytest.raises(PackageError, match="needs a float32 buffer named 'conv_state'"):
        coreai.package({"decode": (module, spec)}, tmp_path / "bad.aimodel")
