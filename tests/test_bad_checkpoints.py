"""Bad checkpoints and configs (issue #21): each mutation a tester found exits 2 with one line naming the file and
the tensor or field, no traceback, and no bundle.

Families: corrupt safetensors headers (the format's rules, as the safetensors library applies them, and keys that
appear twice); shard indexes (a weight_map of the wrong type, a shard outside the checkpoint); config.json fields of
the wrong type (a target's, a Qwen3.5 target's, a contract's, a drafter's)."""

import json
import os
import shutil
import struct
from contextlib import nullcontext
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from test_inputs import GOOD, assert_refused

from convert.cli import main
from convert.errors import InputError
from convert.inputs.sources import MAX_HEADER_BYTES, check_safetensors, weight_files
from convert.models.dflash2 import DFlash2Args
from convert.models.mtp import MTPArgs
from tests.helpers.dflash2_checkpoints import tiny_config as dflash2_config

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
NORM = "model.norm.weight"  # hidden 64, F32: 256 bytes
LN0, LN1 = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"


@pytest.fixture
def workdir(tmp_path, tiny_checkpoint, monkeypatch):
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(workdir: Path, recipe: str = GOOD, dry: bool = True):
    (workdir / "r.yaml").write_text(recipe)
    return CliRunner().invoke(main, ["build", "r.yaml", *(["--dry-run"] if dry else [])])


def refused(workdir: Path, *needles: str, dry: bool = True, recipe: str = GOOD) -> str:
    result = run(workdir, recipe, dry)
    assert_refused(result, *needles)
    assert not (workdir / "out").exists()
    return result.output


# ------------------------------------------------------------------------------------------- safetensors headers


def read_raw(path: Path) -> tuple[str, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n].decode(), raw[8 + n :]


def write_raw(path: Path, header: str, data: bytes) -> None:
    encoded = header.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(path: Path, edit, extra: bytes = b"") -> None:
    """Rewrite ``path``'s header as ``edit(header dict)`` leaves it (the data as it was, plus ``extra`` bytes)."""
    text, data = read_raw(path)
    header = json.loads(text)
    edit(header)
    write_raw(path, json.dumps(header), data + extra)


def _array(h):
    h.clear()


def _swap(h):
    begin, end = h[NORM]["data_offsets"]
    h[NORM]["data_offsets"] = [end, begin]


def _overlap(h):
    h[LN1]["data_offsets"] = list(h[LN0]["data_offsets"])  # same size: both read the same bytes


HEADER_CASES = {
    "json-array": (None, ["model.safetensors", "a JSON list, not an object"]),
    "no-data-offsets": (lambda h: h[NORM].pop("data_offsets"), [f"tensor '{NORM}'", "exactly dtype, shape"]),
    "no-dtype": (lambda h: h[NORM].pop("dtype"), [f"tensor '{NORM}'", "exactly dtype, shape and data_offsets"]),
    "unknown-dtype": (lambda h: h[NORM].update(dtype="F17"), [f"tensor '{NORM}'", "dtype 'F17' is not a safetensors"]),
    "byte-count": (lambda h: h[NORM].update(shape=[32]), [f"tensor '{NORM}'", "needs 128 bytes, data_offsets hold"]),
    "float-shape": (lambda h: h[NORM].update(shape=[64.0]), [f"tensor '{NORM}'", "shape [64.0] is not a list of"]),
    "bool-shape": (lambda h: h[NORM].update(shape=[True, 64]), [f"tensor '{NORM}'", "shape [True, 64]"]),
    "reversed-offsets": (_swap, [f"tensor '{NORM}'", "end before they begin"]),
    "overlap": (_overlap, ["model.layers.", "(overlap)"]),
    "metadata-values": (lambda h: h["__metadata__"].update(format=1), ["__metadata__ is {'format': 1}"]),
    "extra-field": (lambda h: h[NORM].update(crc=0), [f"tensor '{NORM}'", "exactly dtype, shape and data_offsets"]),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_corrupt_header_is_refused_by_a_dry_run(workdir, case):
    edit, needles = HEADER_CASES[case]
    path = workdir / "ckpt" / WEIGHTS
    if edit is None:
        write_raw(path, "[]", read_raw(path)[1])
    else:
        edit_header(path, edit)
    with pytest.raises(SafetensorError) if case != "extra-field" else nullcontext():
        safe_open(str(path), framework="pt")  # the library refuses it too (it ignores unknown fields)
    refused(workdir, *needles, "re-download or re-save the checkpoint")


def test_duplicate_header_keys_are_refused(workdir):
    """JSON parsers keep the last of two equal keys (the safetensors library too): one tensor would silently vanish."""
    path = workdir / "ckpt" / WEIGHTS
    text, data = read_raw(path)
    header = json.loads(text)
    duplicated = text.rstrip()[:-1] + f", {json.dumps(NORM)}: {json.dumps(header[NORM])}}}"
    write_raw(path, duplicated, data)
    refused(workdir, "model.safetensors", f"key '{NORM}' appears twice")


@pytest.mark.parametrize("case", ["unknown-dtype", "overlap", "trailing-bytes"])
def test_what_crashed_a_real_build_is_refused_before_any_work(workdir, case):
    """These reached ``safe_open`` in the weight loading and crashed a build with a traceback."""
    path = workdir / "ckpt" / WEIGHTS
    needles = {"unknown-dtype": HEADER_CASES["unknown-dtype"][1], "overlap": HEADER_CASES["overlap"][1],
               "trailing-bytes": ["model.safetensors", "16 bytes after the last tensor's data"]}[case]
    if case == "trailing-bytes":
        edit_header(path, lambda h: None, extra=b"\0" * 16)
    else:
        edit_header(path, HEADER_CASES[case][0])
    refused(workdir, *needles, dry=False)


def test_header_over_the_format_limit(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:  # sparse: the length is checked before the header is read
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 64)
    with pytest.raises(InputError, match=r"huge.safetensors: safetensors header of 100000001 bytes, over the"):
        check_safetensors(path)


def test_zero_sized_and_sub_byte_tensors_are_valid(tmp_path):
    """What the format allows stays accepted: empty tensors at one offset, F4's half bytes, 8-byte padding."""
    import torch

    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.zeros(2, 3), "e": torch.zeros(0), "f": torch.zeros(0, 4)}, str(path))
    assert check_safetensors(path) == {"a": (2, 3), "e": (0,), "f": (0, 4)}
    edit_header(path, lambda h: h["a"].update(dtype="F4", shape=[48]))
    assert check_safetensors(path)["a"] == (48,)
    edit_header(path, lambda h: h["a"].update(shape=[47]))  # 47 half bytes: not whole bytes
    with pytest.raises(InputError, match=r"tensor 'a': shape \[47\] of F4 needs a fractional number of bytes"):
        check_safetensors(path)


# ---------------------------------------------------------------------------------------------------- shard index


def shard(workdir: Path, weight_map) -> Path:
    ckpt = workdir / "ckpt"
    os.replace(ckpt / WEIGHTS, ckpt / "model-00001-of-00001.safetensors")
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ckpt


def test_a_sharded_checkpoint_plans(workdir):
    shard(workdir, {NORM: "model-00001-of-00001.safetensors"})
    assert run(workdir).exit_code == 0


@pytest.mark.parametrize(
    "weight_map, needles",
    [
        (["model-00001-of-00001.safetensors"], ["model.safetensors.index.json", "weight_map is ['model-00001"]),
        ({NORM: 1}, [f"weight_map['{NORM}'] is 1", "expected a shard file name"]),
        ({NORM: None}, [f"weight_map['{NORM}'] is None"]),
        ({}, ["weight_map is empty"]),
        ({NORM: "pytorch_model.bin"}, ["shard 'pytorch_model.bin' is not a .safetensors file"]),
    ],
    ids=["list", "integer", "null", "empty", "pickle"],
)
def test_bad_weight_map(workdir, weight_map, needles):
    shard(workdir, weight_map)
    refused(workdir, "model.safetensors.index.json", *needles)


@pytest.mark.parametrize("name", ["../elsewhere/x.safetensors", "{abs}", "sub/../../elsewhere/x.safetensors",
                                  "linked/x.safetensors"])
def test_a_shard_outside_the_checkpoint_is_never_read(workdir, name):
    """A valid safetensors file outside the checkpoint, named by the index: refused, not read."""
    ckpt = shard(workdir, {})
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(ckpt / "model-00001-of-00001.safetensors", elsewhere / "x.safetensors")
    os.remove(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "linked").symlink_to(elsewhere, target_is_directory=True)
    name = name.format(abs=elsewhere / "x.safetensors")
    (ckpt / INDEX).write_text(json.dumps({"weight_map": {NORM: name}}))
    refused(workdir, "model.safetensors.index.json", "is outside the checkpoint directory")


def test_shards_linked_into_a_blob_store_are_read(workdir):
    """The Hugging Face cache's snapshots link each file into ../../blobs: a link of the file itself is fine."""
    ckpt = shard(workdir, {NORM: "model-00001-of-00001.safetensors"})
    blobs = workdir / "blobs"
    blobs.mkdir()
    os.replace(ckpt / "model-00001-of-00001.safetensors", blobs / "0123abcd")
    (ckpt / "model-00001-of-00001.safetensors").symlink_to(blobs / "0123abcd")
    assert weight_files(ckpt) == [ckpt / "model-00001-of-00001.safetensors"]
    assert run(workdir).exit_code == 0


# ---------------------------------------------------------------------------------------------------- config.json


def rewrite(workdir: Path, edit) -> None:
    path = workdir / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


CONFIG_CASES = {
    "word-hidden": ({"hidden_size": "big"}, "field 'hidden_size' is 'big'; expected a positive integer"),
    "null-layers": ({"num_hidden_layers": None}, "missing field 'num_hidden_layers'"),
    "zero-heads": ({"num_attention_heads": 0}, "field 'num_attention_heads' is 0; expected a positive integer"),
    "float-heads": ({"num_attention_heads": 4.0}, "field 'num_attention_heads' is 4.0"),
    "bool-layers": ({"num_hidden_layers": True}, "field 'num_hidden_layers' is True"),
    "many-layers": ({"num_hidden_layers": 10**9}, "field 'num_hidden_layers' is 1000000000"),
    "inf-vocab": ({"vocab_size": 1e400}, "field 'vocab_size' is inf"),
    "string-rope": ({"rope_parameters": "default"}, "field 'rope_parameters' is 'default'; expected an object"),
    "int-layer-types": ({"layer_types": 3}, "field 'layer_types' is 3; expected a list of strings"),
    "string-tie": ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' is 'false'; expected true or false"),
    "nan-eps": ({"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' is nan; expected a finite positive number"),
    "eos-list": ({"eos_token_id": [1, "2"]}, "field 'eos_token_id[1]' is '2'"),
    "arch-int": ({"architectures": 7}, "field 'architectures' is 7; expected a list of strings"),
    "text-config": ({"text_config": "x"}, "field 'text_config' is 'x'; expected an object"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_field_of_the_wrong_type(workdir, case):
    change, needle = CONFIG_CASES[case]
    rewrite(workdir, lambda c: c.update(change))
    refused(workdir, "ckpt/config.json", needle)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"hidden_size": 1' + "0" * 5000 + "}", "not valid JSON"),
        ("{'single': 1}", "not valid JSON"),
    ],
    ids=["deep", "array", "huge-integer", "not-json"],
)
def test_unreadable_config(workdir, text, needle):
    (workdir / "ckpt" / "config.json").write_text(text)
    refused(workdir, "ckpt/config.json", needle)


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory) -> Path:
    from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

    directory = tmp_path_factory.mktemp("hybrid") / "ckpt"
    write_hybrid(directory)
    return directory


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"layer_types": 4}, "field 'layer_types' is 4; expected a list of strings"),
        ({"num_attention_heads": 0}, "field 'num_attention_heads' is 0"),
        ({"rope_parameters": "default"}, "field 'rope_parameters' is 'default'"),
        ({"linear_num_key_heads": "2"}, "field 'linear_num_key_heads' is '2'"),
        ({"full_attention_interval": 0, "layer_types": None}, "field 'full_attention_interval' is 0"),
        ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' is 'false'"),
    ],
    ids=["int-layer-types", "zero-heads", "string-rope", "string-key-heads", "zero-interval", "string-tie"],
)
def test_hybrid_config_field_of_the_wrong_type(tmp_path, monkeypatch, hybrid_checkpoint, change, needle):
    shutil.copytree(hybrid_checkpoint, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    rewrite(tmp_path, lambda c: c.update(change))
    refused(tmp_path, "ckpt/config.json", needle)


CONTRACT = """\
  contract:
    architectures: [Qwen3ForCausalLM]
    hidden_size: 64
    vocab_size: 4096
    num_hidden_layers: 3
    num_attention_heads: {heads}
    num_key_value_heads: 2
    head_dim: 24
    intermediate_size: 96
"""


def test_a_contract_with_zero_heads_is_refused(workdir):
    """A pinned source that is not here plans from the contract: its fields are checked as config.json's are."""
    recipe = GOOD.replace("path:ckpt", "path:not-here").replace("  context: 64\n", "  context: 64\n" + CONTRACT)
    planned = run(workdir, recipe.replace("{heads}", "4"))
    assert planned.exit_code == 0 and "planned from the recipe's contracts" in planned.output, planned.output
    # the recipe's own check or the plan's (convert/fields.py): either names the contract's field and value
    for heads, value in (("0", "is 0"), ("four", "is 'four'")):
        pinned = recipe.replace("{heads}", heads)
        refused(workdir, "r.yaml: target.contract", "num_attention_heads", value, recipe=pinned)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda c: c.update(rope_parameters="x"), "field 'rope_parameters' is 'x'; expected an object"),
        (lambda c: c.update(rms_norm_eps="1e-6"), "field 'rms_norm_eps' is '1e-6'"),
        (lambda c: c.update(layer_types=[1, 2]), "field 'layer_types' is [1, 2]"),
        (lambda c: c.update(architectures="DFlash2DraftModel"), "field 'architectures' is 'DFlash2DraftModel'"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[True, 2]), "'dflash_config.target_layer_ids'"),
        (lambda c: c.update(num_attention_heads=0), "field 'num_attention_heads' is 0"),
        (lambda c: c.update(hidden_size=1e400), "field 'hidden_size' is inf"),
    ],
    ids=["string-rope", "string-eps", "int-layer-types", "string-architectures", "bool-tap", "zero-heads", "inf"],
)
def test_dflash2_config_field_of_the_wrong_type(change, needle):
    config = dflash2_config()
    change(config)
    with pytest.raises(InputError) as refused_:
        DFlash2Args.from_config(config, "drafter/config.json")
    assert str(refused_.value).startswith("drafter/config.json: ") and needle in str(refused_.value)


MTP_CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 24, "intermediate_size": 96, "vocab_size": 512, "num_hidden_layers": 2,
              "mtp_num_hidden_layers": 1}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"mtp_num_hidden_layers": "1"}, "field 'mtp_num_hidden_layers' is '1'"),
        ({"num_attention_heads": 0}, "field 'num_attention_heads' is 0"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ({"rope_parameters": ["default"]}, "field 'rope_parameters' is ['default']"),
        ({"partial_rotary_factor": "0.5"}, "field 'partial_rotary_factor' is '0.5'"),
        ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' is 'false'"),
        ({"attn_output_gate": 1}, "field 'attn_output_gate' is 1"),
    ],
    ids=["string-count", "zero-heads", "kv-heads", "list-rope", "string-partial", "string-tie", "int-gate"],
)
def test_mtp_config_field_of_the_wrong_type(change, needle):
    assert MTPArgs.from_config(MTP_CONFIG).num_attention_heads == 4
    with pytest.raises(InputError) as refused_:
        MTPArgs.from_config({**MTP_CONFIG, **change}, "ckpt/config.json")
    assert str(refused_.value).startswith("ckpt/config.json: ") and needle in str(refused_.value)
