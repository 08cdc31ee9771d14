"""Property tests (hypothesis) of the checkpoint and config readers (issue #21): whatever the bytes or values, a reader
gives its result or an ``InputError`` of one short line that names the file; never another exception, never a
written file.

- safetensors headers, valid and mutated: ``check_safetensors`` accepts exactly what the safetensors library opens
  (and loads every tensor of), but for keys that appear twice and entries with fields the format does not have,
  which the library lets through and this reader refuses.
- shard indexes: ``weight_files`` returns shards inside the checkpoint directory, or refuses.
- config.json values: a Qwen3 / Qwen3.5 target's, a DFlash2 drafter's and an MTP head's args come out with sizes that
  are positive integers, or the field is refused; a few mutated configs go through ``build --dry-run``.
"""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from test_inputs import GOOD

from convert.cli import main
from convert.errors import InputError
from convert.inputs.sources import check_safetensors, read_json, weight_files
from convert.models import family_for
from convert.models.dflash2 import DFlash2Args
from convert.models.mtp import MTPArgs
from convert.models.qwen3 import Qwen3Args
from convert.models.qwen3_5 import Qwen35Args
from tests.helpers.configs import MTP, QWEN3, QWEN3_5
from tests.helpers.dflash2_checkpoints import tiny_config as dflash2_config

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MESSAGE_LIMIT = 300  # characters of a message beside the file's path

# dtypes torch reads through safetensors, with their sizes (the oracle loads every tensor)
TORCH_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8,
                "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def assert_one_line(error: InputError, path: Path | str) -> None:
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(str(path)), message
    assert len(message.replace(str(path), "")) <= MESSAGE_LIMIT, message


def json_values(leaves=None):
    """Any JSON value (what a tester writes into a field): numbers at the edges, strings, nesting."""
    leaves = leaves or st.one_of(
        st.none(), st.booleans(),
        st.integers(-3, 3), st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 4.0, 1e400, -1e400]),
        st.text(max_size=6), st.sampled_from(["", "4", "false", "F32", "default", "x" * 500]),
    )
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                        max_leaves=6)


# ------------------------------------------------------------------------------------------- safetensors headers

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
TENSORS = st.lists(st.tuples(NAMES, st.sampled_from(sorted(TORCH_DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
                   max_size=4, unique_by=lambda t: t[0])


def serialize(tensors) -> tuple[dict, bytes]:
    """A valid header and data for ``tensors`` (name, dtype, shape), as the format lays them out."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        size = TORCH_DTYPES[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header, bytes(offset)


FIELD = st.sampled_from(["dtype", "shape", "data_offsets"])
MUTATIONS = st.one_of(
    st.just(("none",)),
    st.tuples(st.just("field"), st.integers(0, 3), FIELD, json_values()),  # a tensor's field set to any value
    st.tuples(st.just("dtype"), st.integers(0, 3), st.sampled_from([*TORCH_DTYPES, "F17", "f32", "Q4"])),
    st.tuples(st.just("dim"), st.integers(0, 3), st.integers(0, 2), st.integers(-1, 2**65)),
    st.tuples(st.just("offset"), st.integers(0, 3), st.integers(0, 1), st.integers(-2, 40)),
    st.tuples(st.just("drop"), st.integers(0, 3), FIELD),
    st.tuples(st.just("extra"), st.integers(0, 3)),
    st.tuples(st.just("entry"), st.integers(0, 3), json_values()),  # a whole entry
    st.tuples(st.just("metadata"), json_values()),
    st.tuples(st.just("header"), json_values()),  # the whole header
    st.tuples(st.just("duplicate"), st.integers(0, 3)),
    st.tuples(st.just("data"), st.integers(-8, 8)),  # bytes cut from or added to the end
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1)),  # the 8-byte header length
    st.tuples(st.just("byte"), st.integers(0, 10_000), st.integers(0, 255)),  # one header byte
)


def mutate(header: dict, data: bytes, mutation) -> tuple[bytes, bool]:
    """The file's bytes after ``mutation``, and whether the library may open what this reader refuses (keys twice,
    fields the format does not have)."""
    names = [k for k in header if k != "__metadata__"]
    kind, *args = mutation
    lenient = False
    pick = names[args[0] % len(names)] if names and kind in ("field", "dtype", "dim", "offset", "drop", "extra",
                                                               "entry", "duplicate") else None
    text = None
    if kind == "field" and pick:
        header[pick][args[1]] = args[2]
    elif kind == "dtype" and pick:
        header[pick]["dtype"] = args[1]
    elif kind == "dim" and pick and header[pick]["shape"]:
        shape = header[pick]["shape"]
        shape[args[1] % len(shape)] = args[2]
    elif kind == "offset" and pick:
        header[pick]["data_offsets"][args[1]] += args[2]
    elif kind == "drop" and pick:
        header[pick].pop(args[1])
    elif kind == "extra" and pick:
        header[pick]["crc32"] = 0
        lenient = True
    elif kind == "entry" and pick:
        header[pick] = args[1]
    elif kind == "metadata":
        header["__metadata__"] = args[0]
    elif kind == "header":
        text = json.dumps(args[0])
    elif kind == "duplicate" and pick:
        text = json.dumps(header)[:-1] + f", {json.dumps(pick)}: {json.dumps(header[pick])}}}"
        lenient = True
    elif kind == "data":
        data = data[: len(data) + args[0]] if args[0] < 0 else data + bytes(args[0])
    encoded = (text if text is not None else json.dumps(header)).encode()
    length = struct.pack("<Q", args[0] if kind == "length" else len(encoded))
    if kind == "byte" and encoded:
        encoded = bytearray(encoded)
        encoded[args[0] % len(encoded)] = args[1]
        encoded = bytes(encoded)
    return length + encoded + data, lenient


def library_opens(path: Path) -> dict | None:
    """Tensor name -> shape as the safetensors library reads the file (every tensor loaded), or None."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_tensor(name).shape) for name in f.keys()}
    except Exception:  # noqa: BLE001 - the oracle: any refusal of the library
        return None


@SETTINGS
@given(tensors=TENSORS, mutation=MUTATIONS)
def test_safetensors_header_accepted_exactly_when_the_library_opens_it(tmp_path, tensors, mutation):
    path = tmp_path / "model.safetensors"
    header, data = serialize(tensors)
    raw, lenient = mutate(header, data, mutation)
    path.write_bytes(raw)
    try:
        ours = check_safetensors(path)
    except InputError as error:
        assert_one_line(error, path)
        ours = None
    theirs = library_opens(path)
    event(f"{mutation[0]}: {'accepted' if ours is not None else 'refused'}")
    if mutation == ("none",):
        assert ours == {name: tuple(shape) for name, _, shape in tensors}
    if ours is not None:  # never accept what would crash the weight loading
        assert theirs == ours
    elif not lenient:
        assert theirs is None, f"refused a file the library opens: {mutation}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------------- shard index

INSIDE = st.sampled_from(["a.safetensors", "b.safetensors", "sub/c.safetensors", "./a.safetensors"])
ESCAPING = st.sampled_from(["../x.safetensors", "/etc/x.safetensors", "sub/../../x.safetensors", "..", "",
                            "link/x.safetensors", "sub/../a.safetensors", "a.bin", "missing.safetensors",
                            "C:\\x.safetensors", "sub\\..\\..\\x.safetensors"])
WEIGHT_MAPS = st.one_of(
    st.dictionaries(st.text(max_size=4), INSIDE, min_size=1, max_size=4),  # valid
    st.dictionaries(st.text(max_size=4), st.one_of(INSIDE, ESCAPING), min_size=1, max_size=4),
    st.dictionaries(st.text(max_size=4), st.one_of(INSIDE, json_values()), max_size=4),
    json_values(),
)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A checkpoint directory with valid shards (one in a subdirectory), a link to a directory outside it, and a
    valid shard outside it."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("sharded")
    ckpt, outside = root / "ckpt", root / "outside"
    (ckpt / "sub").mkdir(parents=True)
    outside.mkdir()
    for path in (ckpt / "a.safetensors", ckpt / "b.safetensors", ckpt / "sub" / "c.safetensors",
                 root / "x.safetensors", outside / "x.safetensors"):
        save_file({"w": torch.zeros(2)}, str(path))
    (ckpt / "link").symlink_to(outside, target_is_directory=True)
    return ckpt


@SETTINGS
@given(weight_map=WEIGHT_MAPS, wrap=st.sampled_from([True, True, True, False]))
def test_shard_index_gives_shards_inside_the_checkpoint_or_refuses(sharded, weight_map, wrap):
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map} if wrap else weight_map))
    try:
        files = weight_files(sharded)
    except InputError as error:
        assert_one_line(error, index)
        event("refused")
        return
    finally:
        index.unlink()
    root = sharded.resolve()
    for file in files:
        assert file.is_file() and file.name.endswith(".safetensors")
        assert file.parent.resolve().is_relative_to(root) and ".." not in file.relative_to(sharded).parts
    assert sorted(weight_map.values()) and all(isinstance(v, str) for v in weight_map.values())
    event("accepted")


# ---------------------------------------------------------------------------------------------------- config.json

# what the unedited configs give: each property test checks it first, so that a reader refusing every config fails
DECODER = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24, intermediate_size=96,
               vocab_size=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
               max_position_embeddings=512, attention_bias=False)
QWEN3_ARGS = Qwen3Args(**DECODER, num_hidden_layers=3, bos_token_id=0, eos_token_id=1, pad_token_id=2)
QWEN3_5_ARGS = Qwen35Args(**DECODER, num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
                          rotary_dim=6, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                          linear_value_head_dim=12, linear_conv_kernel_dim=4, bos_token_id=0, eos_token_id=1,
                          pad_token_id=2)
DFLASH2_ARGS = DFlash2Args(architecture="DFlash2DraftModel", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                           rms_norm_eps=1e-6, rope_theta=10000.0, layer_windows=(48, 48), target_layer_ids=(0, 2, 3),
                           block_size=8, mask_token_id=3, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
                           selector_top_k=8)
MTP_ARGS = MTPArgs(**DECODER, num_hidden_layers=3, mtp_layers=1, zero_centred_norm=False, model_type="qwen3",
                   attn_output_gate=False, rotary_dim=24)
# what the args keep: sizes (positive ints), numbers (finite floats), flags (bools)
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "max_position_embeddings")


def fields_of(config: dict):
    keys = sorted({*config, *SIZES, "rope_theta", "text_config", "partial_rotary_factor", "full_attention_interval",
                   "mtp_num_hidden_layers", "attn_output_gate"})
    return st.sampled_from(keys)


def edits(config: dict):
    """One to three fields of ``config`` set to any JSON value (or, for nested ones, a field inside them)."""
    one = st.tuples(fields_of(config), st.sampled_from([None, "rope_theta", "rope_type", "partial_rotary_factor",
                                                        "target_layer_ids", "block_size", "mask_token_id"]),
                    json_values())
    return st.lists(one, min_size=1, max_size=3)


def apply(config: dict, changes) -> dict:
    config = json.loads(json.dumps(config))
    for name, inner, value in changes:
        if inner is not None and isinstance(config.get(name), dict):
            config[name][inner] = value
        else:
            config[name] = value
    return config


def check_args(args) -> None:
    for name in SIZES:
        value = getattr(args, name, 1)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (name, value)
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(args, name)
        assert isinstance(value, float) and 0 < value < float("inf"), (name, value)
    for name in ("tie_word_embeddings", "attention_bias"):
        assert isinstance(getattr(args, name, False), bool), name


def nested(config: dict) -> dict:
    """A Qwen3.5 text config as Qwen3_5ForConditionalGeneration nests it (its tying at the top level)."""
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": config.pop("tie_word_embeddings", False), "text_config": config}


def read_config(reader, config: dict, where: str = "ckpt/config.json"):
    try:
        check_args(reader(config, where))
        event("accepted")
    except InputError as error:
        assert_one_line(error, where)
        event("refused")


@SETTINGS
@given(changes=edits(QWEN3))
def test_qwen3_config_gives_sound_args_or_refuses(changes):
    assert family_for(QWEN3).Args.from_config(QWEN3, "ckpt/config.json") == QWEN3_ARGS
    read_config(lambda c, w: family_for(c, w).Args.from_config(c, w), apply(QWEN3, changes))


@SETTINGS
@given(changes=edits(QWEN3_5), nest=st.booleans())
def test_qwen3_5_config_gives_sound_args_or_refuses(changes, nest):
    unedited = nested(apply(QWEN3_5, [])) if nest else QWEN3_5
    assert family_for(unedited).Args.from_config(unedited, "ckpt/config.json") == QWEN3_5_ARGS
    config = nested(apply(QWEN3_5, changes)) if nest else apply(QWEN3_5, changes)
    read_config(lambda c, w: family_for(c, w).Args.from_config(c, w), config)


@SETTINGS
@given(changes=edits(dflash2_config()), inner=edits(dflash2_config()["dflash_config"]))
def test_dflash2_config_gives_sound_args_or_refuses(changes, inner):
    assert DFlash2Args.from_config(dflash2_config(), "ckpt/config.json") == DFLASH2_ARGS
    config = apply(dflash2_config(), changes)
    if isinstance(config.get("dflash_config"), dict):
        config["dflash_config"] = apply(config["dflash_config"], inner)
    read_config(DFlash2Args.from_config, config)


@SETTINGS
@given(changes=edits(MTP))
def test_mtp_config_gives_sound_args_or_refuses(changes):
    assert MTPArgs.from_config(MTP, "ckpt/config.json") == MTP_ARGS
    read_config(MTPArgs.from_config, apply(MTP, changes))


@SETTINGS
@given(depth=st.integers(1, 200_000), kind=st.sampled_from("[{"), top=json_values())
def test_any_json_file_reads_as_an_object_or_refuses(tmp_path, depth, kind, top):
    """Nesting past the recursion limit, a top level that is not an object: refused naming the file."""
    path = tmp_path / "config.json"
    nested = "[" * depth + "]" * depth if kind == "[" else '{"a": ' * depth + "1" + "}" * depth
    for text in (nested, json.dumps(top)):
        path.write_text(text)
        try:
            assert isinstance(read_json(path), dict)
        except InputError as error:
            assert_one_line(error, path)


# ------------------------------------------------------------------------------------------------ through the CLI


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory, tiny_checkpoint) -> Path:
    root = tmp_path_factory.mktemp("cli")
    shutil.copytree(tiny_checkpoint, root / "pristine")
    return root / "pristine"


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=edits(QWEN3), header_mutation=MUTATIONS)
def test_dry_run_plans_or_refuses_in_one_line(tmp_path_factory, cli_checkpoint, monkeypatch, changes,
                                              header_mutation):
    """``build --dry-run`` over a mutated config.json and safetensors header: exit 0 (a plan) or 2 (one error line),
    no traceback, nothing written."""
    work = tmp_path_factory.mktemp("dry")
    ckpt = work / "ckpt"
    shutil.copytree(cli_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(apply(config, changes)))
    raw = (ckpt / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    mutated, _ = mutate(json.loads(raw[8 : 8 + n]), raw[8 + n :], header_mutation)
    (ckpt / "model.safetensors").write_bytes(mutated)
    (work / "r.yaml").write_text(GOOD)
    monkeypatch.chdir(work)
    result = CliRunner().invoke(main, ["build", "r.yaml", "--dry-run"])
    assert result.exit_code in (0, 2), result.output
    event(f"exit {result.exit_code}")
    assert "Traceback" not in result.output and not isinstance(result.exception, AssertionError)
    if result.exit_code == 2:
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.output
    assert sorted(p.name for p in work.iterdir()) == ["ckpt", "r.yaml"]
