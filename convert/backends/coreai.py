"""Core AI backend: write one ``.aimodel`` holding every function, run it, read it back, compile it.

``package`` exports each function module with ``torch.export``, stages all of them in one
``coreai_torch.TorchConverter`` (so the weights they share are stored once) and saves the asset. The KV
buffers the modules mutate in place become Core AI states named as in ``FunctionSpec.states``.

Reproducibility (coreai-core 1.0.0b3, coreai-torch 0.4.3): two conversions of the same modules in two
processes differ in exactly two places, both fixed here, so rebuilds are byte-identical:

* ``metadata.json``: ``save_asset`` stamps ``creationDate`` with ``time.time()``, rewritten here to
  ``SOURCE_DATE_EPOCH`` when set, else the Unix epoch (``19700101T000000Z``); and its keys come out in a
  per-process order (a Swift dictionary), so they are rewritten sorted.
* ``main.mlirb``: the names of the weight blobs, ``resource_<uint64>`` (one per distinct weight), in the
  bytecode's string section, the last section but one: the differing bytes near the end of the file, plus
  that section's length varint and the string sizes at its start. The converter names
  each ``dense_resource`` blob by an LLVM hash of its payload whose seed is per process (an ASLR address:
  two builds in one process, or under ``setarch -R``, are identical) and the bytecode keeps the name, so
  the program and weights are equal but the names are not. No option of the converter or serializer sets
  the seed, so ``mlir_bytecode.canonicalize_resource_names`` renames the blobs ``resource_0``, ``resource_1`` ... in
  their (deterministic) order of use, rewrites the string section and ``main.hash``.
  ``TorchConverter.Mode.RELEASE`` is used: DEBUG mode embeds torch stack traces, i.e. checkout paths.

Measured on the toy of ``tests/helpers/toymodel.py`` (2 CPU cores, Linux reference runtime): prefill S=8, three
decodes, verify S=4 at positions 11..14, then a rollback verify at 9..12 on the same states, against the
torch modules carrying their own KV buffers. Argmax ids were identical in every call.

* fp32: max |delta logits| 2.9e-6 (logits up to ~11), final KV states within 5.4e-7; runtime 0.5-0.6 ms
  per call (torch 0.12 ms).
* fp16: max |delta logits| 0.039, about 5 fp16 ulps at that scale; runtime 0.9 ms (decode) to 3.9 ms
  (prefill) per call. fp16 is emulated on Linux: at real sizes it is ~400x slower than fp32.
* Size: main.mlirb 66,531 bytes for 41,088 bytes of weights in fp32 (46,243 for 20,608 in fp16): three
  functions cost ~25 KB of program and the weights once. With a 4096-row embedding, 582,627 bytes for
  557,184 bytes of weights (1.05x).

Quantized linears (``convert/export/quantized.py``) export as coreai-torch's ``PalettizeModule`` /
``WeightDequantizeModule``: the asset stores their codes and zero points as packed ui4 resources (exact2: ui2,
a uniform zero point as an inline splat) and their tables as fp16, each once for all functions (content-addressed
blobs), and ``_check_weights_stored_once`` counts them packed. ``compressed_weights`` reads those ops and constants
back for the build's bit-exact check.

The ODIX lowering that ``compile`` writes (and that the Linux runtime executes) is not reproducible: two
lowerings of the same main.mlirb, even in one process, give the same bytes in a different order (~500 bytes
of one table). It is a derived artifact; the ``.aimodel`` is what ``stable_hash`` covers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import coreai_torch
import numpy as np
import torch
from coreai._compiler import ir
from coreai.authoring import AIModelAsset
from coreai.runtime import NDArray
from coreai_torch._compression import custom_layers
from torch import nn

from convert.backends.base import CompileRecord
from convert.backends.mlir_bytecode import RESOURCE, bytecode_sections, canonicalize_resource_names, resource_blobs
from convert.backends.stored import ShippedWeight, fingerprint, from_blockwise_shift_scale, from_lut_to_dense
from convert.errors import PackageError
from convert.export.quantized import shipped_nbytes
from convert.export.spec import TORCH_DTYPES, FunctionSpec, TensorSpec

RUNS_HERE = True  # the Core AI runtime's Linux CPU reference runs its packages here

STABLE_HASH_SCOPE = "every file of the .aimodel, byte for byte (weight blob names and creationDate made stable)"
WEIGHT_SHARING_BOUND = 1.2  # stored blob bytes / one function's weight bytes
DEVICE_PLATFORMS = ("iOS", "macOS")
DEVICE_DEFERRED = "device AOT compile needs macOS with Xcode's coreai-build; run `spec-convert compile BUNDLE` on a Mac"


def package(functions: dict[str, tuple[nn.Module, FunctionSpec]], path: Path) -> None:
    """Convert every function into one asset at ``path`` (replaced if present), reproducibly."""
    if path.suffix != ".aimodel":
        raise PackageError(f"a Core AI asset path must end in .aimodel, got {path}")
    converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
    for name, (module, spec) in functions.items():
        if spec.name != name:
            raise PackageError(f"function {name!r} carries a FunctionSpec named {spec.name!r}; use one name")
        program = _export(module, spec)
        converter.add_exported_program(
            program,
            input_names=[t.name for t in spec.inputs],
            output_names=[t.name for t in spec.outputs],
            state_names=_state_order(program, spec),
            entrypoint_name=name,
        )
    try:
        program = converter.to_coreai()
    except Exception as error:
        raise PackageError(f"Core AI conversion of functions {list(functions)} failed: {error}") from error
    program.save_asset(path)
    canonicalize_resource_names(path / "main.mlirb")
    (path / "main.hash").write_bytes(hashlib.sha256((path / "main.mlirb").read_bytes()).digest())
    AIModelAsset.load(path).update_metadata(_stamp_creation_date)
    _sort_metadata_keys(path / "metadata.json")
    _check_signatures(path, functions)
    _check_weights_stored_once(path, functions)


def stable_hash(path: Path) -> str:
    """sha256 over every file of the asset (names and bytes); ``package`` makes them all reproducible."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        content = file.read_bytes()
        digest.update(f"{file.relative_to(path).as_posix()}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def read_back(path: Path) -> dict[str, FunctionSpec]:
    """Each function's inputs, outputs and states as the Core AI runtime binds them (loads the asset once)."""
    with open_session(path) as session:
        return session.specs()


def compressed_weights(path: Path) -> dict[str, list[ShippedWeight]]:
    """Every compressed weight (lut_to_dense, blockwise_shift_scale) of every function, by function: its codes and
    tables read back from main.mlirb, and the dense weight coreai-torch's reference ops make of them.

    The ops come from the program through coreai's MLIR bindings (``AIProgram`` has no public op walk, hence its
    private ``_module``); the constants they read are parsed from the bytecode, because the bindings cannot return
    them: ``DenseResourceElementsAttr`` has no reader, and converting a ui4 ``DenseElementsAttr`` to numpy aborts
    the process.
    """
    module = _mlir_module(AIModelAsset.load(path).program)
    blobs = resource_blobs((path / "main.mlirb").read_bytes())
    decoded: dict = {}  # the functions share the resources: each one decoded once, not once a function
    shipped = {}
    with module.context:
        for graph in module.body.operations:
            if graph.name != "coreai.graph":
                continue
            function = ir.StringAttr(graph.attributes["sym_name"]).value
            operations = graph.regions[0].blocks[0].operations
            shipped[function] = [
                _shipped(f"function {function}: op {index} ({op.name})", op, blobs, decoded)
                for index, op in enumerate(operations)
                if op.name in _COMPRESSED_OPS
            ]
    return shipped


def operation_types(path: Path) -> dict[str, set[str]]:
    """The op names each function of the asset holds, without the dialect prefix (``decomposable.`` included):
    ``coreai.decomposable.broadcasting_mul`` is ``broadcasting_mul``."""
    module = _mlir_module(AIModelAsset.load(path).program)
    found = {}
    with module.context:
        for graph in module.body.operations:
            if graph.name == "coreai.graph":
                function = ir.StringAttr(graph.attributes["sym_name"]).value
                found[function] = {op.name.rsplit(".", 1)[-1] for op in graph.regions[0].blocks[0].operations}
    return found


def _mlir_module(program):
    """The MLIR module of an ``AIProgram`` (no public op walk exists, hence its private ``_module``)."""
    try:
        return program._module._mlir_module
    except AttributeError as error:
        raise PackageError("coreai-core changed AIProgram's internals; update the Core AI backend") from error


_COMPRESSED_OPS = ("coreai.lut_to_dense", "coreai.blockwise_shift_scale")
_SHIFT_SCALE_METHODS = {"ui4": "affine4", "ui2": "exact2"}  # by the element type of the data
_SUB_BYTE_BITS = {"ui4": 4, "ui2": 2}  # packed low bits first
_NUMPY_ELEMENTS = {"f16": np.float16, "f32": np.float32, "ui8": np.uint8, "si8": np.int8, "si16": np.int16,
                   "si32": np.int32}


def _shipped(where: str, op, blobs: dict[str, bytes], decoded: dict) -> ShippedWeight:
    """One compressed-weight op: its operands as stored, and coreai-torch's reference decompression of them."""
    operands = [_constant(where, value, blobs, decoded) for value in op.operands]
    if op.name == "coreai.lut_to_dense":
        indices, lut, axis = operands
        weight = from_lut_to_dense(where, indices, lut)
        group = weight.group_size

        def decompress(a: int, b: int) -> np.ndarray:
            table = torch.from_numpy(lut[a // group : b // group])
            return custom_layers.lut_to_dense(torch.from_numpy(indices[a:b]), table, int(axis)).numpy()

        return ShippedWeight(where, weight, decompress, group, fingerprint(weight))
    data, scale, offset, shift = operands
    element = str(ir.RankedTensorType(op.operands[0].type).element_type)
    if element not in _SHIFT_SCALE_METHODS:
        raise PackageError(f"{where}: {element} data is neither affine4's ui4 nor exact2's ui2")
    method = _SHIFT_SCALE_METHODS[element]
    if np.any(shift != 0):
        raise PackageError(f"{where}: a non-zero second offset (minval); not an {method} weight")
    weight = from_blockwise_shift_scale(where, data, scale, offset, method)

    def dequantize(a: int, b: int) -> np.ndarray:
        blocks = (torch.from_numpy(data[a:b]), torch.from_numpy(scale[a:b]), torch.from_numpy(offset[a:b]))
        return custom_layers.constexpr_blockwise_shift_scale(blocks[0], blocks[1], zero_point=blocks[2]).numpy()

    return ShippedWeight(where, weight, dequantize, 1, fingerprint(weight))


def _constant(where: str, value, blobs: dict[str, bytes], decoded: dict) -> np.ndarray:
    """The array a ``coreai.constant`` operand holds, from its resource blob (decoded once into ``decoded``, by
    resource, element type and shape) or its inline attribute."""
    if not ir.OpResult.isinstance(value) or value.owner.name != "coreai.constant":
        raise PackageError(f"{where}: an operand is not a constant; it is not a weight compressed here")
    attr = value.owner.attributes["value"]
    tensor = ir.RankedTensorType(attr.type)
    shape, element = tuple(tensor.shape), str(tensor.element_type)
    if ir.DenseResourceElementsAttr.isinstance(attr):
        key = (re.match(r"dense_resource<([^>]+)>", str(attr)).group(1), element, shape)
        if key not in decoded:
            decoded[key] = _decode(where, blobs[key[0]], element, shape)
        return decoded[key]
    dense = ir.DenseElementsAttr(attr)
    if element in ("f16", "f32"):
        if dense.is_splat:
            return np.full(shape, ir.FloatAttr(dense.get_splat_value()).value, _NUMPY_ELEMENTS[element])
        return np.array(dense)
    body = str(attr).partition("<")[2].rpartition("> :")[0]
    if element not in (*_SUB_BYTE_BITS, *_NUMPY_ELEMENTS) or not re.fullmatch(r"[\[\]\d, -]+", body):
        raise PackageError(f"{where}: cannot read an inline {element} constant printed as {body[:40]!r}")
    values = np.array([int(v) for v in re.findall(r"-?\d+", body)], dtype=np.int64)
    return (np.full(shape, values[0]) if values.size == 1 else values.reshape(shape)).astype(
        _NUMPY_ELEMENTS.get(element, np.uint8)
    )


def _decode(where: str, blob: bytes, element: str, shape: tuple[int, ...]) -> np.ndarray:
    """A resource blob as an array: ui4 and ui2 packed two and four to a byte, low bits first; other types as numpy
    lays them."""
    count = math.prod(shape)
    if element in _SUB_BYTE_BITS:
        bits, packed = _SUB_BYTE_BITS[element], np.frombuffer(blob, np.uint8)
        values = np.stack([(packed >> shift) & (2**bits - 1) for shift in range(0, 8, bits)], axis=-1).reshape(-1)
    elif element in _NUMPY_ELEMENTS:
        values = np.frombuffer(blob, _NUMPY_ELEMENTS[element])
    else:
        raise PackageError(f"{where}: cannot read a {element} constant")
    if values.size < count:
        raise PackageError(f"{where}: a {element} constant of shape {list(shape)} has only {values.size} values")
    return values[:count].reshape(shape).copy()


@contextmanager
def _native_stderr_shown_on_error() -> Iterator[None]:
    """The runtime's native code prints a line per function it loads ("ODIE [default]: Loading function
    ...") straight to file descriptor 2; hold those back and show them only if loading fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class _RuntimeLoop(asyncio.SelectorEventLoop):
    """A session's event loop, which knows when the runtime's threads have left it (issue #21).

    The runtime hands every result back (of ``executable()``'s load and of each call) from a thread of its own, a
    Swift Dispatch worker, through ``loop.call_soon_threadsafe``. Its wake-up write to the loop's self-pipe releases
    the GIL, so the loop's thread resumes, and can finish the command and reach ``Py_FinalizeEx`` while the worker
    has still to take the GIL back to return. A thread that asks for the GIL once finalization has begun is ended
    by ``pthread_exit``, whose forced unwind through the worker's Swift frames the Swift runtime (built without
    exceptions) reports as "C++ exception handling detected but the Swift runtime was compiled with exceptions
    disabled" and aborts: exit 134 after the command's output (a core dump: the worker in ``take_gil`` ->
    ``PyThread_exit_thread`` -> ``_Unwind_ForcedUnwind`` -> ``_swift_exceptionPersonality`` under
    ``call_soon_threadsafe``/``_write_to_self``, the main thread in ``Py_FinalizeEx``'s last collection). Measured on
    2 loaded cores: 15 runs in 100 of a process that opens a session, makes one call and exits; ``generate`` 3 in 14
    as reported (0 in 50 here: its longer exit usually lets the worker through first); every run with the runtime's
    threads held back (docs/benchmarks.md). ``settle`` waits until no such call is under way.
    """

    def __init__(self) -> None:
        super().__init__()
        self._inside = 0  # calls of call_soon_threadsafe under way

    def call_soon_threadsafe(self, callback, *args, context=None):
        self._inside += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            # No call here: the decrement is the last bytecode before the return to the runtime, which holds the
            # GIL from here until it lets go of the interpreter (PyGILState_Release); a call would be a point
            # where the GIL can pass to a settle() that then reads 0 while this thread still needs it back.
            self._inside -= 1

    def settle(self, timeout: float = 60.0) -> None:
        """Return once no thread is inside ``call_soon_threadsafe`` (sleeping, so that they can take the GIL)."""
        deadline = time.monotonic() + timeout
        while self._inside:
            if time.monotonic() > deadline:
                raise PackageError(f"a Core AI runtime thread is still handing a result back after {timeout:.0f} s")
            time.sleep(0.001)


def open_session(path: Path) -> CoreAISession:
    return CoreAISession(path)


class CoreAISession:
    """Run an asset's functions synchronously, carrying its states between calls as an app would.

    Wraps the async runtime API (``asset.executable()``, ``load_function``) in a private event loop, so it
    cannot be used from inside a running event loop. States start as zeros of the shapes and dtypes the
    runtime declares and are passed by reference to every call; the runtime updates them in place, so a
    prefill, decodes and verifies run on the same KV. On Linux loading lowers the asset to ODIX first.
    For about two seconds after a load or call the runtime's threads keep the cores busy: torch calls timed
    then (2 cores) ran ~1000x slower, so do not time torch interleaved with the runtime.
    """

    def __init__(self, path: Path):
        if not AIModelAsset.is_valid(path):
            raise PackageError(f"{path} is not a Core AI asset; write it with package()")
        self._loop = _RuntimeLoop()
        self._exit_stack = AsyncExitStack()
        self._functions, self._states = {}, {}
        try:
            with _native_stderr_shown_on_error():
                executable = AIModelAsset.load(path).executable()
                model = self._loop.run_until_complete(self._exit_stack.enter_async_context(executable))
                self._functions = {name: model.load_function(name) for name in model.function_names}
            self._state_specs = _union_states(self.specs())
            self.reset()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> CoreAISession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Let the runtime finish, then release the model and the loop; on return no runtime thread is left inside
        the interpreter (see ``_RuntimeLoop``), so the process can exit."""
        if self._loop.is_closed():
            return
        try:
            pending = asyncio.all_tasks(self._loop)
            if pending:
                # A call cut short (Ctrl-C): the runtime completes it anyway and then hands the result to this loop;
                # closed, the loop refuses it and the runtime stops the process ("Failed to call_soon", measured).
                sys.stderr.write("waiting for the Core AI runtime to finish its call (Ctrl-C again to leave now)\n")
                self._loop.run_until_complete(asyncio.wait(pending))
            self._functions, self._states = {}, {}
            self._loop.run_until_complete(self._exit_stack.aclose())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.settle()
        finally:
            self._loop.close()

    def specs(self) -> dict[str, FunctionSpec]:
        return {name: _function_spec(function.desc) for name, function in self._functions.items()}

    def reset(self) -> None:
        """Zero every state. Built from numpy zeros: ``NDArray.from_descriptor`` memory is not zeroed."""
        self._states = {s.name: NDArray(np.zeros(s.shape, dtype=s.dtype)) for s in self._state_specs}

    def states(self) -> dict[str, np.ndarray]:
        return {name: _to_numpy(array, f"state {name!r}") for name, array in self._states.items()}

    def call(self, function_name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        function = self._functions.get(function_name)
        if function is None:
            raise PackageError(f"no function {function_name!r} in the asset; it has {sorted(self._functions)}")
        desc = function.desc
        if set(inputs) != set(desc.input_names):
            raise PackageError(f"{function_name} takes inputs {desc.input_names}, got {sorted(inputs)}")
        arrays = {}
        for name in desc.input_names:
            expected = desc.input_descriptor(name)
            value = np.asarray(inputs[name])
            if value.shape != tuple(expected.shape) or value.dtype != np.dtype(expected.dtype):
                raise PackageError(
                    f"{function_name} input {name!r} must be {expected.dtype}{tuple(expected.shape)}, "
                    f"got {value.dtype}{value.shape}"
                )
            arrays[name] = NDArray(np.ascontiguousarray(value))
        states = {name: self._states[name] for name in desc.state_names}
        outputs = self._loop.run_until_complete(function(arrays, state=states))
        return {name: _to_numpy(outputs[name], f"{function_name} output {name!r}") for name in desc.output_names}


def compile(path: Path, out_dir: Path) -> list[CompileRecord]:
    """Write the portable ODIX lowering and, on a Mac with ``coreai-build``, the device AOT builds.

    Output paths in the records are relative to ``out_dir``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_compile_odix(path, out_dir), *(_compile_device(path, out_dir, p) for p in DEVICE_PLATFORMS)]


def _export(module: nn.Module, spec: FunctionSpec) -> torch.export.ExportedProgram:
    example = tuple(_example_input(t) for t in spec.inputs)
    with _scratch_states(module, spec):
        try:
            exported = torch.export.export(module, example)
            return exported.run_decompositions(coreai_torch.get_decomp_table())
        except Exception as error:
            raise PackageError(f"torch.export of function {spec.name!r} failed: {error}") from error


def _example_input(tensor: TensorSpec) -> torch.Tensor:
    if "position" in tensor.name:
        return torch.arange(tensor.shape[-1], dtype=TORCH_DTYPES[tensor.dtype]).expand(tensor.shape).contiguous()
    return torch.zeros(tensor.shape, dtype=TORCH_DTYPES[tensor.dtype])


@contextmanager
def _scratch_states(module: nn.Module, spec: FunctionSpec):
    """Export against scratch state buffers so the live KV (shared by every function) is never touched."""
    live = {}
    for state in spec.states:
        buffer = getattr(module, state.name, None)
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != TORCH_DTYPES[state.dtype]:
            raise PackageError(f"function {spec.name!r} needs a {state.dtype} buffer named {state.name!r}")
        if tuple(buffer.shape) != state.shape:
            raise PackageError(f"{spec.name} state {state.name!r} is {tuple(buffer.shape)}, spec says {state.shape}")
        live[state.name] = buffer
    try:
        for name, buffer in live.items():
            setattr(module, name, torch.zeros_like(buffer))
        yield
    finally:
        for name, buffer in live.items():
            setattr(module, name, buffer)


def _state_order(program: torch.export.ExportedProgram, spec: FunctionSpec) -> list[str]:
    """The mutated buffers in the program's placeholder order, which is the order ``state_names`` binds."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    ordered = [name for name in program.graph_signature.buffers if name in mutated]
    declared = [s.name for s in spec.states]
    if sorted(ordered) != sorted(declared):
        raise PackageError(
            f"function {spec.name!r} mutates buffers {sorted(ordered)} but declares states {sorted(declared)}; "
            "every state must be a buffer written in place by forward (e.g. cache.index_copy_) and nothing else"
        )
    return ordered


def _stamp_creation_date(metadata) -> None:
    metadata.creation_date = float(os.environ.get("SOURCE_DATE_EPOCH", 0))


def _sort_metadata_keys(metadata_json: Path) -> None:
    """coreai writes metadata.json keys in a per-process order (a Swift dictionary); sort them."""
    metadata = json.loads(metadata_json.read_text())
    metadata_json.write_text(json.dumps(metadata, indent=2, sort_keys=True, separators=(",", " : ")) + "\n")


def _check_signatures(path: Path, functions: dict[str, tuple[nn.Module, FunctionSpec]]) -> None:
    """Parse the written asset back (cheap, no lowering) and check each function's input/output names."""
    summary = AIModelAsset.load(path).summary(include_statistics=False)
    if summary is None or sorted(summary.function_names) != sorted(functions):
        raise PackageError(f"{path} does not hold the functions {sorted(functions)}")
    for name, (_, spec) in functions.items():
        written = ([n for n, _ in summary.function_inputs(name)], [n for n, _ in summary.function_outputs(name)])
        if written != ([t.name for t in spec.inputs], [t.name for t in spec.outputs]):
            raise PackageError(f"{path} function {name!r} was written with inputs/outputs {written}")


def _check_weights_stored_once(path: Path, functions: dict[str, tuple[nn.Module, FunctionSpec]]) -> None:
    stored = stored_weight_bytes(path)
    weights = max(_weight_bytes(module, spec) for module, spec in functions.values())
    # 4 KiB covers blob alignment padding, which matters only for toy-sized weights.
    if stored > WEIGHT_SHARING_BOUND * weights + 4096:
        raise PackageError(
            f"{path} stores {stored} bytes of weight blobs for {weights} bytes of weights per function: the "
            "functions do not share their weights; build them over the same parameter tensors"
        )


def stored_weight_bytes(path: Path) -> int:
    """Bytes of the weight blobs a package stores (its bytecode's resource section: every constant, once)."""
    _, sections = bytecode_sections((path / "main.mlirb").read_bytes())
    return sum(len(data) for section, data, _ in sections if section == RESOURCE)


def _weight_bytes(module: nn.Module, spec: FunctionSpec) -> int:
    """What one function's weights should take in the asset: quantized linears packed, the rest dense."""
    return shipped_nbytes(module, skip={s.name for s in spec.states})


def _function_spec(desc) -> FunctionSpec:
    def tensors(names, describe):
        return tuple(TensorSpec(n, tuple(describe(n).shape), describe(n).dtype) for n in names)

    return FunctionSpec(
        name=desc.name,
        inputs=tensors(desc.input_names, desc.input_descriptor),
        outputs=tensors(desc.output_names, desc.output_descriptor),
        states=tensors(desc.state_names, desc.state_descriptor),
    )


def _union_states(specs: dict[str, FunctionSpec]) -> tuple[TensorSpec, ...]:
    states: dict[str, TensorSpec] = {}
    for spec in specs.values():
        for state in spec.states:
            if states.setdefault(state.name, state) != state:
                raise PackageError(f"state {state.name!r} is {states[state.name]} in one function, {state} in another")
    return tuple(states.values())


def _to_numpy(array: NDArray, what: str) -> np.ndarray:
    """Copy a runtime array out, refusing a ``.numpy()`` view whose layout disagrees with the array's.

    ``.numpy()`` goes through DLPack, which returns a wrongly laid out view for interleaved
    (hardware-constrained) states; the copy also keeps later calls from changing what was returned.
    """
    view = array.numpy()
    strides = tuple(s // view.itemsize for s, n in zip(view.strides, view.shape, strict=True) if n > 1)
    expected = tuple(s for s, n in zip(array.strides, array.shape, strict=True) if n > 1)
    if view.shape != tuple(array.shape) or strides != expected:
        raise PackageError(
            f"{what}: the runtime array is {array.shape} with strides {array.strides} but .numpy() gave "
            f"{view.shape} with strides {view.strides}; read it without hardware constraints (interleave)"
        )
    return np.array(view, copy=True)


def _compile_odix(path: Path, out_dir: Path) -> CompileRecord:
    """Lower to ODIX, the portable form the runtime executes, exactly as ``executable()`` does on Linux."""
    target = out_dir / f"{path.stem}.aimodelx"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    AIModelAsset.load(path)._write_odix(target)
    return CompileRecord("odix", "done", outputs=_relative_files(target, out_dir))


def _compile_device(path: Path, out_dir: Path, platform: str) -> CompileRecord:
    kind = f"device-aot-{platform.lower()}"
    if not _has_coreai_build():
        return CompileRecord(kind, "deferred", reason=DEVICE_DEFERRED)
    target = out_dir / platform
    command = ["xcrun", "coreai-build", "compile", str(path), "--platform", platform, "--output", str(target)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return CompileRecord(kind, "failed", reason=f"{' '.join(command)}: {last_line}")
    return CompileRecord(kind, "done", outputs=_relative_files(target, out_dir))


def _has_coreai_build() -> bool:
    if sys.platform != "darwin" or shutil.which("xcrun") is None:
        return False
    return subprocess.run(["xcrun", "--find", "coreai-build"], capture_output=True, check=False).returncode == 0


def _relative_files(folder: Path, root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in folder.rglob("*") if p.is_file())
