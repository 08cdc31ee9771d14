"""Function-preserving rescales that keep what the devices compute inside fp16's range and the ANE's output port.

Real checkpoints carry residual streams and MLP intermediates of 1e3-1e5 (massive activations); the device stores
fp16 (65,504 at most) and the ANE's matmul / conv port saturates at 32,768 (``convert.fp16``). The peaks of every
product's input and port and every module's output are measured on the fp32 modules (``convert.verify.gates``,
``measure_range``), then ``choose`` picks powers of two that bring each class of tensor inside its limit with
``HEADROOM`` to spare. The modules that ship are then read again with the scales folded: each weight multiplied in
fp32 as it is read from the checkpoint, before the cast to fp16 and before quantization (``weight_factors``; a power of
two, so exact there), and the norms' eps and the embedding rows' multiplier set (``fold_constants``).

- **The residual stream** times ``2**-residual``: the embedding rows as they enter the first layer (one multiply in the
  graph after the lookup, or on the host's rows in the ane layout: the table, a tied head and the host's lookup stay as
  the checkpoint has them), every block's last linear (o_proj, a linear attention's out_proj, down_proj: the family's
  ``cached_blocks``) and the eps of every norm that reads the stream (the final norm's too) times the scale's square,
  so RMSNorm sees the same normalised rows and the logits and ``hidden`` are unchanged. The taps the target returns
  are the scaled stream (the manifest's ``taps.scale``: a DFlash2 drafter's ``fc`` reads them so, its
  ``hidden_norm`` taking the same eps fold); rows passed from part to part are too.
- **The MLP intermediate** of layer i divided by ``2**mlp[i]``: up_proj divided, down_proj multiplied (the family's
  ``MLP_REBALANCE``: ``act(gate) * up`` is linear in up).
- **A drafter's residual stream** (``drafter_classes``: its ``fc``, its layers' outputs and writers), measured over a
  speculative run and folded by its family's ``build_modules`` (``convert.pipeline.drafter.range_scale``).

A tensor past its limit that neither scale reaches (a gate_proj's port, q / k / v, the logits) is refused
(``RangeError``: the tensor, its peak, its limit; nothing is published).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from convert.errors import GateError
from convert.fp16 import Peaks, limits
from convert.models import family_of
from convert.models.part import stream_norms

HEADROOM = 4.0  # every rescaled tensor's peak at most its limit / HEADROOM on the data measured
RESIDUAL, MLP = "residual", "mlp"
SHOWN = 8  # the tightest tensors the record keeps


class RangeError(GateError):
    """A tensor past its device limit that no function-preserving rescale reaches."""


@dataclass(frozen=True)
class Scales:
    """The exponents the fold applies: the residual stream times ``2**-residual``, layer i's MLP intermediate divided by
    ``2**mlp[i]`` (decoder layers numbered in the whole target)."""

    residual: int = 0
    mlp: dict[int, int] = field(default_factory=dict)

    @property
    def residual_scale(self) -> float:
        return 2.0 ** -self.residual

    def mlp_scale(self, layer: int) -> float:
        return 2.0 ** self.mlp.get(layer, 0)

    @property
    def identity(self) -> bool:
        return self.residual == 0 and not any(self.mlp.values())


@dataclass(frozen=True)
class Entry:
    """One measured tensor: its module (qualified name, ``Peaks``' root prefix kept), kind, fp32 peak, device limit,
    and its peak once ``Scales`` are folded."""

    tensor: str
    kind: str
    peak: float
    limit: float
    scaled: float

    def record(self) -> dict:
        return {"tensor": self.tensor, "kind": self.kind, "peak": self.peak, "limit": self.limit,
                "scaled": self.scaled}


def classes(core: nn.Module, prefix: str) -> dict[tuple[str, str], tuple[str, int]]:
    """Which scale reaches each (module name, ``Peaks`` kind) of a target ``core`` (named under ``prefix``):
    (``RESIDUAL``, -1) or (``MLP``, layer); what is not listed neither does."""
    fam = family_of(core.args)
    up, down = fam.MLP_REBALANCE
    reached: dict[tuple[str, str], tuple[str, int]] = {}
    for j, (i, layer) in enumerate(zip(core.part.layer_indices, core.layers, strict=True)):
        base = f"{prefix}.layers.{j}"
        _residual(reached, base, fam.cached_blocks(core, layer))
        for kind in ("port", "output"):
            reached[(f"{base}.{up}", kind)] = (MLP, i)
        reached[(f"{base}.{down}", "input")] = (MLP, i)
    return reached


DRAFTER_BLOCKS = (("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj"))  # a draft or MTP layer's writers


def drafter_classes(core: nn.Module, prefix: str) -> dict[tuple[str, str], tuple[str, int]]:
    """``classes`` of a drafter's core (DFlash2 or MTP): its ``fc`` (the stream's start: the taps, or the embedding
    and hidden rows, through it), every layer's output and residual writers take the drafter's one scale."""
    reached = {(f"{prefix}.fc", kind): (RESIDUAL, -1) for kind in ("port", "output")}
    for j in range(len(core.layers)):
        _residual(reached, f"{prefix}.layers.{j}", DRAFTER_BLOCKS)
    return reached


def _residual(reached: dict, base: str, blocks) -> None:
    reached[(base, "output")] = (RESIDUAL, -1)
    for block, last in blocks:
        reached[(f"{base}.{block}", "output")] = (RESIDUAL, -1)
        for kind in ("port", "output"):
            reached[(f"{base}.{last}", kind)] = (RESIDUAL, -1)


def _exponent(peak: float, limit: float) -> int:
    """The least k >= 0 with peak / 2**k <= limit / HEADROOM."""
    if peak <= 0 or not math.isfinite(peak):
        return 0
    return max(0, math.ceil(math.log2(peak * HEADROOM / limit)))


def choose(peaks: Peaks, device: str, reached: dict[tuple[str, str], tuple[str, int]],
           prefix: str) -> tuple[Scales, list[Entry]]:
    """The least scales that bring every tensor they reach (``reached``: ``classes`` or ``drafter_classes``) within
    its ``device`` limit / ``HEADROOM`` on the measured ``peaks`` (an fp32 run of a core named under ``prefix``; what
    ran outside it is not judged), and every judged entry with its scaled peak, tightest first. Raises ``RangeError``
    for a tensor past its limit that no scale reaches (a non-finite fp32 value too)."""
    bounds = limits(device)
    residual, mlp = 0, {}
    measured = [(key, peak) for key, peak in peaks.peaks.items()
                if key[1] in bounds and key[0].startswith(f"{prefix}.")]
    for (name, kind), peak in measured:
        if peaks.nonfinite.get((name, kind)):
            raise RangeError(f"range: {name} ({kind}) is not finite in fp32 ({peaks.nonfinite[(name, kind)]} values "
                             "inf or NaN on the data measured): the checkpoint itself overflows; nothing was published")
        what, layer = reached.get((name, kind), (None, -1))
        need = _exponent(peak, bounds[kind])
        if what == RESIDUAL:
            residual = max(residual, need)
        elif what == MLP:
            mlp[layer] = max(mlp.get(layer, 0), need)
    scales = Scales(residual, {k: v for k, v in sorted(mlp.items()) if v})
    entries = []
    for (name, kind), peak in measured:
        what, layer = reached.get((name, kind), (None, -1))
        factor = scales.residual_scale if what == RESIDUAL else 1 / scales.mlp_scale(layer) if what == MLP else 1.0
        entries.append(Entry(name, kind, peak, bounds[kind], peak * factor))
    entries.sort(key=lambda e: e.limit / e.scaled if e.scaled > 0 else math.inf)
    over = [e for e in entries if e.scaled > e.limit]
    if over:
        first = over[0]
        raise RangeError(
            f"range ({device}): {first.tensor} ({first.kind}) peaks at {first.peak:.6g} on the data measured in fp32, "
            f"past the device's limit {first.limit:.6g}, and no function-preserving rescale reaches it (the residual "
            f"stream's and the MLP's scales do not); {len(over)} tensors over; nothing was published")
    return scales, entries


def weight_factors(core: nn.Module, scales: Scales) -> dict[str, float]:
    """What each of ``core``'s parameters (by name in ``core``) is multiplied by as it is read from the checkpoint, in
    fp32 before the cast to fp16 (a weight divided by a large factor in the checkpoint comes back whole) and before
    any quantization (whose tables then hold the folded weight); parameters not listed: 1."""
    if scales.identity:
        return {}
    fam = family_of(core.args)
    up, down = fam.MLP_REBALANCE
    s = scales.residual_scale
    factors: dict[str, float] = {}
    for j, (i, layer) in enumerate(zip(core.part.layer_indices, core.layers, strict=True)):
        b = scales.mlp_scale(i)
        linears = {last: s * b if last == down else s for _, last in fam.cached_blocks(core, layer)}
        linears[up] = 1 / b
        for name, factor in linears.items():
            if factor != 1:
                for parameter, _ in layer.get_submodule(name).named_parameters():
                    factors[f"layers.{j}.{name}.{parameter}"] = factor
    return factors


def module_factors(core: nn.Module, scales: Scales) -> dict[str, float]:
    """``weight_factors`` by module name (``layers.3.mlp.down_proj``): what a linear's whole weight is multiplied by."""
    return {name.removesuffix(".weight"): f for name, f in weight_factors(core, scales).items()
            if name.endswith(".weight")}


def exactly_scaled(values: torch.Tensor, factor: float, tensor: str) -> torch.Tensor:
    """``values`` (fp16: a pack's group scales) times the power of two ``factor``, refused (``RangeError``) where fp16
    cannot hold a product exactly (past 65,504, or below its normal range where bits are lost): the fold must not
    change the pack's function."""
    scaled = values.float() * factor
    stored = scaled.to(values.dtype)
    if not (torch.isfinite(stored).all() and torch.equal(stored.float(), scaled)):
        lost = (stored.float() != scaled).sum().item()
        raise RangeError(f"{tensor}: its scales times {factor:g} (the range fold) are not exact in {values.dtype} "
                         f"({lost} of {scaled.numel()} values change); set target.rescale: false to ship the pack's "
                         "magnitudes as they are (the device pass judges them)")
    return stored


def fold_constants(core: nn.Module, scales: Scales) -> None:
    """The fold's part that is not a weight, on ``core`` in place (once, on a core whose weights are read with
    ``weight_factors``): the embedding rows' multiplier and every residual-reading norm's eps times the scale's
    square."""
    if scales.identity:
        return
    s = scales.residual_scale
    if core.part.embedding is not None:
        core.residual_scale = s
    for norm in stream_norms(core):
        norm.eps *= s * s


def lines(scales: Scales, entries: list[Entry], device: str, stream: str = "residual stream") -> list[str]:
    """The build log's and the report's account: the chosen scales (``stream``: whose residual stream), then the
    tightest tensors after them."""
    mlp = ", ".join(f"layer {i}: 1/{2**e}" for i, e in scales.mlp.items()) or "none"
    out = [f"range ({device}, headroom {HEADROOM:g}x): {stream} x 1/{2**scales.residual}, MLP intermediate {mlp}"]
    for e in entries[:SHOWN]:
        out.append(f"  {e.tensor} ({e.kind}): peak {e.peak:.6g} -> {e.scaled:.6g}, limit {e.limit:.6g} "
                   f"({e.limit / e.scaled if e.scaled else math.inf:.3g}x)")
    return out


def record(scales: Scales, entries: list[Entry], device: str, windows: int) -> dict:
    """The manifest's ``rescale`` (``manifests.schema.Rescale``)."""
    return {"device": device, "headroom": HEADROOM, "windows": windows, "residual_scale": scales.residual_scale,
            "mlp_scales": {str(i): 2.0**e for i, e in scales.mlp.items()},
            "tightest": [e.record() for e in entries[:SHOWN]]}
