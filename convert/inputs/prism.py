"""Read and validate Prism ML's Ternary Bonsai 2 MLX 2-bit pack (``prism_hadamard_qwen35``, schema 2), offline.

The pack stores each large matrix of a Qwen3.5 hybrid as MLX affine 2-bit codes in a rotated basis: the runtime
computes ``y = W' . H(s * x)`` with ``s`` a +-1 sign vector of the input width and ``H`` the normalised Sylvester
Walsh-Hadamard transform applied per block of ``block`` input columns, so the logical weight is ``W = W' H S``
(``S = diag(s)``; ``H`` is symmetric). The embedding is stored in the same basis and turned back on lookup,
``h = s * H(row)``, which is row by row the same product: the logical table is also ``W' H S``.

Where each fact comes from (read, not guessed):

* mlx-vlm (Blaizzy/mlx-vlm), ``mlx_vlm/models/prism_hadamard_qwen35/``:
  ``config.py`` ``ModelConfig.__post_init__``: config.json says ``schema_version`` 2, ``base_model_type`` "qwen3_5",
  ``tensor_namespace`` "mlx-vlm-qwen3_5", ``gdn_activation_layout`` "grouped", ``quantization`` exactly
  ``{bits 2, group_size 128, mode affine}``, and has a non-empty top-level ``modules`` list.
  ``prism_hadamard_qwen35.py``: ``Model.__init__`` reads each record's ``path`` (a module path under
  ``language_model``, duplicates refused), ``embedding`` (must match the module's kind), ``dtype`` (must be
  "float16") and ``block``; ``HadamardQuantizedLinear`` holds ``weight`` uint32 [out, in/16], ``scales`` and
  ``biases`` fp16 [out, in/128] and, for a non-zero block, ``signs`` float32 [in]; it refuses an input width that
  is not a multiple of 128 and a block outside {0, 512, 1024, 2048, 4096} or not dividing the width.
  ``Model.sanitize`` requires ``language_model.{path}.signs`` for every record with a block, with values only -1
  and +1. ``hadamard_transform`` casts x to fp32, multiplies by the signs, applies ``mx.hadamard_transform`` over
  blocks of ``block`` with scale 1/sqrt(block) and casts back; the linear is then ``mx.quantized_matmul(x, weight,
  scales, biases, transpose=True, group_size=128, bits=2)``. ``HadamardQuantizedEmbedding`` dequantizes the
  looked-up rows, casts them to fp16, applies the transform and then the signs (``inverse=True``).
  mlx-vlm's loader does not read ``hadamard.json``: the signs it uses are the safetensors ``signs`` tensors.
* mlx-vlm ``mlx_vlm/models/qwen3_5/qwen3_5.py`` (``Model``, ``sanitize``) and ``language.py`` (the module tree):
  language tensors live under ``language_model.`` (``model.embed_tokens``, ``model.layers.{i}.linear_attn.*``,
  ``model.layers.{i}.self_attn.*``, ``model.layers.{i}.mlp.*``, ``lm_head``), the vision tower under
  ``vision_tower.``; ``embed_tokens`` is the model's only embedding. The Prism ``sanitize`` replaces this one ("Schema
  2 already uses MLX layouts and offset RMSNorm weights"), so the pack's other tensors are already in MLX form.
* MLX (ml-explore/mlx): the ``mlx.core.dequantize`` documentation (affine: ``w = s * q + beta`` per group) and
  ``mlx/backend/cpu/quantized.cpp`` ``_qmm_t`` (the codes of a row are read byte by byte and low bits first, so in a
  little-endian uint32 word code k sits in bits 2k..2k+1); ``mlx/backend/cpu/hadamard.cpp`` ``hadamard_n`` (an
  in-place butterfly in natural order: the Sylvester matrix ``H[i, j] = (-1)^popcount(i & j)``, times the scale).
* ``hadamard.json`` and ``biases = -scales``: neither is in mlx-vlm. The file's keys come from third-party readers of
  the same pack in the public code index, whose repositories the index does not name (a Rust loader, a Swift test
  pinned to the pack @3f926b4, NInfer's MLX source): ``prism.hadamard.version`` 1, ``block_size``, ``transform``
  "normalized-sylvester-walsh-hadamard", ``axis`` "input-last-dimension", ``sign_mode`` "explicit",
  ``gdn_v_grouped`` true, ``weight_names`` (the forward-rotated ``language_model.{path}.weight``),
  ``inverse_weight_names`` (the embedding), and ``sign_widths`` with ``sign_values`` (one vector per input width,
  concatenated in that order). The same readers, and the pack's published card, give ``biases = -scales``
  (zero point 1: codes 0, 1, 2 are -s, 0, +s). This reader checks both, and that the two metadata files agree.

Judgement calls: any power-of-two block that divides the width is accepted (mlx-vlm takes 512 to 4096 only; the
tiny test packs use smaller widths); a code of 3 (``2 s``) is valid in the layout and is not refused. GGUF forms are
refused by name. Nothing here loads a model: ``read_pack`` validates the metadata, the headers, the scales, biases
and signs, and reads each module's codes only when ``codes`` is called.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from convert import cache as build_cache
from convert.errors import InputError
from convert.inputs.contract import as_config
from convert.inputs.sources import Snapshot, check_safetensors, file_records, license_files, read_json, weight_files
from convert.paths import default_cache
from quant.types import QuantizedWeight, Rotation, walsh_hadamard

MODEL_TYPE = "prism_hadamard_qwen35"
MLX_PACK = "prism-ml/Ternary-Bonsai-2-27B-mlx-2bit"
HADAMARD_FILE = "hadamard.json"
PREFIX = "language_model."
EMBEDDING_PATH = "model.embed_tokens"
GROUP_SIZE = 128
CODES_PER_WORD = 16
CONFIG_FIELDS = {
    "schema_version": 2,
    "base_model_type": "qwen3_5",
    "tensor_namespace": "mlx-vlm-qwen3_5",
    "gdn_activation_layout": "grouped",
    "quantization": {"bits": 2, "group_size": GROUP_SIZE, "mode": "affine"},
}
BLOCK_FIELD = "prism.hadamard.block_size"  # hadamard.json's block size; a recipe contract may pin it
HADAMARD_FIELDS = {
    "prism.hadamard.version": 1,
    "prism.hadamard.transform": "normalized-sylvester-walsh-hadamard",
    "prism.hadamard.axis": "input-last-dimension",
    "prism.hadamard.sign_mode": "explicit",
    "prism.hadamard.gdn_v_grouped": True,
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class PackedModule:
    """One packed matrix: its metadata, scales, biases and signs (read and checked); its codes stay in the file."""

    path: str  # the module path under ``language_model``, as config.json's modules list names it
    file: Path  # the safetensors file that holds ``{key}.weight``
    embedding: bool
    block: int  # Hadamard block over the input columns; 0: not rotated
    rows: int
    width: int  # input columns
    scales: torch.Tensor  # fp16 [rows, width / 128]
    biases: torch.Tensor  # fp16 [rows, width / 128]
    signs: torch.Tensor | None  # fp32 [width]; None when not rotated

    @property
    def key(self) -> str:
        return PREFIX + self.path


@dataclass(frozen=True)
class Pack:
    directory: Path
    config: dict
    block: int  # hadamard.json's block size
    modules: dict[str, PackedModule]  # by path, in the modules list's order


@dataclass(frozen=True)
class _Header:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def refuse_gguf(path: Path) -> None:
    """GGUF forms (PQ2_0, PTQ1_0, F16) are not read: their conventions (tiled GDN value heads, ``ssm_a``, stored 1+w
    norms) would need undoing, and the MLX pack holds the same model in the layout mlx-vlm reads."""
    ggufs = [path] if path.suffix == ".gguf" else []
    if not ggufs and path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        raise InputError(f"{ggufs[0]}: GGUF packs are not read; use the MLX pack {MLX_PACK} instead")


def read_pack(directory: Path) -> Pack:
    """Parse and validate a pack before anything loads; a malformed pack raises ``InputError`` naming the file and
    the tensor or field."""
    directory = Path(directory)
    refuse_gguf(directory)
    config_path = directory / "config.json"
    config = read_json(config_path)
    check_pack_config(config, config_path)
    records = module_records(config, config_path)
    hadamard_path = directory / HADAMARD_FILE
    manifest = read_json(hadamard_path)
    block, signs_by_width = _read_hadamard(manifest, hadamard_path)
    headers = _tensor_headers(directory)
    _check_declared(headers, records, config_path)
    modules = {r["path"]: _read_module(r, headers, config_path) for r in records}
    _check_agreement(modules, manifest, block, signs_by_width, hadamard_path)
    return Pack(directory, config, block, modules)


def check_pack_config(config: dict, path: Path) -> None:
    if config.get("model_type") != MODEL_TYPE:
        raise InputError(f"{path}: model_type is {config.get('model_type')!r}, not {MODEL_TYPE!r}")
    for field, expected in CONFIG_FIELDS.items():
        if config.get(field) != expected:
            raise InputError(f"{path}: {field} is {config.get(field)!r}; a Prism pack has {expected!r}")
    if config.get("hadamard_config", HADAMARD_FILE) != HADAMARD_FILE:
        raise InputError(f"{path}: hadamard_config is {config['hadamard_config']!r}, not {HADAMARD_FILE!r}")


def _read_hadamard(manifest: dict, path: Path) -> tuple[int, dict[int, torch.Tensor]]:
    """The block size and the sign vector of each input width that hadamard.json declares."""
    for field, expected in HADAMARD_FIELDS.items():
        if manifest.get(field) != expected:
            raise InputError(f"{path}: {field} is {manifest.get(field)!r}; this reader knows {expected!r}")
    block = manifest.get(BLOCK_FIELD)
    if not _power_of_two(block):
        raise InputError(f"{path}: prism.hadamard.block_size {block!r} is not a power of two")
    widths = manifest.get("prism.hadamard.sign_widths")
    values = manifest.get("prism.hadamard.sign_values")
    if not isinstance(widths, list) or not all(isinstance(w, int) and w > 0 for w in widths):
        raise InputError(f"{path}: prism.hadamard.sign_widths {widths!r} is not a list of positive widths")
    if len(set(widths)) != len(widths):
        raise InputError(f"{path}: prism.hadamard.sign_widths {widths} names a width twice")
    if not isinstance(values, list) or len(values) != sum(widths):
        count = len(values) if isinstance(values, list) else values
        raise InputError(f"{path}: prism.hadamard.sign_values has {count} values; sign_widths {widths} need "
                         f"{sum(widths)}")
    bad = next((i for i, v in enumerate(values) if v not in (1, -1) or isinstance(v, bool)), None)
    if bad is not None:
        raise InputError(f"{path}: prism.hadamard.sign_values[{bad}] is {values[bad]!r}, not -1 or +1")
    signs_by_width, start = {}, 0
    for width in widths:
        signs_by_width[width] = torch.tensor(values[start : start + width], dtype=torch.float32)
        start += width
    return block, signs_by_width


def _tensor_headers(directory: Path) -> dict[str, _Header]:
    """Every tensor's file, dtype and shape, from the safetensors headers (no tensor data is read)."""
    headers: dict[str, _Header] = {}
    for file in weight_files(directory):
        check_safetensors(file)
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in headers:
                    raise InputError(f"{file}: tensor {name!r} also appears in {headers[name].file.name}")
                part = f.get_slice(name)
                headers[name] = _Header(file, part.get_dtype(), tuple(part.get_shape()))
    return headers


def module_records(config: dict, path: Path) -> list[dict]:
    records = config.get("modules")
    if not isinstance(records, list) or not records:
        raise InputError(f"{path}: modules is missing or empty; a Prism pack lists every packed matrix there")
    seen = set()
    for i, record in enumerate(records):
        where = f"{path}: modules[{i}]"
        if not isinstance(record, dict) or not isinstance(record.get("path"), str) or not record["path"]:
            raise InputError(f"{where} has no module path")
        name = record["path"]
        if name in seen:
            raise InputError(f"{where}: {name!r} is listed twice")
        seen.add(name)
        if not isinstance(record.get("embedding"), bool) or record["embedding"] != (name == EMBEDDING_PATH):
            raise InputError(f"{where}: {name!r} has embedding {record.get('embedding')!r}; only {EMBEDDING_PATH!r} "
                             "is an embedding")
        if record.get("dtype") != "float16":
            raise InputError(f"{where}: {name!r} has activation dtype {record.get('dtype')!r}, not 'float16'")
        block = record.get("block")
        if not (block == 0 or _power_of_two(block)):
            raise InputError(f"{where}: {name!r} has block {block!r}, neither 0 nor a power of two")
    return records


def _check_declared(headers: dict[str, _Header], records: list[dict], config_path: Path) -> None:
    """A packed tensor whose module the list leaves out would load as a dense matrix of uint32 words."""
    listed = {r["path"] for r in records}
    for name, header in headers.items():
        if not name.startswith(PREFIX):
            continue  # the vision tower and anything else outside the language model
        module, _, part = name[len(PREFIX) :].rpartition(".")
        packed = part in ("scales", "biases", "signs") or (part == "weight" and header.dtype == "U32")
        if packed and module not in listed:
            raise InputError(f"{header.file}: tensor {name!r} is packed, but {config_path.name}'s modules does not "
                             f"list {module!r}")


def _read_module(record: dict, headers: dict[str, _Header], config_path: Path) -> PackedModule:
    path, block = record["path"], record["block"]
    key = PREFIX + path
    weight = headers.get(f"{key}.weight")
    if weight is None:
        raise InputError(f"{config_path}: modules names {path!r}, but the pack has no tensor {key + '.weight'!r}")
    if weight.dtype != "U32" or len(weight.shape) != 2:
        raise InputError(f"{weight.file}: tensor {key + '.weight'!r} is {weight.dtype} {list(weight.shape)}; a "
                         "2-bit pack stores uint32 [out, in/16]")
    rows, width = weight.shape[0], weight.shape[1] * CODES_PER_WORD
    if width % GROUP_SIZE:
        raise InputError(f"{weight.file}: tensor {key + '.weight'!r} has {weight.shape[1]} words a row: input width "
                         f"{width} is not a multiple of the group size {GROUP_SIZE}")
    for part in ("scales", "biases"):
        name = f"{key}.{part}"
        header = headers.get(name)
        if header is None:
            raise InputError(f"{weight.file}: tensor {name!r} is missing; module {path!r} is packed")
        if header.dtype != "F16" or header.shape != (rows, width // GROUP_SIZE):
            raise InputError(f"{header.file}: tensor {name!r} is {header.dtype} {list(header.shape)}, not F16 "
                             f"{[rows, width // GROUP_SIZE]} (its weight has {weight.shape[1]} words a row)")
    if block and width % block:
        raise InputError(f"{config_path}: modules entry {path!r} has block {block}, which does not divide the input "
                         f"width {width} of tensor {key + '.weight'!r}")
    signs_header = headers.get(f"{key}.signs")
    if block and signs_header is None:
        raise InputError(f"{weight.file}: tensor {key + '.signs'!r} is missing; module {path!r} is rotated (block "
                         f"{block}) and needs its sign vector")
    if not block and signs_header is not None:
        raise InputError(f"{signs_header.file}: tensor {key + '.signs'!r} is present, but modules gives {path!r} "
                         "block 0 (not rotated)")
    scales, biases = (_load(headers[f"{key}.{part}"].file, f"{key}.{part}") for part in ("scales", "biases"))
    _check_scales(scales, biases, key, headers)
    signs = _read_signs(signs_header, key, width) if block else None
    return PackedModule(path, weight.file, record["embedding"], block, rows, width, scales, biases, signs)


def _load(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def _check_scales(scales: torch.Tensor, biases: torch.Tensor, key: str, headers: dict[str, _Header]) -> None:
    bad = ~torch.isfinite(scales)
    if bad.any():
        row, group = (int(i) for i in bad.nonzero()[0])
        raise InputError(f"{headers[key + '.scales'].file}: tensor {key + '.scales'!r} has {scales[row, group].item()} "
                         f"at row {row}, group {group}; scales must be finite")
    wrong = biases != -scales
    if wrong.any():
        row, group = (int(i) for i in wrong.nonzero()[0])
        raise InputError(f"{headers[key + '.biases'].file}: tensor {key + '.biases'!r} is "
                         f"{biases[row, group].item()} at row {row}, group {group}, not -scales "
                         f"({-scales[row, group].item()}); Prism packs have zero point 1")


def _read_signs(header: _Header, key: str, width: int) -> torch.Tensor:
    name = key + ".signs"
    if header.dtype not in FLOAT_DTYPES or header.shape != (width,):
        raise InputError(f"{header.file}: tensor {name!r} is {header.dtype} {list(header.shape)}, not a float vector "
                         f"of the input width {width}")
    signs = _load(header.file, name).to(torch.float32)
    bad = ~((signs == 1) | (signs == -1))
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise InputError(f"{header.file}: tensor {name!r} has {signs[i].item()} at {i}; signs must be exactly -1 or +1")
    return signs


def _check_agreement(modules: dict[str, PackedModule], manifest: dict, block: int,
                     signs_by_width: dict[int, torch.Tensor], path: Path) -> None:
    """config.json's modules, the signs tensors and hadamard.json must describe the same rotation."""
    rotated = [m for m in modules.values() if m.block]
    for field, embedding in (("prism.hadamard.weight_names", False), ("prism.hadamard.inverse_weight_names", True)):
        names = manifest.get(field)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise InputError(f"{path}: {field} is not a list of tensor names")
        expected = {m.key + ".weight" for m in rotated if m.embedding == embedding}
        extra, missing = sorted(set(names) - expected), sorted(expected - set(names))
        if extra:
            raise InputError(f"{path}: {field} names {extra[0]!r}, which config.json's modules does not rotate "
                             f"{'inversely' if embedding else 'forward'}")
        if missing:
            raise InputError(f"{path}: {field} leaves out {missing[0]!r}, which config.json's modules rotates")
    for module in rotated:
        name = module.key + ".signs"
        if module.block != block:
            raise InputError(f"{path}: prism.hadamard.block_size is {block}, but modules gives {module.path!r} block "
                             f"{module.block} (tensor {name!r})")
        declared = signs_by_width.get(module.width)
        if declared is None:
            raise InputError(f"{path}: prism.hadamard.sign_widths has no width {module.width}, the input width of "
                             f"tensor {name!r}")
        differ = module.signs != declared
        if differ.any():
            i = int(differ.nonzero()[0, 0])
            raise InputError(f"{path}: prism.hadamard.sign_values declares {declared[i].item()} at {i} of width "
                             f"{module.width}, but tensor {name!r} has {module.signs[i].item()}")


def read_pack_once(directory: Path) -> Pack:
    """``read_pack`` of ``directory`` once a process: a stage that both reads a pack's unfolded view and ships its
    exact weights holds one copy of its scales and signs (about 0.8 GB at 27B), not one per reader."""
    return _read_pack_at(Path(directory).resolve())


@functools.lru_cache(maxsize=1)
def _read_pack_at(directory: Path) -> Pack:
    return read_pack(directory)


def _power_of_two(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1 and value & (value - 1) == 0


def unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """MLX's 2-bit layout: uint32 [rows, cols] words of 16 codes each, code k in bits 2k..2k+1, to uint8
    [rows, 16 cols] codes in 0..3."""
    signed = words.view(torch.int32)  # arithmetic shifts sign-extend, but the mask keeps only the two code bits
    shifts = torch.arange(0, 32, 2, dtype=torch.int32)
    return ((signed.unsqueeze(-1) >> shifts) & 3).to(torch.uint8).reshape(words.shape[0], -1)


def codes(module: PackedModule, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The module's codes of rows ``start:stop`` (all by default), uint8 [rows, width] in 0..3, read from its file
    now (only those rows)."""
    with safe_open(str(module.file), framework="pt") as f:
        return unpack_codes(f.get_slice(module.key + ".weight")[start:stop])


def dequantize(module: PackedModule, start: int = 0, stop: int | None = None,
               device: torch.device | None = None) -> torch.Tensor:
    """The rotated weight W' = scales * codes + biases per group of 128 input columns, rows ``start:stop``, fp32 on
    ``device`` (default the CPU); exact, since read_pack checked biases = -scales: each value is an fp16 scale times
    code - 1 (at most 13 bits)."""
    words = codes(module, start, stop).to(device)
    groups = words.to(torch.float32).reshape(words.shape[0], -1, GROUP_SIZE)
    scales, biases = (t[start:stop].to(device, torch.float32)[..., None] for t in (module.scales, module.biases))
    return (groups * scales + biases).reshape(words.shape[0], module.width)


# rows unfolded at a time: the fp64 temporaries of a 5120-wide chunk stay near 100 MB
UNFOLD_ELEMENTS = 1 << 23


def unfold(module: PackedModule, start: int = 0, stop: int | None = None,
           device: torch.device | None = None) -> torch.Tensor:
    """The logical weight W = W' H S (so that W x = W' H(s * x)), rows ``start:stop``: computed in fp64 a chunk of
    rows at a time, returned fp32, on ``device`` (a torch device with fp64: in fp64 every sum of the transform is
    exact, so any device gives the CPU's bits; default the CPU). The embedding's rows are cast to fp16 before the
    transform, as mlx-vlm's lookup does (``embedding_table``)."""
    stop = module.rows if stop is None else stop
    out = torch.empty(stop - start, module.width, dtype=torch.float32, device=device)
    step = max(1, UNFOLD_ELEMENTS // module.width)
    for lo in range(start, stop, step):
        rows = dequantize(module, lo, min(lo + step, stop), device)
        if module.embedding:  # mlx-vlm's embedding casts the looked-up rows to fp16 before the transform
            rows = rows.to(torch.float16)
        out[lo - start : lo - start + rows.shape[0]] = _rotate_rows(rows.to(torch.float64), module.block, module.signs)
    return out


def _rotate_rows(rows: torch.Tensor, block: int, signs: torch.Tensor | None) -> torch.Tensor:
    """(rows H) S with H block-diagonal over the columns, in the rows' dtype; rows unchanged when not rotated."""
    if not block:
        return rows
    return walsh_hadamard(rows, block) * signs.to(rows.device, rows.dtype)


def embedding_table(module: PackedModule) -> torch.Tensor:
    """The logical embedding table, each row ``h = s * H(row)`` as mlx-vlm's embedding computes it: the dequantized
    row cast to fp16 (the loader's cast), then the transform, then the signs. Row by row this is W' H S, computed in
    fp64 and returned fp32 (``unfold`` of the embedding)."""
    if not module.embedding:
        raise ValueError(f"{module.key} is not the embedding; its logical weight is unfold(module)")
    return unfold(module)


# ------------------------------------------------------------------------------------------------ the unfolded form

# config.json fields a pack adds to the Hugging Face config of its model (the rest is the HF config as it was)
PACK_CONFIG_FIELDS = ("schema_version", "base_model_type", "tensor_namespace", "requires_runtime", "hadamard_config",
                      "gdn_activation_layout", "components", "quantization", "modules")
# mlx-vlm ``qwen3_5.Model.sanitize``: the zero-centred norms it stores as 1 + w (1-D tensors with these endings)
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")
TEXT_PREFIX, VISION_PREFIX = PREFIX + "model.", "vision_tower."
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def hf_key(key: str) -> str:
    """A pack tensor's name in the Hugging Face checkpoint (mlx-vlm ``qwen3_5.Model.sanitize``'s renaming undone:
    ``language_model.model.*`` <- ``model.language_model.*``, ``vision_tower.*`` <- ``model.visual.*``,
    ``language_model.lm_head`` <- ``lm_head``)."""
    if key.startswith(TEXT_PREFIX):
        return "model.language_model." + key.removeprefix(TEXT_PREFIX)
    if key.startswith(VISION_PREFIX):
        return "model.visual." + key.removeprefix(VISION_PREFIX)
    return key.removeprefix(PREFIX)


def hf_layout(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A dense pack tensor in the Hugging Face layout (mlx-vlm ``sanitize``'s layout changes undone): the offset
    norms back to w (``(1 + w) - 1`` is exact for the stored values in [0.5, 2], Sterbenz), ``conv1d`` [C, K, 1] back
    to [C, 1, K]."""
    if key.endswith(OFFSET_NORMS) and tensor.dim() == 1:
        return tensor - 1.0
    if key.endswith("conv1d.weight") and tensor.dim() == 3 and tensor.shape[-1] == 1:
        # a reshape, not movedim: the same values with the standard strides a stored [C, 1, K] has (torch's conv1d
        # rounds differently with the strides movedim leaves on the size-1 dimension)
        return tensor.reshape(tensor.shape[0], 1, tensor.shape[1])
    return tensor


def unfolded_config(pack: Pack) -> dict:
    """The Hugging Face config.json of the pack's model: the pack's fields removed, its base model type back."""
    config = {k: v for k, v in pack.config.items() if k not in PACK_CONFIG_FIELDS}
    config["model_type"] = pack.config["base_model_type"]
    return config


def unfolded_tensors(pack: Pack) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the pack's model in the Hugging Face checkpoint's names and layout: each packed matrix as its
    logical weight (``unfold`` / ``embedding_table``, fp32), the dense tensors as stored, one file's tensors at a
    time."""
    packed = _packed_names(pack)
    for module in pack.modules.values():
        yield hf_key(module.key + ".weight"), unfold(module)
    for file in weight_files(pack.directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in packed:
                    yield hf_key(name), hf_layout(name, f.get_tensor(name))


def write_unfolded(pack: Pack, directory: Path) -> Path:
    """The pack's model as a stock Hugging Face checkpoint in ``directory`` (config.json, model.safetensors with every
    tensor of ``unfolded_tensors``, the tokenizer files): what transformers' Qwen3.5 classes load as the gate's
    reference. Returns ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(unfolded_tensors(pack)), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(unfolded_config(pack), indent=2))
    copy_pack_files(pack, directory)
    return directory


def _packed_names(pack: Pack) -> set[str]:
    """The pack's tensors that make up its packed matrices (codes, scales, biases, signs)."""
    return {m.key + suffix for m in pack.modules.values() for suffix in (".weight", ".scales", ".biases", ".signs")}


def copy_pack_files(pack: Pack, directory: Path) -> None:
    """The pack's tokenizer, generation and license files, copied into ``directory``."""
    for path in [*(pack.directory / name for name in COPIED_FILES), *license_files(pack.directory)]:
        if path.is_file():
            shutil.copyfile(path, directory / path.name)


VIEW_FILE = "unfolded-pack.json"  # marks an unfolded checkpoint whose weights are computed from the pack as read


def write_view(pack: Pack, directory: Path) -> Path:
    """The pack's unfolded checkpoint without its weights (``UnfoldedPack`` computes them from the pack, one tensor
    or a range of rows at a time): config.json, the tokenizer files and ``VIEW_FILE`` naming the pack. What a
    pack too large to unfold in memory (a 27B's logical weights are 108 GB in fp32) is gated and packaged from."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / VIEW_FILE).write_text(json.dumps({"pack": str(pack.directory.resolve())}, indent=2))
    (directory / "config.json").write_text(json.dumps(unfolded_config(pack), indent=2))
    copy_pack_files(pack, directory)
    return directory


class UnfoldedPack:
    """The tensors of a pack's unfolded checkpoint by their Hugging Face names, computed as they are read: a packed
    matrix is ``unfold``-ed (only the rows asked for), a dense tensor read and put in the Hugging Face layout
    (``hf_layout``). The same values ``write_unfolded`` stores, with ``CheckpointReader``'s ``get`` and ``rows``."""

    def __init__(self, view: Path, device: torch.device | None = None):
        """``device``: where packed matrices are unfolded and returned (``unfold``; dense tensors are read to the
        CPU)."""
        self.device = device
        recorded = read_json(view / VIEW_FILE).get("pack")
        if not isinstance(recorded, str) or not (Path(recorded) / "config.json").is_file():
            raise InputError(f"{view / VIEW_FILE}: the pack it unfolds ({recorded!r}) is gone; remove {view} and "
                             "build again")
        self.pack = read_pack_once(Path(recorded))
        self.modules = {hf_key(m.key + ".weight"): m for m in self.pack.modules.values()}
        packed = _packed_names(self.pack)
        self.dense = {hf_key(name): (h.file, name, h.shape) for name, h in _tensor_headers(self.pack.directory).items()
                      if name not in packed}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape in the unfolded checkpoint (nothing is read)."""
        shapes = {key: (m.rows, m.width) for key, m in self.modules.items()}
        for key, (_, name, shape) in self.dense.items():  # hf_layout's shape, computed on the meta device
            shapes[key] = tuple(hf_layout(name, torch.empty(shape, device="meta")).shape)
        return shapes

    def get(self, key: str) -> torch.Tensor:
        if key in self.modules:
            return unfold(self.modules[key], device=self.device)
        file, name, _ = self._dense(key)
        return hf_layout(name, _load(file, name))

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key``, unfolding only those."""
        if key in self.modules:
            return unfold(self.modules[key], start, stop, self.device)
        return self.get(key)[start:stop]

    def _dense(self, key: str) -> tuple[Path, str, tuple[int, ...]]:
        if key not in self.dense:
            raise InputError(f"{self.pack.directory}: tensor {key!r} is missing; the pack does not match its config")
        return self.dense[key]


def source_config(directory: Path) -> dict:
    """What a recipe's ``target.contract`` is checked against: config.json, and for a pack also hadamard.json's
    fields (``prism.hadamard.block_size`` ...), so that a contract pins the rotation too."""
    refuse_gguf(directory)
    config = read_json(directory / "config.json")
    if config.get("model_type") != MODEL_TYPE or not (directory / HADAMARD_FILE).is_file():
        return config

    return {**config, **as_config(read_json(directory / HADAMARD_FILE))}


def pack_block(directory: Path) -> int:
    """The Hadamard block of a pack ``read_pack`` has checked (hadamard.json's, without reading the tensors again)."""
    return read_json(directory / HADAMARD_FILE)[BLOCK_FIELD]


def unfolded_snapshot(snapshot: Snapshot, quant, where: str, max_bytes: float,
                      cache_root: Path | None = None) -> Snapshot:
    """The snapshot a build reads: a Prism pack's unfolded checkpoint (``write_unfolded``, written once into
    ``cache_root``, default the build cache's directory, under a key of the pack's file hashes and this module's
    code; also under ``--no-cache``: the reference reads it from disk) with the pack as its source, or
    ``snapshot`` as it is. A pack needs ``quant`` method ``exact`` and ``exact`` needs a pack. An unfolded checkpoint
    larger than ``max_bytes`` (it is written from memory, in fp32) is not written: its view (``write_view``) is, and
    the streamed stages read it through ``UnfoldedPack``."""
    refuse_gguf(snapshot.directory)
    is_pack = snapshot.config().get("model_type") == MODEL_TYPE
    if not is_pack:
        if quant.method == "exact":
            raise InputError(f"{where}: target.quantization.method: exact ships a pre-quantized pack's own codes, and "
                             f"{snapshot.directory} is not one (model_type {snapshot.config().get('model_type')!r}, "
                             f"not {MODEL_TYPE!r}); use a Prism pack ({MLX_PACK}) or another method")
        return snapshot
    if quant.method != "exact":
        raise InputError(f"{where}: target.quantization.method: {quant.method}: {snapshot.directory} is a Prism 2-bit "
                         "pack; set method: exact to ship its own codes (re-quantizing would throw their exactness "
                         "away)")
    pack = read_pack(snapshot.directory)
    streamed = 4 * sum(m.rows * m.width for m in pack.modules.values()) > max_bytes
    record = {"pack": {r.path: r.sha256 for r in file_records(pack.directory)},
              "code": build_cache.code_fingerprint(("convert.inputs.prism",))}
    if streamed:  # the view names the pack's directory
        record["view"] = str(pack.directory.resolve())
    directory = (cache_root or default_cache()) / "unfolded" / build_cache.key(record)
    if not (directory / "config.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        write = write_view if streamed else write_unfolded
        with tempfile.TemporaryDirectory(prefix=".unfolding-", dir=directory.parent) as scratch:
            write(pack, Path(scratch) / "checkpoint").rename(directory)
    return dataclasses.replace(snapshot, directory=directory, packed=snapshot.directory)


# ------------------------------------------------------------------------------------------------ the exact weights


def core_name(module: PackedModule) -> str:
    """The export core's module name of a packed matrix (the causal LM's key without ``model.``)."""
    return module.path.removeprefix("model.")


def exact_weight(module: PackedModule) -> QuantizedWeight:
    """A packed matrix as it ships (``exact2``): its codes, fp16 scales and zero point 1 (``biases = -scales``, checked
    by ``read_pack``) per group of 128 input columns, and its rotation (the embedding's is applied after the lookup)."""
    groups = module.scales.shape
    rotation = Rotation(module.signs, module.block) if module.block else None
    # weight_mse: against the pack's own (rotated) weight, which ships as it is
    return QuantizedWeight("exact2", codes(module), GROUP_SIZE, scale=module.scales.contiguous(),
                           zero_point=torch.ones(groups, dtype=torch.uint8), stats={"weight_mse": 0.0},
                           rotation=rotation)
