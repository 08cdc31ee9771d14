"""Bad hybrid checkpoints: each is refused before any weight is read, exit 2, one line naming the field or tensor,
and no bundle."""

from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from test_inputs import GOOD as RECIPE
from test_inputs import assert_refused

from convert.cli import main
from tests.helpers.qwen3_5_checkpoints import rewrite_config, write_checkpoint

QKV = "model.layers.0.linear_attn.in_proj_qkv.weight"


def _retensor(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _unknown_layer_type(d: Path):
    rewrite_config(d, lambda c: c["layer_types"].__setitem__(1, "sliding_attention"))


def _wrong_gdn_shape(d: Path):
    _retensor(d, lambda t: t.__setitem__(QKV, t[QKV][:-4]))


def _value_heads(d: Path):
    rewrite_config(d, lambda c: c.__setitem__("linear_num_value_heads", 5))


def _fused(d: Path):
    def fuse(t):
        t["model.layers.0.linear_attn.in_proj_qkvz.weight"] = t.pop(QKV)

    _retensor(d, fuse)


def _qwen3_next(d: Path):
    rewrite_config(d, lambda c: c.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]))


def _missing_tensor(d: Path):
    _retensor(d, lambda t: t.pop("model.layers.2.linear_attn.A_log"))


@pytest.mark.parametrize(
    "breaks, needles",
    [
        (_unknown_layer_type, ["config.json", "layer_types[1] is 'sliding_attention'"]),
        (_wrong_gdn_shape, [f"tensor {QKV!r} has shape [132, 64], expected [136, 64]"]),
        (_value_heads, ["linear_num_value_heads 5 is not a multiple of linear_num_key_heads 2"]),
        (_fused, ["in_proj_qkvz", "Qwen3-Next's fused in_proj_qkvz / in_proj_ba layout is not supported"]),
        (_qwen3_next, ["model_type 'qwen3_next'", "Qwen3-Next"]),
        (_missing_tensor, ["tensor 'model.layers.2.linear_attn.A_log' is missing"]),
    ],
    ids=["unknown-layer-type", "gdn-shape", "value-heads", "fused-qwen3-next", "qwen3-next-config", "missing"],
)
def test_bad_hybrid_checkpoint(tmp_path, monkeypatch, breaks, needles):
    write_checkpoint(tmp_path / "ckpt")
    breaks(tmp_path / "ckpt")
    (tmp_path / "r.yaml").write_text(RECIPE)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["build", "r.yaml"])
    assert_refused(result, *needles)
    assert not (tmp_path / "out").exists()


def test_a_vision_language_checkpoint_plans_without_its_vision_tower(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "ckpt", conditional=True)
    (tmp_path / "r.yaml").write_text(RECIPE)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["build", "r.yaml", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "vision tower (model.visual.*):" in result.output and "not shipped with the target" in result.output
    assert "(3 Gated DeltaNet L, 1 gated attention F)" in result.output
