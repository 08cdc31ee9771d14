"""The families' and backends' contracts as code (``convert/models/contracts.py``, ``convert/backends/base.py``; issue
#42): every registered target family, drafter family and package backend has every hook, and a seeded tiny checkpoint of
each goes through them: its config picks the family, ``sanitize`` takes it and refuses it with a tensor removed (naming
the tensor), the specs plan, and its torch modules run the functions (a target's prefill, decode and verify against
transformers' greedy decoding; a drafter's speculative decoding against its target's plain greedy, lossless)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from convert import backends
from convert.backends import SUFFIXES
from convert.backends.base import PackageBackend
from convert.errors import InputError
from convert.inputs.checkpoint import checkpoint_shapes
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.inputs.thresholds import NEAR_TIE_LOGITS
from convert.models import DRAFTERS, FAMILIES, drafter_family, family, family_for
from convert.models.contracts import DrafterFamily, TargetFamily
from convert.pipeline import drafter
from convert.pipeline.plan import make_plan
from convert.runtime import speculative
from convert.runtime.host import module_driver
from convert.weights.target import build_modules
from tests.helpers import recipes
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.dflash2_checkpoints import tiny_config as drafter_config
from tests.helpers.dflash2_checkpoints import write_drafter
from tests.helpers.mtp_checkpoints import write_target_with_head
from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid
from tests.helpers.recipes import gate, tiny_target
from tests.helpers.toymodel import scatter_toy_functions

TARGET_WRITERS = {"qwen3": lambda d: write_checkpoint(d, hidden_size=64, num_hidden_layers=2),
                  "qwen3_5": lambda d: write_hybrid(d)}
PROMPT = [5, 17, 42, 9, 101, 7, 33, 250, 12, 64, 3]


def test_every_family_is_written_here():
    assert set(TARGET_WRITERS) == set(FAMILIES)
    assert set(DRAFTER_SETUPS) == set(DRAFTERS)


def without(directory: Path, out: Path, key: str) -> Path:
    """A copy of the checkpoint at ``directory`` without tensor ``key``."""
    shutil.copytree(directory, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        if key in tensors:
            del tensors[key]
            save_file(tensors, str(path), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_a_target_family_keeps_its_contract(tmp_path, name):
    module = family(name)
    assert isinstance(module, TargetFamily)
    TARGET_WRITERS[name](tmp_path / "ckpt")
    config = read_json(tmp_path / "ckpt" / "config.json")
    assert family_for(config) is module
    args = module.Args.from_config(config)
    shapes = checkpoint_shapes(tmp_path / "ckpt")
    module.sanitize(shapes, args, "checkpoint")
    key = next(k for k in sorted(shapes) if ".layers.0." in k and k.endswith("down_proj.weight"))
    with pytest.raises(InputError, match=key.replace(".", r"\.")):
        module.sanitize(checkpoint_shapes(without(tmp_path / "ckpt", tmp_path / "cut", key)), args, "checkpoint")

    target = Target(source="path:x", graphs=Graphs(prefill=8, verify=4), context=64, logits=True)
    specs = {s.name: s for s in module.function_specs(args, target, torch.float16)}
    assert {"prefill", "decode", "verify"} <= set(specs)
    assert (specs["prefill"].width, specs["decode"].width, specs["verify"].width) == (8, 1, 4)
    driver = module_driver(build_modules(args, target, load_tensors(tmp_path / "ckpt"), torch.float32))
    ids, logits = driver.greedy(PROMPT, 6)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0, len(PROMPT):].tolist()
        reference = model(torch.tensor([PROMPT + ids[:-1]])).logits[0, len(PROMPT) - 1:]
    assert ids == want
    assert max(float((torch.from_numpy(a) - b).abs().max()) for a, b in zip(logits, reference, strict=True)) < 1e-3
    driver.reset()  # verify: the rows of a call of 4 equal the decode calls' logits
    driver.prefill(PROMPT)
    verified = driver.run("verify", ids[:4], len(PROMPT))
    assert [int(t) for t in verified["argmax_ids"]] == ids[1:5]
    assert float(abs(verified["logits"] - torch.stack(list(reference[1:5])).numpy()).max()) < 1e-3


def dflash2_pair(tmp: Path) -> tuple[dict, dict]:
    """A seeded target and DFlash2 drafter: (the target's recipe fields beyond the pair's, the drafter's)."""
    write_checkpoint(tmp / "target", hidden_size=64, num_hidden_layers=4)
    draft = {"target_layer_ids": [0, 2, 3], "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2,
             "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    write_drafter(tmp / "drafter", config=drafter_config(vocab_size=4096, dflash_config=draft))
    return {"taps": [0, 2, 3]}, {"source": f"path:{tmp / 'drafter'}", "context_update": 16, "ring": 64}


def mtp_pair(tmp: Path) -> tuple[dict, dict]:
    """A seeded target with its MTP head (the head in the target's checkpoint)."""
    write_target_with_head(tmp / "target")
    return {"hidden": True}, {}


DRAFTER_SETUPS = {"dflash2": (dflash2_pair, "fc.weight"), "mtp": (mtp_pair, "mtp.fc.weight")}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_a_drafter_family_keeps_its_contract(tmp_path, kind):
    module = drafter_family(kind)
    assert isinstance(module, DrafterFamily) and module.KIND == kind
    setup, key = DRAFTER_SETUPS[kind]
    target_fields, drafter_fields = setup(tmp_path)
    target = tiny_target(tmp_path / "target", graphs={"prefill": 16, "decode": 1, "verify": 4}, logits=True,
                         gate=gate(1, 64), **target_fields)
    recipe = recipes.recipe(tmp_path, "pair", target=target, backends=["coreai"],
                            drafter={"kind": kind, **drafter_fields, "quantization": {"method": "none"}})
    plan = make_plan(recipe)
    dplan = plan.drafter
    assert dplan.family is module and [s.name for s in dplan.specs] == list(dplan.widths)
    directory = dplan.snapshot.directory
    cut = without(directory, tmp_path / "cut", key)
    with pytest.raises(InputError, match=key.removeprefix("mtp.").replace(".", r"\.")):
        module.check_checkpoint(dplan.args, cut, plan.recipe, recipe, cut / "config.json")
    assert set(module.own_shapes(dplan.args)) >= {key.removeprefix("mtp.")}

    target = build_modules(plan.args, plan.recipe.target, load_tensors(tmp_path / "target"), torch.float32)
    modules = drafter.build_modules(dplan, plan.recipe, target, torch.float32)
    target_driver, drafter_driver = drafter.drivers(kind, target, modules, drafter.anchor_table(target))
    run, spec_logits = speculative.speculate(target_driver, drafter_driver, PROMPT, 20)
    target_driver.reset()
    greedy, greedy_logits = target_driver.greedy(PROMPT, 20)
    speculative.check_lossless(run, greedy, spec_logits, greedy_logits, NEAR_TIE_LOGITS)
    assert run.divergence is None or run.divergence["kind"] == "near_tie"
    assert len(run.rounds) >= 5 and all(len(r.proposal) == 3 for r in run.rounds)


@pytest.mark.parametrize("name", list(SUFFIXES))
def test_a_package_backend_keeps_its_contract(tmp_path, name):
    """Every backend has the interface's hooks and the capability its check dispatches on (a runtime here: a session;
    else a read of the package's contents), and a package of the fp16 toy core reads back the functions' specs, its
    stable hash the same for the same modules packaged twice."""
    backend = backends.load(name)
    assert isinstance(backend, PackageBackend)
    assert hasattr(backend, "open_session") if backend.RUNS_HERE else hasattr(backend, "contents")
    functions = scatter_toy_functions()
    paths = [tmp_path / f"toy{i}{SUFFIXES[name]}" for i in range(2)]
    for path in paths:
        backend.package(functions, path)
    specs = backend.read_back(paths[0])
    assert {n: (s.inputs, s.outputs, s.states) for n, s in specs.items()} == {
        n: (s.inputs, s.outputs, s.states) for n, (_, s) in functions.items()}
    assert backend.stable_hash(paths[0]) == backend.stable_hash(paths[1])
    assert set(backend.operation_types(paths[0])) == set(functions)
    assert {r.status for r in backend.compile(paths[0], tmp_path / "compiled")} <= {"done", "deferred"}
