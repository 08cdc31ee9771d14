"""Core ML backend: one multifunction ``.mlpackage`` (mlprogram, iOS18, fp16) per part.

Each function module is traced with ``torch.jit.trace`` at its static shapes, converted with
``ct.convert`` (fp16 compute, KV buffers as fp16 ``ct.StateType``), saved to a temporary
single-function package, and all functions are merged with ``ct.utils.save_multifunction``, which
deduplicates equal constants across functions so the weights are stored once.

Why these choices:
- Tracing uses an fp32 copy of the module with zeroed states. coremltools' torch frontend computes in
  fp32 and reads states as fp32, so fp16 torch tensors make a KV ``scatter_nd`` fail ("updates has
  dtype fp16 whereas data has dtype fp32"); fp16 -> fp32 -> fp16 is exact, so the shipped fp16
  constants equal the module's fp16 weights bit for bit. The copy shares fp32 tensors instead of
  duplicating them, and its zeroed states keep the trace's own KV writes out of the live cache.
- Quantized linears (``convert/export/quantized.py``) ship as coremltools' pre-compressed weights, built from
  our codes and tables: the tracing copy marks each one (a ``_COREML_/weight/compression_type`` buffer) and holds
  a placeholder for it, and while ``ct.convert`` runs, ``_weights_from_codes`` has the torch frontend make each
  marked weight's ``constexpr_lut_to_dense`` / ``constexpr_blockwise_shift_scale`` from the ``QuantizedWeight``
  itself (``_constexpr_weight``), the ops its own pre-compressed path makes after deriving the codes from a dense
  weight. So no fp32 (or fp16) copy of a quantized weight is made to convert it: the tracing copy and the
  conversion hold the codes once, as views (docs/benchmarks.md, "Where a part's packaging memory goes"). An exact2
  weight arrives as a 2-bit palettization with a table per group; the conversion's last pass
  (``Exact2CodesThenScales``) ships it as its codes through one int8 table into ``constexpr_blockwise_shift_scale``
  (``convert/export/quantized.py`` says why). ``compressed_weights`` reads them back for the build's bit-exact check.
- KV writes must be an ``index_put_`` on the whole state with an index tensor for every dim (scatter_nd).
  coremltools 9 has no ``index_copy``; ``cache[l].index_copy_(1, pos, k)`` and ``cache[l, :, pos] = k``
  both reach its ``index_put`` with a whole-slice index, which fails ("Input squeeze_0 has rank 1 != other
  inputs rank 0") under jit.trace and torch.export alike.
- Determinism: save_multifunction writes random UUIDs into Manifest.json, and protobuf (upb) serializes
  the program's function map in an order that changes from process to process. After saving, the
  program is re-serialized deterministically and the manifest ids are derived from the items' contents.

Measured on 2 busy CPU cores with the fp16 toy of tests/test_backend_coreml.py (tests/helpers/toymodel.py with
that write; prefill 8, decode 1, verify 4; 20,480 bytes of fp16 parameters): packaging all 3 functions
takes 2.4-3.8 s (about 0.8 s per function), plus about 2 s to import torch and coremltools; read_back
takes 0.06 s. weight.bin is 23,744 bytes merged against 21,824-22,848 bytes for one function alone
(the per-width mask constants differ); model.mlmodel is 74,471 bytes merged, about 24.8 KB per function.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import logging
import platform
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from convert import progress
from convert.backends import stored
from convert.backends.base import CompileRecord
from convert.errors import PackageError
from convert.export.quantized import (
    ENTRIES,
    EXACT2_ENTRIES,
    QuantizedLinear,
    add_coreml_compression,
    exact2_parameters,
    exact2_tables,
)
from convert.export.spec import DTYPES, FunctionSpec, TensorSpec
from quant.types import QuantizedWeight


class _DropKnownHarmless(logging.Filter):
    """Drops coremltools warnings that every build here triggers and that say nothing about the model:
    the untested-torch-version notice, the missing macOS runtime (libcoremlpython) on Linux, and two
    notes caused by this backend's contract (tuple outputs, states passed as module buffers)."""

    FRAGMENTS = (
        "has not been tested with coremltools",
        "libcoremlpython",
        "Tuple detected at graph output",
        "is added again",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.FRAGMENTS)


# coremltools logs through its package logger, some of it at import time, so the filter goes first.
logging.getLogger("coremltools").addFilter(_DropKnownHarmless())

import coremltools as ct  # noqa: E402
from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil import Function, Operation, Program, Var  # noqa: E402
from coremltools.converters.mil.frontend.milproto.load import load as load_milproto  # noqa: E402
from coremltools.converters.mil.frontend.torch.converter import TorchConverter  # noqa: E402
from coremltools.converters.mil.mil import Block  # noqa: E402
from coremltools.converters.mil.mil import types as mil_types  # noqa: E402
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass  # noqa: E402
from coremltools.converters.mil.mil.passes.helper import block_context_manager  # noqa: E402
from coremltools.converters.mil.mil.passes.pass_registry import register_pass  # noqa: E402
from coremltools.converters.mil.mil.types import np_uint2_dtype, np_uint4_dtype  # noqa: E402
from coremltools.proto import Model_pb2  # noqa: E402

from convert.export.spec import TORCH_DTYPES  # noqa: E402

RUNS_HERE = False  # Core ML runs on Apple devices alone: its packages are checked by reading them back

_NUMPY_DTYPES = {"int32": np.int32, "float16": np.float16, "float32": np.float32}
_FROM_MIL_DTYPES = {"int32": "int32", "fp16": "float16", "fp32": "float32"}
_COMPILER_KIND = "coremlcompiler"
_EXACT2_PASS = "spec_convert::exact2_codes_then_scales"
STABLE_HASH_SCOPE = "every file of the package, byte for byte (Manifest.json ids derived from content)"


def package(functions: dict[str, tuple[nn.Module, FunctionSpec]], path: Path) -> None:
    """Write all functions into one multifunction ``.mlpackage`` at ``path`` (replaced if present).

    The first function is the default one. The live modules (weights and state buffers) are left as
    they were.
    """
    if not functions:
        raise PackageError(f"no functions to package into {path}")
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="spec-convert-coreml-") as tmp, _temporaries_in(Path(tmp) / "coremltools"):
        descriptor = ct.utils.MultiFunctionDescriptor()
        advance = progress.units(len(functions), "functions converted")  # a log's unit lines, a spinner's count
        for name, (module, spec) in functions.items():
            single = Path(tmp) / f"{name}.mlpackage"
            _save_and_release(convert_function(name, module, spec), single)
            descriptor.add_function(str(single), src_function_name="main", target_function_name=name)
            gc.collect()  # a MIL program is a graph of cycles: its constants go only when the collector runs
            advance()
        descriptor.default_function_name = next(iter(functions))
        with _constants_shared_when_equal():
            ct.utils.save_multifunction(descriptor, str(path))
        gc.collect()
    _make_deterministic(path)


@contextlib.contextmanager
def _temporaries_in(directory: Path):
    """Python's temp directory is ``directory`` while the body runs: coremltools makes a temporary ``.mlpackage`` for
    every model it converts or merges (``save_multifunction`` too, out of reach) and removes it only at interpreter
    exit, which a worker process (ended by ``os._exit``) never reaches; here they go with ``directory``'s parent."""
    directory.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(directory)
    try:
        yield
    finally:
        tempfile.tempdir = before


def _save_and_release(model: ct.models.MLModel, path: Path) -> None:
    """Save ``model`` at ``path`` and remove the temporary ``.mlpackage`` coremltools made it in at once (a part's
    function at 27B is gigabytes; ``_temporaries_in`` catches the rest)."""
    model.save(str(path))
    if model.is_temp_package and model.package_path:
        shutil.rmtree(model.package_path, ignore_errors=True)


def convert_function(name: str, module: nn.Module, spec: FunctionSpec) -> ct.models.MLModel:
    """Convert one function module at the static shapes of its spec into an fp16 iOS18 mlprogram."""
    _check_spec(name, module, spec)
    example = tuple(torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype]) for t in spec.inputs)
    tracing_copy = _tracing_copy(module, spec)
    try:
        # check_trace would rerun forward and compare; the state writes make that comparison meaningless.
        traced = torch.jit.trace(tracing_copy, example, check_trace=False)
        _reset_name_counters()
        with _weights_from_codes(module):
            return ct.convert(
                traced,
                convert_to="mlprogram",
                minimum_deployment_target=ct.target.iOS18,
                compute_precision=ct.precision.FLOAT16,
                inputs=[ct.TensorType(name=t.name, shape=t.shape, dtype=_NUMPY_DTYPES[t.dtype]) for t in spec.inputs],
                outputs=[ct.TensorType(name=t.name, dtype=_NUMPY_DTYPES[t.dtype]) for t in spec.outputs],
                states=[
                    ct.StateType(wrapped_type=ct.TensorType(shape=t.shape, dtype=np.float16), name=t.name)
                    for t in spec.states
                ],
                skip_model_load=True,
                pass_pipeline=_pass_pipeline(),
            )
    except Exception as error:
        raise PackageError(
            f"Core ML conversion of function {name!r} failed ({error}); check that the module traces with "
            "torch.jit.trace and writes its KV states with a full-index index_put_ (see convert/backends/coreml.py)"
        ) from error


@contextlib.contextmanager
def _weights_from_codes(module: nn.Module):
    """While it is open, coremltools' torch frontend builds each quantized linear's compressed weight from the
    ``QuantizedWeight`` of ``module`` under that parameter's name (``_constexpr_weight``) instead of deriving codes
    from a dense weight. The tracing copy marks those parameters (``add_coreml_compression``) and holds
    them as placeholders, so no dense copy of a quantized weight exists during a conversion."""
    weights = {f"{path}.weight": layer.quantized_weight() for path, layer in module.named_modules(
        remove_duplicate=False) if isinstance(layer, QuantizedLinear)}
    derive = TorchConverter._construct_compression_op

    def construct(converter, value, param_name):
        weight = weights.get(param_name)
        return derive(converter, value, param_name) if weight is None else _constexpr_weight(param_name, weight)

    TorchConverter._construct_compression_op = construct
    try:
        yield
    finally:
        TorchConverter._construct_compression_op = derive


@contextlib.contextmanager
def _constants_shared_when_equal():
    """While it is open, coremltools' constant deduplication (which ``save_multifunction`` runs across functions to
    store each weight once) shares constants whose bytes are equal (a sha256 of the whole array beside dtype and
    shape) instead of comparing candidates with ``np.allclose``: on a weight that every function holds, ``allclose``
    widens both arrays to float64 (about 25 bytes a weight of the largest matrix: a 248320-row table's codes did not
    fit 24 GB), and its fp16 tolerance of 6e-8 would share two constants a subnormal apart, which the bit-exact
    checks would not pass."""
    from coremltools.converters.mil.mil import ListVar
    from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import const_deduplication

    def find_constants(blocks: list[Block]) -> dict:
        unique2duplicates, first = {}, {}
        for block in blocks:
            for op in list(block.operations):
                var = op.outputs[0] if op.op_type == "const" else None
                if var is None or isinstance(var, ListVar) or not const_deduplication.should_be_deduplicated(var.val):
                    continue
                value = np.ascontiguousarray(var.val)
                key = (getattr(op, "weight_key", None), var.dtype, var.shape,
                       hashlib.sha256(value.reshape(-1).view(np.uint8)).digest())
                if key in first:
                    unique2duplicates[first[key]].append(var)
                else:
                    first[key], unique2duplicates[var] = var, []
        return unique2duplicates

    approximate = const_deduplication.__dict__["find_constants"]  # the staticmethod itself
    const_deduplication.find_constants = staticmethod(find_constants)
    try:
        yield
    finally:
        const_deduplication.find_constants = approximate


def _constexpr_weight(name: str, weight: QuantizedWeight) -> Var:
    """The op coremltools' pre-compressed path makes of a weight whose codes it derived (its torch frontend's
    ``_construct_palettization_op``, ``_construct_quantization_op``), made from the codes and tables themselves:
    lut4 as ``constexpr_lut_to_dense`` of uint4 codes by its fp16 tables [O/G, 1, 16, 1]; affine4 as
    ``constexpr_blockwise_shift_scale`` of uint4 codes, fp16 scales and uint4 zero points (no offset when all are 0);
    exact2 as ``constexpr_lut_to_dense`` of uint2 codes by a 4-entry fp16 table per group (``exact2_tables``),
    which ``Exact2CodesThenScales`` ships as codes then scales. The codes are views of the module's, not copies."""
    codes = weight.codes.contiguous().numpy()
    if weight.method == "affine4":
        zero_point = weight.zero_point.contiguous().numpy()
        return mb.constexpr_blockwise_shift_scale(
            data=codes.view(np_uint4_dtype), scale=weight.scale.numpy(),
            offset=zero_point.view(np_uint4_dtype) if zero_point.any() else None, name=name)
    if weight.method == "lut4":
        lut, indices = weight.lut.reshape(-1, 1, ENTRIES, 1), codes.view(np_uint4_dtype)
    else:
        lut, indices = exact2_tables(weight.scale, weight.zero_point)[..., None], codes.view(np_uint2_dtype)
    return mb.constexpr_lut_to_dense(indices=indices, lut=lut.contiguous().numpy(), name=name)


@register_pass(namespace="spec_convert", name="exact2_codes_then_scales")
class Exact2CodesThenScales(AbstractGraphPass):
    """Ship every 2-bit palettized weight (an exact2 weight's table per group, from ``_constexpr_weight``)
    as ``constexpr_lut_to_dense`` of its codes through one int8 table ``[0, 1, 2, 3] - z`` into
    ``constexpr_blockwise_shift_scale`` with its fp16 scales, and its zero points less ``z`` as int8 offsets when
    they differ (``z`` is the first one). Each code's weight is the same fp16 value: ``scale * (code - zero_point)``,
    one rounding of an exact product, either way. A 2-bit table that is not an exact2 one is refused."""

    def apply(self, prog: Program) -> None:
        for function in prog.functions.values():
            _ship_codes_then_scales(function)


@block_context_manager
def _ship_codes_then_scales(block: Block) -> None:
    for op in list(block.operations):
        if op.op_type != "constexpr_lut_to_dense" or op.lut.val.shape[-2] != EXACT2_ENTRIES:
            continue
        lut = op.lut.val
        parameters = None
        if lut.ndim == 4 and lut.shape[-1] == 1 and lut.dtype == np.float16:
            parameters = exact2_parameters(torch.from_numpy(lut[..., 0]))
        if parameters is None:
            raise PackageError(f"MIL op {op.name}: a 2-bit table {list(lut.shape)} {lut.dtype} that is not an exact2 "
                               "weight's scale * (code - zero_point)")
        scale, zero_point = (t.numpy() for t in parameters)
        shift = int(zero_point.flat[0])
        offset = zero_point.astype(np.int8) - shift
        table = (np.arange(EXACT2_ENTRIES) - shift).astype(np.int8).reshape(1, 1, -1, 1)
        with mb.set_before_op(op):
            codes = mb.constexpr_lut_to_dense(indices=op.indices.val, lut=table, name=f"{op.name}_codes")
            weight = mb.constexpr_blockwise_shift_scale(
                data=codes, scale=scale, offset=offset if offset.any() else None, name=f"{op.name}_scaled"
            )
        block.replace_uses_of_var_after_op(anchor_op=op, old_var=op.outputs[0], new_var=weight, force_replace=True)
        block.remove_ops([op])


def _pass_pipeline() -> ct.PassPipeline:
    """coremltools' default passes, then ``Exact2CodesThenScales``."""
    pipeline = ct.PassPipeline.DEFAULT
    pipeline.append_pass(_EXACT2_PASS)
    return pipeline


def _reset_name_counters() -> None:
    """coremltools names new ops and blocks from process-wide counters (``coreml_update_state_26`` in a
    second build where the first had ``_2``); start each conversion from zero so bytes do not depend on
    what the process converted before."""
    from coremltools.converters.mil.mil import Builder
    from coremltools.converters.mil.mil.block import Block
    from coremltools.converters.mil.mil.program import Placeholder, StateTensorPlaceholder

    Builder.name_count.clear()
    Block.counter = Placeholder.counter = StateTensorPlaceholder.counter = 0


def _check_spec(name: str, module: nn.Module, spec: FunctionSpec) -> None:
    if spec.name != name:
        raise PackageError(f"function {name!r} carries a spec named {spec.name!r}; key and spec.name must match")
    for tensor in (*spec.inputs, *spec.outputs):
        if tensor.dtype not in _NUMPY_DTYPES:
            raise PackageError(f"function {name!r}: {tensor.name!r} has dtype {tensor.dtype!r}, not one of {DTYPES}")
    buffers = dict(module.named_buffers())
    for state in spec.states:
        if state.dtype != "float16":
            raise PackageError(
                f"function {name!r}: state {state.name!r} is {state.dtype}, but Core ML states are float16 only; "
                "declare it float16 in the plan"
            )
        if state.name not in buffers or tuple(buffers[state.name].shape) != state.shape:
            raise PackageError(
                f"function {name!r}: state {state.name!r} {state.shape} must be a buffer of the module with that "
                "exact name and shape"
            )


def _tracing_copy(module: nn.Module, spec: FunctionSpec) -> nn.Module:
    """A structural copy of ``module`` in eval mode: float tensors in fp32, states fresh fp32 zeros, and each
    quantized linear's weight a placeholder of its shape (one fp32 zero, expanded) marked for
    ``_weights_from_codes``.

    fp32 tensors are shared, not copied (``.float()`` returns the tensor itself), so this costs memory only for
    weights stored in another float dtype, never for a quantized one. See the module docstring for why fp32 and why
    fresh states.
    """
    state_names = {state.name for state in spec.states}
    replacements: dict[int, torch.Tensor] = {}
    for name, buffer in module.named_buffers():
        if name in state_names:
            replacements[id(buffer)] = torch.zeros(buffer.shape, dtype=torch.float32)
        else:
            replacements[id(buffer)] = buffer.detach().float() if buffer.is_floating_point() else buffer
    quantized = {id(m.weight) for m in module.modules() if isinstance(m, QuantizedLinear)}
    for parameter in module.parameters():
        value = torch.zeros((), dtype=torch.float32).expand(parameter.shape) if id(parameter) in quantized else \
            parameter.detach().float()
        replacements[id(parameter)] = nn.Parameter(value, requires_grad=False)
    traced = copy.deepcopy(module, memo=replacements).eval()
    for layer in traced.modules():
        if isinstance(layer, QuantizedLinear):
            layer.released = False  # the trace reads the placeholder parameter, which _weights_from_codes replaces
    add_coreml_compression(traced)
    return traced


def _make_deterministic(path: Path) -> None:
    """Rewrite what coremltools leaves random in a saved package, keeping it a valid package.

    The program is re-serialized with sorted maps, and every Manifest item id (and the root model id that
    points at one) becomes a UUID derived from the item's path and bytes.
    """
    manifest_file = path / "Manifest.json"
    manifest = json.loads(manifest_file.read_text())
    entries = manifest["itemInfoEntries"]
    root_id = manifest["rootModelIdentifier"]
    model_file = path / "Data" / entries[root_id]["path"]
    model_file.write_bytes(Model_pb2.Model.FromString(model_file.read_bytes()).SerializeToString(deterministic=True))

    new_ids = {}
    for old_id, item in entries.items():
        item_path = path / "Data" / item["path"]
        if not item_path.exists():
            raise PackageError(f"{manifest_file} lists item {item['name']!r} at {item_path}, which is missing")
        digest = hashlib.sha256(f"{item['path']}\0".encode() + _digest(item_path)).digest()
        new_ids[old_id] = str(uuid.UUID(bytes=digest[:16], version=4))
    manifest["itemInfoEntries"] = {new_ids[old_id]: item for old_id, item in entries.items()}
    manifest["rootModelIdentifier"] = new_ids[root_id]
    manifest_file.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")


def stored_weight_bytes(path: Path) -> int:
    """Bytes of the weight file a package stores (every constant above coremltools' inline size, once)."""
    return sum(p.stat().st_size for p in (path / "Data" / "com.apple.CoreML" / "weights").glob("*.bin"))


def stable_hash(path: Path) -> str:
    """sha256 over every file under ``path`` (or of the file itself), in sorted order, relative paths included."""
    return _digest(Path(path)).hex()


def _digest(root: Path) -> bytes:
    files = [root] if root.is_file() else sorted((p for p in root.rglob("*") if p.is_file()), key=Path.as_posix)
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.digest()


def read_back(path: Path) -> dict[str, FunctionSpec]:
    """The input, output and state names, shapes and dtypes of every function in a saved package, in the
    package's function order."""
    spec, program = _load_program(path)
    return {f.name: _function_spec(f.name, program.functions[f.name]) for f in spec.description.functions}


def _function_spec(name: str, function: Function) -> FunctionSpec:
    inputs, states = [], []
    for var_name, var in function.inputs.items():
        if mil_types.is_state(var.sym_type):
            states.append(_tensor_spec(name, var_name, var.sym_type.wrapped_type()))
        else:
            inputs.append(_tensor_spec(name, var_name, var.sym_type))
    outputs = [_tensor_spec(name, var.name, var.sym_type) for var in function.outputs]
    return FunctionSpec(name=name, inputs=tuple(inputs), outputs=tuple(outputs), states=tuple(states))


def _tensor_spec(function_name: str, name: str, tensor_type) -> TensorSpec:
    mil_dtype = mil_types.builtin_to_string(tensor_type.get_primitive())
    if mil_dtype not in _FROM_MIL_DTYPES:
        raise PackageError(
            f"function {function_name!r}: {name!r} has Core ML dtype {mil_dtype}, which a FunctionSpec cannot express"
        )
    return TensorSpec(name, tuple(int(d) for d in tensor_type.get_shape()), _FROM_MIL_DTYPES[mil_dtype])


@dataclass
class Contents:
    """What the build's checks read from a package: every function's spec, op types and the digest
    (``stored.digest``) of every plain (uncompressed) weight constant it holds. The compressed weights are compared
    by the quantized check (``checks.QuantizedComparison``: codes, tables and their decompression), through
    ``contents``' ``each_function``."""

    specs: dict[str, FunctionSpec]
    operation_types: dict[str, set[str]]
    weight_digests: dict[str, set[str]]


def contents(path: Path, each_function: Callable[[str, list[stored.ShippedWeight]], None] | None = None) -> Contents:
    """The package's ``Contents``, its functions' programs loaded one at a time; ``each_function(name, compressed)``
    sees each function's compressed weights while its program is loaded.

    coremltools loads every function's constants separately (the functions of a multifunction package share their
    weights on disk, not once loaded), so a part's check holds one function's program, not three
    (docs/benchmarks.md, "Where a part's packaging memory goes"). A ``ShippedWeight`` decompresses its weight, a
    block of rows at a time, only when a check compares it."""
    spec, weights_dir = _load_spec(path)
    found = Contents({}, {}, {})
    for name in [f.name for f in spec.description.functions]:
        compressed = _read_function(spec, weights_dir, name, found)
        if each_function is not None:
            each_function(name, compressed)
        del compressed  # its ops hold the function's program
        gc.collect()  # the program's cycles, before the next function's program is loaded
    return found


def _read_function(spec: Model_pb2.Model, weights_dir: str, name: str, found: Contents) -> list[stored.ShippedWeight]:
    """Function ``name``'s entries of ``found`` (loading its program alone), and its compressed weights."""
    function = _load_function(spec, weights_dir, name)
    found.specs[name] = _function_spec(name, function)
    found.operation_types[name] = {op.op_type for op in function.operations}
    found.weight_digests[name], compressed = set(), []
    for op in function.operations:
        if _is_compressed_weight(op):
            compressed.append(_shipped(op))
        elif op.op_type == "const" and (value := _plain_constant(op)) is not None:
            found.weight_digests[name].add(stored.digest(value))
    return compressed


def function_constants(path: Path, function_name: str) -> dict[str, np.ndarray]:
    """The weight tensors of one function as shipped, by the name of the MIL variable that carries them: plain
    constants, and compressed weights as coremltools itself decompresses them."""
    _, program = _load_program(path)
    if function_name not in program.functions:
        raise PackageError(f"{path} has no function {function_name!r}; it has {sorted(program.functions)}")
    constants = {}
    for op in program.functions[function_name].operations:
        if _is_compressed_weight(op):
            constants[op.outputs[0].name] = _shipped(op).dense
        elif op.op_type == "const" and (value := _plain_constant(op)) is not None:
            constants[op.outputs[0].name] = value
    return constants


def operation_types(path: Path) -> dict[str, set[str]]:
    """The MIL op types each function of the package holds (after every conversion pass)."""
    spec, program = _load_program(path)
    return {f.name: {op.op_type for op in program.functions[f.name].operations} for f in spec.description.functions}


def compressed_weights(path: Path) -> dict[str, list[stored.ShippedWeight]]:
    """Every compressed weight of every function, by function: its codes and tables as stored, and the dense
    weight coremltools' own decompression makes of them (every function's program held: the checks of a large part
    use ``contents``' ``each_function`` instead)."""
    found: dict[str, list[stored.ShippedWeight]] = {}
    contents(path, found.__setitem__)
    return found


def _plain_constant(op: Operation) -> np.ndarray | None:
    """A ``const`` op's value when it is a floating tensor (weights), not a scalar or an int/str parameter; a 1x1
    convolution's weight [O, I, 1, 1] (the ane layout's projections) as the linear's [O, I] it is."""
    value = op.outputs[0].val
    if isinstance(value, np.ndarray) and value.ndim > 0 and np.issubdtype(value.dtype, np.floating):
        return value[:, :, 0, 0] if value.ndim == 4 and value.shape[2:] == (1, 1) else value
    return None


def _is_compressed_weight(op: Operation) -> bool:
    """A compressed-weight op whose output is a weight: not the codes an exact2 weight's shift_scale reads."""
    return op.op_type in _COMPRESSED_READERS and not _feeds_shift_scale(op)


def _feeds_shift_scale(op: Operation) -> bool:
    return any(child.op_type == "constexpr_blockwise_shift_scale" for child in op.outputs[0].child_ops)


def _codes_then_scales(op: Operation) -> Operation | None:
    """The lut_to_dense op a blockwise_shift_scale reads its data from (exact2's form), or None."""
    producer = op.data.op if op.op_type == "constexpr_blockwise_shift_scale" else None
    return producer if producer is not None and producer.op_type == "constexpr_lut_to_dense" else None


def _shipped(op: Operation) -> stored.ShippedWeight:
    """The op's weight: its codes and tables as stored, its dense form decompressed when asked for."""
    where = f"MIL op {op.name} ({op.op_type})"
    codes_op = _codes_then_scales(op)
    if codes_op is None:
        reader, optional = _COMPRESSED_READERS[op.op_type], ()
        operands = {name: getattr(op, name) for name in _COMPRESSED_OPERANDS[op.op_type]}
    else:  # exact2: no offset where every zero point is the table's
        reader, optional = stored.from_codes_then_scales, ("offset",)
        operands = {"indices": codes_op.indices, "lut": codes_op.lut, "scale": op.scale, "offset": op.offset}
    missing = [name for name, var in operands.items() if (var is None and name not in optional) or
               (var is not None and var.val is None)]
    if missing:
        raise PackageError(f"{where}: operands {missing} are not constants; it is not a weight compressed here")
    weight = reader(where, *(None if var is None else var.val for var in operands.values()))
    rows, multiple = _decompress_rows(op)
    return stored.ShippedWeight(where, weight, rows, multiple, stored.fingerprint(weight))


def _decompress_rows(op: Operation) -> tuple[Callable[[int, int], np.ndarray], int]:
    """A compressed-weight op's rows ``start .. stop-1`` by coremltools' own decompression, and the multiple of rows
    a range starts at (a lut4 table's group)."""
    decompress = type(op).decompress
    if op.op_type == "constexpr_lut_to_dense":
        indices, lut = op.indices.val, op.lut.val
        group = indices.shape[0] // lut.shape[0]
        return lambda a, b: decompress(indices[a:b], lut[a // group : -(-b // group)], None), group
    scale = op.scale.val
    offset = None if op.offset is None else op.offset.val
    return lambda a, b: decompress(_data_rows(op, a, b), scale[a:b], None if offset is None else offset[a:b]), 1


def _data_rows(op: Operation, start: int, stop: int) -> np.ndarray:
    """Rows ``start .. stop-1`` of a blockwise_shift_scale op's data: a constant's, or exact2's codes through their
    table by coremltools' own lut_to_dense."""
    codes_op = _codes_then_scales(op)
    if codes_op is None:
        return op.data.val[start:stop]
    return type(codes_op).decompress(codes_op.indices.val[start:stop], codes_op.lut.val, None)


_COMPRESSED_READERS: dict[str, Callable[..., QuantizedWeight]] = {
    "constexpr_lut_to_dense": stored.from_lut_to_dense,
    "constexpr_blockwise_shift_scale": stored.from_blockwise_shift_scale,
}
_COMPRESSED_OPERANDS = {
    "constexpr_lut_to_dense": ("indices", "lut"),
    "constexpr_blockwise_shift_scale": ("data", "scale", "offset"),
}


def _load_program(path: Path) -> tuple[Model_pb2.Model, Program]:
    spec, weights_dir = _load_spec(path)
    return spec, load_milproto(spec, specification_version=spec.specificationVersion, file_weights_dir=weights_dir)


def _load_spec(path: Path) -> tuple[Model_pb2.Model, str]:
    """A package's Model proto (the program's ops; the weights stay in its weight file) and its weights folder."""
    if not Path(path).is_dir():
        raise PackageError(f"no Core ML package at {path}; run the package step first")
    model = ct.models.MLModel(str(path), skip_model_load=True)
    return model.get_spec(), model.weights_dir


def _load_function(spec: Model_pb2.Model, weights_dir: str, name: str) -> Function:
    """One function of a package's program, with its constants, without loading the others'."""
    alone = Model_pb2.Model()
    alone.CopyFrom(spec)
    for other in [f for f in alone.mlProgram.functions if f != name]:
        del alone.mlProgram.functions[other]
    program = load_milproto(alone, specification_version=alone.specificationVersion, file_weights_dir=weights_dir)
    return program.functions[name]


def compile(path: Path, out_dir: Path) -> list[CompileRecord]:
    """Compile the package to ``out_dir/<stem>.mlmodelc`` with Xcode's coremlcompiler, or defer it.

    Output paths are relative to ``out_dir`` (the bundle).
    """
    xcrun = shutil.which("xcrun")
    has_compiler = (
        platform.system() == "Darwin"
        and xcrun is not None
        and subprocess.run([xcrun, "--find", "coremlcompiler"], capture_output=True).returncode == 0
    )
    if not has_compiler:
        reason = "coremlcompiler needs macOS with Xcode; run `spec-convert compile BUNDLE` on a Mac"
        return [CompileRecord(kind=_COMPILER_KIND, status="deferred", reason=reason)]
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [xcrun, "coremlcompiler", "compile", str(path), str(out_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines() or [f"exit status {result.returncode}"]
        return [CompileRecord(kind=_COMPILER_KIND, status="failed", reason=f"coremlcompiler: {lines[-1]}")]
    return [CompileRecord(kind=_COMPILER_KIND, status="done", outputs=[f"{path.stem}.mlmodelc"])]
