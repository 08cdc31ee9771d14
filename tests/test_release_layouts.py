"""The release recipes' machinery on tiny checkpoints in exactly the published layouts, so that a layout mistake
shows here and not on the 54 GB download.

Each release recipe is read as shipped; only its sources (to local checkpoints) and its width fields (the contract
values in ``SCALED`` and the recipe's context) change. The layer count and pattern, the taps, block, conv, top-k,
sliding windows, ring and graph widths stay as published. The target is written by transformers'
``Qwen3_5ForConditionalGeneration`` (keys ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``) with a
Qwen3.5 MTP head (``mtp.*``, gated attention, zero-centred norms) in a second shard of the same snapshot; the
DFlash2 drafter in z-lab's layout with its codebooks in ``selector.safetensors``. Then: the contracts are checked
and every function planned (``build --dry-run``), the keys are mapped (the export modules built from the files by
the build's own plan), and the functions run: the target's logits equal transformers' forward of the same files,
the drafter drafts from the target's taps, the MTP head from its hidden states.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from convert.cli import main
from convert.inputs.sources import load_tensors
from convert.models.dflash2.driver import DFlash2Driver
from convert.models.mtp.driver import MTPDriver
from convert.pipeline.drafter import build_modules as build_drafter_modules
from convert.pipeline.plan import make_plan
from convert.runtime.host import ModuleFunctions, module_driver
from convert.weights.target import build_modules
from tests.helpers.dflash2_checkpoints import tiny_config, write_drafter
from tests.helpers.mtp_checkpoints import head_tensors, write_index
from tests.helpers.qwen3_5_checkpoints import write_checkpoint

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
VOCAB, MASK_ID = 4096, 4086  # the mask row near the end of the vocabulary, as 248070 of 248320
SCALED = {  # contract field -> tiny value; every other contract field stays as published
    "text_config.hidden_size": 64, "text_config.intermediate_size": 96, "text_config.head_dim": 8,
    "text_config.linear_key_head_dim": 8, "text_config.linear_value_head_dim": 8, "text_config.vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "head_dim": 8, "vocab_size": VOCAB,
    "dflash_config.mask_token_id": MASK_ID, "dflash_config.selector_rank": 16,
}
CONTEXT = 512


def scaled(contract: dict) -> dict:
    return {key: SCALED.get(key, value) for key, value in contract.items()}


def write_target(directory: Path, contract: dict) -> torch.nn.Module:
    """The published target layout at the scaled widths: the text config from the contract, a vision tower, and
    the MTP head in a second shard listed by the index."""
    text = {key.removeprefix("text_config."): value for key, value in scaled(contract).items()
            if key.startswith("text_config.") and "." not in key.removeprefix("text_config.")}
    rope = {"rope_type": "default", "rope_theta": contract["text_config.rope_parameters.rope_theta"],
            "partial_rotary_factor": contract["text_config.rope_parameters.partial_rotary_factor"]}
    for key in ("model_type", "mtp_num_hidden_layers"):
        text.pop(key)
    model = write_checkpoint(directory, conditional=True, rope_parameters=rope, **text)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    head = head_tensors(config["text_config"], "qwen3.5", zero_centred=True, gated=True)
    single = directory / "model.safetensors"
    tensors = load_file(str(single))
    single.unlink()
    write_index(directory, {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": head})
    return model


def write_dflash2(directory: Path, contract: dict) -> None:
    pinned = scaled(contract)
    draft = {key.removeprefix("dflash_config."): value for key, value in pinned.items()
             if key.startswith("dflash_config.")}
    config = tiny_config(
        layers=pinned["num_hidden_layers"], window=pinned["sliding_window"], hidden_size=pinned["hidden_size"],
        intermediate_size=pinned["intermediate_size"], num_attention_heads=pinned["num_attention_heads"],
        num_key_value_heads=pinned["num_key_value_heads"], head_dim=pinned["head_dim"], vocab_size=VOCAB,
        num_target_layers=64, dflash_config=draft, architectures=pinned["architectures"],
        rope_parameters={"rope_type": "default", "rope_theta": pinned["rope_parameters.rope_theta"]})
    write_drafter(directory, "plain", config=config)


@pytest.fixture(scope="module", params=["dflash2_27b.yaml", "qwen3_mtp_27b.yaml"])
def release(request, tmp_path_factory):
    """(the scaled recipe's path, the transformers model of the written target) for one release recipe."""
    tmp = tmp_path_factory.mktemp("release")
    recipe = yaml.safe_load((RECIPES / request.param).read_text())
    target, drafter = recipe["target"], recipe["drafter"]
    assert set(SCALED) & (set(target["contract"]) | set(drafter.get("contract", {}))), "SCALED names no field"
    model = write_target(tmp / "target", target["contract"])
    target.update(source=f"path:{tmp / 'target'}", contract=scaled(target["contract"]), context=CONTEXT)
    if "ladder" in target:  # the release ladder's entries lie below its context: scaled with it
        target["ladder"] = [CONTEXT // 4, CONTEXT // 2]
    drafter["contract"] = scaled(drafter.get("contract", {}))
    if drafter["kind"] == "dflash2":
        write_dflash2(tmp / "drafter", drafter["contract"])
        drafter["source"] = f"path:{tmp / 'drafter'}"
    else:
        assert "source" not in drafter  # the head comes from the target's own snapshot
    path = tmp / request.param
    path.write_text(yaml.safe_dump({**recipe, "output": str(tmp / "bundle")}, sort_keys=False))
    return path, model


def test_the_contracts_hold_and_every_function_is_planned(release):
    path, _ = release
    result = CliRunner().invoke(main, ["build", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "(48 Gated DeltaNet L, 16 gated attention F)" in out
    assert "vision tower (model.visual.*)" in out and "MTP head (mtp.*): 15 tensors" in out
    for function in ("prefill", "decode", "verify"):
        assert f"\n    {function}\n" in out
    if "dflash2" in path.name:
        assert "taps [5, 19, 33, 47, 61] (output of layer i, 0-based), block 8, mask id 4086 x 0.7" in out
        assert "logits [1, 7, 4096] float16, selector_projected [1, 7, 16] float16" in out  # the host walks
        assert "ring_keys [5, 8, 2048, 8] float16" in out
    else:
        assert "drafter mtp" in out and "logits [1, 3, 4096] float16, hidden_out [1, 3, 64] float16" in out


def test_a_changed_published_field_is_refused(release, tmp_path):
    path, _ = release
    text = path.read_text().replace("linear_conv_kernel_dim: 4", "linear_conv_kernel_dim: 3")
    (tmp_path / path.name).write_text(text)
    result = CliRunner().invoke(main, ["build", str(tmp_path / path.name), "--dry-run"])
    assert result.exit_code == 2
    assert "target.contract.text_config.linear_conv_kernel_dim: the recipe pins 3; config.json has 4" in result.output


def test_the_keys_map_and_the_functions_run(release):
    path, model = release
    plan = make_plan(path)
    target = build_modules(plan.args, plan.recipe.target, load_tensors(plan.snapshot.directory), torch.float32,
                           plan.layout)
    prompt = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():  # 64 random layers amplify fp32 rounding (measured: 1e-5 after 6 layers, 0.1 after 62)
        exact_model = copy.deepcopy(model).double()
        exact = exact_model(torch.tensor([prompt])).logits[0, -1]
        fp32_error = float((model(torch.tensor([prompt])).logits[0, -1].double() - exact).abs().max())
    driver = module_driver(target)
    out = driver.prefill(prompt)
    ours = torch.from_numpy(out["logits"][-1]).double()
    # as close to the exact forward as transformers' own fp32 forward is (a mis-mapped tensor is off by O(1)); the
    # ane layout's sums run in another order (channels first, peak-scaled norms): measured 2.4x transformers' error
    # after the 64 random layers, where the stateful layout stays within 2x
    factor = 3 if plan.recipe.target.layout == "ane" else 2
    assert float((ours - exact).abs().max()) < factor * fp32_error + 1e-5
    bonus = int(exact.argmax())
    drafter = build_drafter_modules(plan.drafter, plan.recipe, target, torch.float32)
    functions = ModuleFunctions(drafter)
    if plan.drafter.kind == "dflash2":
        d = DFlash2Driver(functions, drafter.widths, target.core.embed_tokens.weight.detach().numpy())
        d.add_context(out["taps"], 0, "context_update")
        assert out["taps"].shape[-1] == 5 * 64  # the five published taps
        proposal = d.draft(bonus, len(prompt))
        assert len(proposal) == 7 and all(0 <= t < VOCAB for t in proposal)
        codebooks = load_file(str(plan.drafter.snapshot.directory / "selector.safetensors"))
        loaded = dict(drafter.core.named_parameters())
        assert len(codebooks) == 2 and all(torch.equal(loaded[name], v) for name, v in codebooks.items())
    else:
        d = MTPDriver(functions, drafter.widths)
        draft, hidden = d.accept(prompt[1:] + [bonus], out["hidden"], 1)
        assert 0 <= draft < VOCAB and hidden.shape == (64,)
        written = load_file(str(plan.snapshot.directory / "model-00002-of-00002.safetensors"))
        assert torch.equal(dict(drafter.core.named_parameters())["fc.weight"], written["mtp.fc.weight"])
    width = plan.recipe.target.graphs.verify
    verified = driver.run("verify", [bonus] + prompt[: width - 1], len(prompt))
    with torch.no_grad():
        exact = exact_model(torch.tensor([prompt + [bonus]])).logits[0, -1]
        fp32_error = float((model(torch.tensor([prompt + [bonus]])).logits[0, -1].double() - exact).abs().max())
    assert verified["argmax_ids"].shape == (width,)
    assert float((torch.from_numpy(verified["logits"][0]).double() - exact).abs().max()) < factor * fp32_error + 1e-5
