"""What a drafter's acceptance buys: bytes each call reads, and the speedup under a bandwidth-bound cost model.

At batch 1 on Apple silicon a call's time is close to the bytes it reads (weights and states), so costs are
measured in bytes and expressed in units of one target decode call (seed 002's model): a round of speculative
decoding costs ``draft_cost + c_v`` decode calls (``c_v``: the verify call's bytes over the decode call's) and
yields ``E`` tokens (tokens per round, the bonus included), so the predicted speedup over plain greedy is
``E / (draft_cost + c_v)``.

Bytes read are measured, not derived from shapes: each call of the export modules runs under a dispatch mode
that sees every aten op and marks which elements of which weight or state it reads (a gather such as the
embedding lookup reads only its rows; a view of a state reads only its slice; a write is not a read). Elements
are priced as shipped: a 4-bit linear at its packed bytes (codes and tables) per element, fp16 tensors at 2
bytes, states at their package dtype. The ane layout's host buffers are what its host passes each call: the whole
inputs of the package's entry that holds the call (its ladder's), whatever rows the compute copy's buffers have.
Activations and outputs are not counted (small at batch 1). The meter's masks are made on the device of the tensors
it marks (the drafter stage's compute copies are on the build's torch device); the bytes are the same on any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from convert.export.quantized import CodesLinear, QuantizedLinear
from convert.export.spec import size_text
from convert.runtime.host import HostOwned, ModuleFunctions, rung

_GATHERS = {torch.ops.aten.embedding.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default}
_STATE_BYTES = {"float16": 2, "float32": 4, "int32": 4}


@dataclass(frozen=True)
class Priced:
    """A tensor of the compute modules and what one of its elements costs as shipped."""

    kind: str  # "weights" or "states"
    bytes_per_element: float
    whole_scale: float = 1.0  # a read of all of it costs the shipped tensor's elements: theirs over the compute one's


def priced_tensors(compute, shipped) -> dict[int, Priced]:
    """By storage address of ``compute``'s tensors (a ``compute_copy`` of ``shipped``): weights at their shipped
    bytes per element (``QuantizedLinear`` packed: its dense weight's elements priced at its codes and tables; a
    ``CodesLinear``'s codes and tables read as they are, zero points at their code bits), states at their package
    dtype. A bias and a rotation's signs are read, and priced, as themselves. The drafter stage's copy holds its
    states and position constants at the rows its prompts reach (``drafter.stage_target``), fewer than the shipped
    ones: a state's elements are priced at the shipped state's rows a row (a call reads every row of it), a constant
    read whole as the shipped one read whole."""
    shipped_bytes = {}
    for name, module in shipped.core.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantizedLinear):
            own = [module.bias] if module.bias is not None else []
            own += list(module.rotation.buffers()) if module.rotation is not None else []
            packed = (module.shipped_nbytes() - sum(t.nbytes for t in own)) / module.weight.numel()
            shipped_bytes[f"{prefix}weight"] = packed
        elif isinstance(module, CodesLinear) and module.zero_point is not None:
            shipped_bytes[f"{prefix}zero_point"] = module.bits / 8
    shipped_elements = {}
    for name, tensor in [*shipped.core.named_parameters(), *shipped.core.named_buffers()]:
        shipped_bytes.setdefault(name, tensor.element_size())
        shipped_elements[name] = tensor.numel()
    priced = {}
    for name, tensor in [*compute.core.named_parameters(), *compute.core.named_buffers()]:
        if name in shipped_bytes:
            priced[tensor.untyped_storage().data_ptr()] = Priced("weights", shipped_bytes[name],
                                                                 shipped_elements[name] / tensor.numel())
    _, spec = next(iter(shipped.functions.values()))
    states = {s.name: s for s in spec.states}
    for name, tensor in compute.states().items():  # a call reads every row of a state (each layer's slice whole)
        rows = math.prod(states[name].shape) / tensor.numel()
        priced[tensor.untyped_storage().data_ptr()] = Priced("states", _STATE_BYTES[states[name].dtype] * rows)
    return priced


class _ReadMeter(TorchDispatchMode):
    """Marks the elements of priced tensors that the ops of one call read: a read of a whole storage, or of a dense
    range of it (a block of rows, in any order of its elements) or of gathered rows, as element spans; any other view
    or gather in a mask of the storage's elements. At 27B a mask per sliced weight would be GBs (the codes a target
    reads a block of rows at a time are 6.8G elements)."""

    def __init__(self, priced: dict[int, Priced]):
        super().__init__()
        self.priced = priced
        self.masks: dict[int, torch.Tensor] = {}
        self.spans: dict[int, list[tuple[int, int]]] = {}
        self.whole: dict[int, int] = {}  # storages read whole: their elements

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if not is_view:
            for i, argument in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                if argument.alias_info is not None and argument.alias_info.is_write:
                    continue
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, torch.Tensor):
                        self._read(func, i, tensor, args)
        return func(*args, **kwargs)

    def _read(self, func, position: int, tensor: torch.Tensor, args) -> None:
        address = tensor.untyped_storage().data_ptr()
        if address not in self.priced or address in self.whole:
            return
        elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        gather = func in _GATHERS and position == 0
        if not gather and tensor.numel() == elements and tensor.storage_offset() == 0 and 0 not in tensor.stride():
            self.whole[address] = elements  # the whole tensor (a permutation of its elements, e.g. a transposed weight)
            self.masks.pop(address, None)
            self.spans.pop(address, None)
            return
        spans = _gathered_row_spans(func, tensor, args) if gather else _dense_span(tensor)
        if spans is not None:
            held = self.spans.setdefault(address, [])
            held.extend(spans)
            if len(held) > 4096:
                held[:] = _merged(held)
            return
        mask = self.masks.setdefault(address, torch.zeros(elements, dtype=torch.bool, device=tensor.device))
        ids = torch.arange(elements, device=tensor.device).as_strided(tensor.shape, tensor.stride(),
                                                                       tensor.storage_offset())
        if gather:  # the same gather over element ids: exactly the elements it reads
            ids = func(ids, *args[1:])
        mask[ids.reshape(-1)] = True

    def elements_read(self, address: int) -> int:
        """Elements of the storage at ``address`` the metered calls read (KeyError for one they never touched)."""
        if address in self.whole:
            return self.whole[address]
        spans = _merged(self.spans.get(address, []))
        if address not in self.masks:
            if not spans:
                raise KeyError(address)
            return sum(end - start for start, end in spans)
        mask = self.masks[address].clone()
        for start, end in spans:
            mask[start:end] = True
        return int(mask.sum())

    def bytes_read(self) -> dict[str, int]:
        read = {"weights": 0.0, "states": 0.0}
        for address in {*self.masks, *self.spans, *self.whole}:
            priced = self.priced[address]
            scale = priced.whole_scale if address in self.whole else 1.0
            read[priced.kind] += self.elements_read(address) * priced.bytes_per_element * scale
        return {kind: round(value) for kind, value in read.items()}


def _dense_span(tensor: torch.Tensor) -> list[tuple[int, int]] | None:
    """The one element span a view reads when its elements are a dense range of its storage in some order (a block
    of rows, or its transpose), else None."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    start = tensor.storage_offset()
    return [(start, start + tensor.numel())]


def _gathered_row_spans(func, tensor: torch.Tensor, args) -> list[tuple[int, int]] | None:
    """The rows a gather along the first dim of a row-major 2-D tensor reads, as element spans, else None."""
    if func is torch.ops.aten.embedding.default:
        rows = args[1]
    elif func is torch.ops.aten.index_select.default and args[1] == 0:
        rows = args[2]
    elif (func is torch.ops.aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None
          and args[1][0].dtype in (torch.int32, torch.int64)):
        rows = args[1][0]
    else:
        return None
    if tensor.dim() != 2 or tensor.stride() != (tensor.shape[1], 1):
        return None
    width, start = tensor.shape[1], tensor.storage_offset()
    read = (rows.reshape(-1) % tensor.shape[0]).unique().tolist()
    return [(start + r * width, start + (r + 1) * width) for r in read]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint spans covering the same elements."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class MeteredFunctions(ModuleFunctions):
    """``Functions`` over export modules that logs every call with the bytes it read: ``log`` gets
    ``(side, function, {"weights": n, "states": n})``, shared by the target's and the drafter's."""

    def __init__(self, compute, shipped, side: str, log: list):
        super().__init__(compute)
        self.priced, self.side, self.log = priced_tensors(compute, shipped), side, log
        self.shipped_specs = {name: spec for name, (_, spec) in shipped.functions.items()}
        self.ladder = shipped.contract.get("ladder", [])

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with _ReadMeter(self.priced) as meter:
            out = super().call(function, inputs)
        read = meter.bytes_read()
        if isinstance(self.driven, HostOwned):  # the ane layout: the host's buffers are what the states would be
            read["states"] += self.shipped_buffer_bytes(function, inputs)
        self.log.append((self.side, function, read))
        return out

    def shipped_buffer_bytes(self, function: str, inputs: dict[str, np.ndarray]) -> int:
        """The host buffers the shipped package's host passes this call, at their shipped dtype: the whole inputs of
        the entry it calls (``host.rung``: its ladder's smallest that holds the call), whatever rows the compute
        copy's buffers have (the drafter stage's hold only the rows its prompts reach: ``drafter.stage_target``)."""
        spec = self.shipped_specs[rung(self.shipped_specs, self.ladder, function, inputs)]
        return sum(math.prod(t.shape) * _STATE_BYTES[t.dtype] for t in spec.inputs if t.name in self.driven.rules)


def per_call(log: list) -> dict[str, dict[str, int]]:
    """Mean bytes read per call, by ``side.function``, with the call count."""
    grouped: dict[str, list[dict]] = {}
    for side, function, read in log:
        grouped.setdefault(f"{side}.{function}", []).append(read)
    return {key: {"calls": len(reads), **{kind: round(sum(r[kind] for r in reads) / len(reads))
                                          for kind in ("weights", "states")},
                  "total": round(sum(r["weights"] + r["states"] for r in reads) / len(reads))}
            for key, reads in grouped.items()}


def round_drafter_bytes(log: list) -> tuple[float, dict[str, float]]:
    """Steady-state drafter bytes per round: the drafter calls between consecutive verify calls (after a verify:
    the accepted rows into its context; then the next round's drafts), averaged over those gaps; and the calls
    per round by function."""
    verify_at = [i for i, (side, function, _) in enumerate(log) if side == "target" and function == "verify"]
    if len(verify_at) < 2:
        return float("nan"), {}
    total, calls = 0.0, {}
    for start, end in zip(verify_at, verify_at[1:], strict=False):
        for side, function, read in log[start + 1 : end]:
            if side == "drafter":
                total += read["weights"] + read["states"]
                calls[function] = calls.get(function, 0) + 1
    gaps = len(verify_at) - 1
    return total / gaps, {function: n / gaps for function, n in calls.items()}


def cost_model(log: list, tokens_per_round: float) -> dict:
    """The seed's model on a metered speculative run: costs in target decode calls, predicted speedup."""
    calls = per_call(log)
    decode, verify = calls["target.decode"]["total"], calls["target.verify"]["total"]
    drafter_bytes, drafter_calls = round_drafter_bytes(log)
    c_v, draft_cost = verify / decode, drafter_bytes / decode
    return {
        "bytes_per_call": calls,
        "verify_cost": c_v,
        "draft_cost": draft_cost,
        "drafter_calls_per_round": drafter_calls,
        "tokens_per_round": tokens_per_round,
        "predicted_speedup": tokens_per_round / (draft_cost + c_v),
        "model": "speedup = tokens per round / (draft cost + verify cost), costs = bytes read / target decode bytes",
    }


def ngram_speedup(stats: dict, verify_cost: float) -> float:
    """Prompt lookup drafts for free: its verify calls cost ``c_v``, its decode calls (no match) 1."""
    return stats["tokens"] / (stats["verify_calls"] * verify_cost + stats["decode_calls"])


def format_economics(economics: dict) -> str:
    calls = economics["bytes_per_call"]
    parts = [f"{key} {size_text(c['total'])} (weights {size_text(c['weights'])} + states "
             f"{size_text(c['states'])})" for key, c in calls.items()]
    per_round = ", ".join(f"{n:g} {f}" for f, n in economics["drafter_calls_per_round"].items())
    return (f"bytes read per call (weights as shipped + states): {'; '.join(parts)}\n"
            f"cost model (bandwidth-bound, in target decode calls): verify {economics['verify_cost']:.3f}, drafter "
            f"{economics['draft_cost']:.3f} per round ({per_round}) -> predicted speedup "
            f"{economics['tokens_per_round']:.3f} / ({economics['draft_cost']:.3f} + {economics['verify_cost']:.3f}) "
            f"= {economics['predicted_speedup']:.2f}x")
