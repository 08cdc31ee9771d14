"""Static-shape entrypoints over one shared core module.

Every function of a package (prefill, decode, verify ...) is a ``FunctionModule``: the same core
(same parameter tensors, so a package stores the weights once) called at one static width. The KV
buffers are registered on the function module itself, under the state names of its
``FunctionSpec``, and the same tensor objects are shared by all functions of a part, so in torch a
prefill call followed by decode calls carries the cache exactly as a runtime carries package states.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from convert.export.quantized import half_linears
from convert.export.spec import TORCH_DTYPES, FunctionSpec, TensorSpec
from manifests.schema import Rescale

META = torch.device("meta")


class FunctionModule(nn.Module):
    def __init__(self, core: nn.Module, spec: FunctionSpec, states: dict[str, torch.Tensor]):
        super().__init__()
        self.core = core
        self.spec = spec
        for state in spec.states:
            self.register_buffer(state.name, states[state.name], persistent=False)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        produced = self.produce(*inputs)
        return tuple(produced[o.name] for o in self.spec.outputs)

    def produce(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every output of the core for ``inputs`` in spec order, on this function's states (the gates and checks
        read logits even where the function does not return them)."""
        return self.core(*inputs, *(getattr(self, s.name) for s in self.spec.states))


class NamedFunction(FunctionModule):
    """A target function: its inputs and states passed to the core by name (each part takes a different set), with
    its static width as a Python int (no tensor shape is read in the graph)."""

    def produce(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        named = {t.name: value for t, value in zip(self.spec.inputs, inputs, strict=True)}
        states = {s.name: getattr(self, s.name) for s in self.spec.states}
        return self.core(**named, **states, width=self.spec.width)


@dataclass
class ExportModules:
    """One part's export modules: a shared ``core`` and its ``functions`` (FunctionModule, spec) by name, every
    function holding the same state tensors, and the host ``contract`` a runtime drives them by
    (``manifests.schema.HostContract``; a stateful drafter's is empty: the caller passes ids and positions)."""

    core: nn.Module
    functions: dict[str, tuple[FunctionModule, FunctionSpec]]
    contract: dict = dataclasses.field(default_factory=dict)
    rescale: Rescale | None = None  # the range scales folded into the weights (convert/weights/rescale.py), if measured

    def call_with(self, name: str, given: dict) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states with its inputs by name (arrays or tensors, cast to
        the spec's dtypes and shapes); returns every core output, logits included (the checks and gates read them
        even where the function does not return them)."""
        module, spec = self.functions[name]
        if set(given) != {t.name for t in spec.inputs}:
            raise ValueError(f"{name} takes inputs {[t.name for t in spec.inputs]}, got {sorted(given)}")
        tensors, where = [], torch_device_of(self.core)
        for t in spec.inputs:
            value = torch.as_tensor(given[t.name]).to(where, TORCH_DTYPES[t.dtype]).reshape(-1)
            if value.numel() != torch.Size(t.shape).numel():
                raise ValueError(f"{name} takes {t.name} of shape {list(t.shape)}, got {value.numel()} values")
            tensors.append(value.reshape(t.shape))
        with torch.no_grad():
            return module.produce(*tensors)

    @property
    def widths(self) -> dict[str, int]:
        return {name: spec.width for name, (_, spec) in self.functions.items()}

    def states(self) -> dict[str, torch.Tensor]:
        module, spec = next(iter(self.functions.values()))
        return {s.name: getattr(module, s.name) for s in spec.states}

    def reset(self) -> None:
        """Zero the states (a fresh runtime session)."""
        for state in self.states().values():
            state.zero_()

    def session(self):
        """These modules over the same core with zeroed states of their own: another runtime session, which
        ``export.lockstep.in_step`` runs beside this one."""
        states = {name: torch.zeros_like(state) for name, state in self.states().items()}
        functions = {}
        for name, (module, spec) in self.functions.items():
            clone = copy.copy(module)  # the same core and constants; its own buffer table for the new states
            clone._buffers = {**module._buffers, **{s.name: states[s.name] for s in spec.states}}
            functions[name] = (clone, spec)
        return dataclasses.replace(self, functions=functions)


def compute_copy(modules, dtype: torch.dtype, in_place: bool = False, share_weights: bool = False,
                 device: torch.device | None = None):
    """A copy of target or drafter modules (a ``core`` and ``functions`` of (FunctionModule, spec)) computing in
    ``dtype``: the weights as shipped, upcast exactly, fresh shared states, float specs retyped (so inputs are cast
    to ``dtype`` too). The gates and the acceptance runs compute in fp32 this way: fp16 torch on CPU is 3-7x slower.
    ``in_place``: ``modules`` themselves become that copy (a streamed stage's piece: no second copy in memory).
    ``share_weights``: the copy's linears hold the original's weights, upcast a block at a time at each call
    (``export.quantized.HalfLinear``): the same outputs, no second copy of the linears' weights. ``device``: the
    torch device the copy computes on (``convert.torch_device``; default where the modules are), its states there,
    its calls' inputs moved there (``call_with``)."""
    if in_place:
        new = modules
    elif share_weights and (device is None or device.type == "cpu"):  # a GPU's copy is its own memory anyway
        new = copy.deepcopy(modules, half_linears(modules.core))
    else:
        new = copy.deepcopy(modules)
    new.core.to(dtype)
    if device is not None:
        for module, _ in new.functions.values():
            module.to(device)  # the shared core once, each function's own constants
    name = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    specs = {}
    for function, (module, spec) in new.functions.items():
        retyped = FunctionSpec(spec.name, tuple(_retype(t, name) for t in spec.inputs),
                               tuple(_retype(t, name) for t in spec.outputs),
                               tuple(_retype(t, name) for t in spec.states))
        specs[function] = (module, retyped)
    where = device or torch_device_of(new.core)
    states = {s.name: torch.zeros(s.shape, dtype=dtype, device=where) for s in next(iter(specs.values()))[1].states}
    for module, spec in specs.values():
        module.spec = spec
        for state in spec.states:
            module._buffers[state.name] = states[state.name]
    new.functions = specs
    return new


def torch_device_of(core: nn.Module) -> torch.device:
    """The torch device a core computes on: its first real parameter's or buffer's (the CPU for one on meta)."""
    for tensor in itertools.chain(core.parameters(), core.buffers()):
        if tensor.device != META:
            return tensor.device
    return torch.device("cpu")


def _retype(tensor: TensorSpec, dtype_name: str) -> TensorSpec:
    return tensor if tensor.dtype == "int32" else TensorSpec(tensor.name, tensor.shape, dtype_name)


def set_parameter(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Parameter ``name`` (dotted, under ``root``) becomes ``value`` itself, without gradient: how a core whose
    parameters are on meta (``parameters_on_meta``) gets its weights, and gives them back."""
    owner, _, leaf = name.rpartition(".")
    root.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) and keep real buffers. A parameter
    assigned twice (a tied lm_head) stays one object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device != META:
            param = nn.Parameter(param.to(META), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
