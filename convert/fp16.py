"""True fp16 arithmetic in torch: products of fp16 tensors accumulated in fp16, as the device computes them.

torch's CPU kernels compute an fp16 matrix product with an fp32 accumulator and round once at the end, so fp16 torch
modules are more exact than the device. The Core AI runtime on a CPU with native fp16 (AVX512-FP16) rounds every
product and every partial sum to fp16; measured (``tests/test_fp16.py``, coreai-core 1.0.0b3): its fp16 linear and
matmul equal, bit for bit, the sequential sum over the inner dimension in which each product is rounded to fp16 and
each partial sum is rounded to fp16, while its depthwise conv1d equals torch's own bit for bit. So does the runtime on
an AMD EPYC with AVX-512 but without AVX512-FP16 (measured); the package check asks the runtime which it does
(``convert.verify.checks.like_the_runtime``) rather than guess from the CPU's flags.

``true_fp16()`` is a dispatch mode under which torch computes that way on any CPU: ``aten.mm``, ``bmm``, ``addmm``,
``baddbmm``, ``mv`` and ``dot`` of fp16 operands accumulate in fp16, in order. Elementwise fp16 ops already round their
result to fp16 in torch, as on the device. Every other reduction in our graphs (norms,
softmax, the delta rule) runs in fp32, where the device keeps fp32 too. It is slow (one elementwise op per inner
index): meant for the gates' and checks' references on small models and short sequences.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` ([..., M, K] @ [..., K, N], broadcast) with each product and each partial sum rounded to fp16."""
    a, b = a.unsqueeze(-1), b.unsqueeze(-3)  # [..., M, K, 1], [..., 1, K, N]
    total = a[..., 0, :] * b[..., 0, :]
    for k in range(1, a.shape[-2]):
        total = total + a[..., k, :] * b[..., k, :]
    return total


def _scaled(value: torch.Tensor, factor) -> torch.Tensor:
    return value if factor == 1 else value * factor


def _all_fp16(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float16 for t in tensors)


class TrueFp16(TorchDispatchMode):
    """Dispatch mode: fp16 matrix products accumulate in fp16 (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (aten.mm, aten.bmm) and _all_fp16(*args[:2]):
            return matmul(args[0], args[1])
        if packet is aten.mv and _all_fp16(*args[:2]):
            return matmul(args[0], args[1][:, None])[:, 0]
        if packet is aten.dot and _all_fp16(*args[:2]):
            return matmul(args[0][None], args[1][:, None])[0, 0]
        if packet in (aten.addmm, aten.baddbmm) and _all_fp16(*args[:3]):
            bias, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            return _scaled(matmul(a, b), alpha) + _scaled(bias, beta)
        return func(*args, **kwargs)


@contextmanager
def true_fp16(enabled: bool = True):
    """Run the body's fp16 products in true fp16 (``TrueFp16``); ``enabled=False`` runs torch's own kernels."""
    if not enabled:
        yield
        return
    with TrueFp16():
        yield


# ---- The devices' arithmetic (docs/fp16.md, "Device modes") ---------------------------------------------------------

PORT_LIMIT = 2.0**15  # the ANE's matmul / conv output port saturates here (M1, measured: half fp16's maximum)
FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504: a larger fp16 value is stored as inf
TILE = 4  # the ANE's first reduction stage: input lanes in tiles of four, each tile's sum rounded to fp16
DEVICES = ("ane", "gpu")


def limits(device: str) -> dict[str, float]:
    """The largest magnitude ``device`` holds, by ``Peaks`` kind: a product's input (stored fp16) and a module's output
    65,504; a product's port 32,768 on the ANE, 65,504 on the GPU (fp32 accumulation, stored fp16)."""
    return {"input": FP16_MAX, "port": PORT_LIMIT if device == "ane" else FP16_MAX, "output": FP16_MAX}
# one tile tensor of a product (fp16) holds at most this many elements: the rows are done in chunks past it
_CHUNK = 1 << 25
# the products the device modes compute their own way (the graphs' linears, convs and attention products)
_PRODUCTS = (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.mv, aten.dot, aten.convolution)


def ane_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The ANE's accumulator for ``a @ b`` ([..., M, K] @ [..., K, N], fp16), before its output port: the sum in fp32
    of ``ane_tiles``, a block of rows at a time. Returns fp32 [..., M, N]."""
    step = max(1, _CHUNK // max(1, -(-a.shape[-1] // TILE) * b.shape[-1] *
                                math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))))
    lanes = _b_lanes(b)  # once for every block of rows (a linear's weight: copied once a product, not once a row)
    return torch.cat([_tiles(_a_lanes(a[..., lo:lo + step, :]), lanes).sum(-3, dtype=torch.float32)
                      for lo in range(0, a.shape[-2], step)], dim=-2)


def ane_tiles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The ANE's first reduction stage for ``a @ b`` ([..., M, K] @ [..., K, N], fp16): the K products of each output
    in tiles of four consecutive lanes (K padded with zeros), each tile summed in order with every partial rounded to
    fp16, the first product too. Returns the tiles, fp16 [..., T, M, N] (T = K / 4, rounded up).

    Each step is one fp16 ``addcmul``: torch computes it in fp32 (the product of two fp16 values is exact there) and
    rounds the sum once to fp16, as ``ane_tiles_spelled_out`` does by hand (``tests/test_device_arithmetic.py`` checks
    the two agree bit for bit). A partial formed in fp32 before its rounding is a double rounding, which differs from
    one rounding of the exact sum only where the fp32 sum lands on an fp16 tie."""
    return _tiles(_a_lanes(a), _b_lanes(b))


def _a_lanes(a: torch.Tensor) -> torch.Tensor:
    """``a`` [..., M, K] as [..., T, M, 4], K padded with zeros, contiguous (the products below run on unit strides)."""
    return nn.functional.pad(a, (0, -a.shape[-1] % TILE)).unflatten(-1, (-1, TILE)).movedim(-2, -3).contiguous()


def _b_lanes(b: torch.Tensor) -> torch.Tensor:
    """``b`` [..., K, N] as [..., T, 4, N], K padded with zeros, contiguous."""
    return nn.functional.pad(b, (0, 0, 0, -b.shape[-2] % TILE)).unflatten(-2, (-1, TILE)).contiguous()


def _tiles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``ane_tiles`` of operands in lanes (``_a_lanes``, ``_b_lanes``)."""
    tiles = a[..., 0, None] * b[..., :, None, 0, :]  # the first product, rounded
    for lane in range(1, TILE):
        tiles.addcmul_(a[..., lane, None], b[..., :, None, lane, :])
    return tiles


def ane_tiles_spelled_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``ane_tiles`` by hand: each product formed in fp32 (exact), each partial rounded to fp16; fp32 [..., T, M, N]."""
    pad = -a.shape[-1] % TILE
    a = nn.functional.pad(a.float(), (0, pad)).unflatten(-1, (-1, TILE)).movedim(-2, -3)
    b = nn.functional.pad(b.float(), (0, 0, 0, pad)).unflatten(-2, (-1, TILE))
    tiles = None
    for lane in range(TILE):
        product = a[..., lane, None] * b[..., :, None, lane, :]
        tiles = (product if tiles is None else tiles + product).half().float()
    return tiles


def gpu_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Core ML on the GPU: fp16 operands, an fp32 accumulator (``allowLowPrecisionAccumulationOnGPU`` off, the
    default). Returns fp32 [..., M, N]."""
    return a.float() @ b.float()


def ane_port(accumulated: torch.Tensor) -> torch.Tensor:
    """The ANE's output port: one rounding to fp16, and a sum past +-32,768 saturates. We model the saturated port
    as +-inf (the pessimistic reading: what follows sees a value the model cannot have)."""
    out = accumulated.half()
    return torch.where(accumulated.abs() > PORT_LIMIT, torch.copysign(torch.full_like(out, math.inf), out), out)


def gpu_port(accumulated: torch.Tensor) -> torch.Tensor:
    """The GPU's result: one rounding to fp16 (past 65,504: inf)."""
    return accumulated.half()


class Peaks:
    """The largest magnitudes a run computes, by the module that computed them (its qualified name under the roots
    given, the innermost one running) and kind: ``input`` (the activations a matrix product or convolution reads: its
    first operand), ``port`` (its accumulated output, before the port rounds it), ``store`` (any other floating
    result: what the device stores) and ``output`` (what a module returned: a decoder layer's is the residual stream
    after it). Non-finite values are counted, not maxed."""

    KINDS = ("input", "port", "store", "output")

    def __init__(self, only: torch.dtype | None = None, stores: bool = False, hold: bool | None = None,
                 **roots: nn.Module):
        """``roots``: the modules whose names the peaks are noted under, each name prefixed with its keyword;
        ``only``: note stores and outputs of this dtype alone (a device pass: what the device holds in fp16);
        ``stores``: note every op's result too (kind ``store``; a pass with them is about a third slower);
        ``hold``: keep each peak and count as a tensor where it was computed until read (``_settle``); by default on
        an accelerator (on the CPU each is read at once: one pass over the values, not four)."""
        self.only, self.stores, self.hold = only, stores, hold
        self.names: dict[int, str] = {}
        self.name(**roots)
        self._peaks: dict[tuple[str, str], float] = {}
        self._nonfinite: dict[tuple[str, str], int] = {}
        self._held: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._running: list[str] = []

    @property
    def peaks(self) -> dict[tuple[str, str], float]:
        """The largest finite magnitude noted, by (module, kind)."""
        self._settle()
        return self._peaks

    @property
    def nonfinite(self) -> dict[tuple[str, str], int]:
        """How many non-finite values were noted, by (module, kind), where any were."""
        self._settle()
        return self._nonfinite

    def _settle(self) -> None:
        """An accelerator's peaks and counts, held there as they are noted (asking for each would wait on the device
        at every product: measured on an H100, the drafter's range spent two thirds of its time there), read back in
        one transfer each."""
        if not self._held:
            return
        keys = list(self._held)
        peaks = torch.stack([peak for peak, _ in self._held.values()]).cpu().tolist()
        bads = torch.stack([bad for _, bad in self._held.values()]).cpu().tolist()
        self._held = {}
        for key, peak, bad in zip(keys, peaks, bads, strict=True):
            self._peaks[key] = max(self._peaks.get(key, 0.0), peak)
            if bad:
                self._nonfinite[key] = self._nonfinite.get(key, 0) + int(bad)

    def name(self, renamed: dict[str, str] | None = None, own: bool = True, **roots: nn.Module) -> None:
        """Note the modules under ``roots`` (these alone from now on: a streamed stage names each piece it loads),
        each name prefixed with its keyword; ``renamed``: a name's leading components replaced (a piece's
        ``layers.0`` is the whole model's ``layers.7``); ``own``: the roots themselves too (a streamed piece's root
        returns what its last layer did)."""
        self.names = {}
        for prefix, root in roots.items():
            for name, module in root.named_modules():
                if not name and not own:
                    continue
                for old, new in (renamed or {}).items():
                    if name == old or name.startswith(f"{old}."):
                        name = new + name[len(old):]
                        break
                self.names.setdefault(id(module), f"{prefix}.{name}" if name else prefix)

    def where(self) -> str:
        return self._running[-1] if self._running else "(outside the modules)"

    def note(self, kind: str, value, where: str | None = None) -> None:
        """Record ``value``'s largest finite magnitude (tensors in a tuple, list or dict each)."""
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, (tuple, list)):
            for v in value:
                self.note(kind, v, where)
            return
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
            return
        if self.only is not None and value.dtype != self.only and kind != "port":  # a port holds the accumulator
            return
        key = (where or self.where(), kind)
        if self.hold or (self.hold is None and value.device.type != "cpu"):  # no wait for the device at each product
            value = value.detach()
            finite = torch.isfinite(value)
            peak = torch.where(finite, value.abs(), 0).amax().float()  # fp16 and fp32 values exactly
            bad = finite.numel() - finite.sum()
            held = self._held.get(key)
            self._held[key] = (peak, bad) if held is None else (torch.maximum(held[0], peak), held[1] + bad)
            return
        peak = float(torch.linalg.vector_norm(value.detach(), ord=math.inf))  # one pass; inf or nan if any is
        if not math.isfinite(peak):
            finite = torch.isfinite(value)
            self._nonfinite[key] = self._nonfinite.get(key, 0) + int(finite.numel() - finite.sum())
            value = value[finite]
            peak = float(value.abs().max()) if value.numel() else 0.0
        self._peaks[key] = max(self._peaks.get(key, 0.0), peak)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Modules' forwards push their names while they run, and their outputs are noted (kind ``output``)."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module, _inputs):
            name = self.names.get(id(module))
            if name is not None:
                self._running.append(name)

        def leave(module, _inputs, output):
            name = self.names.get(id(module))
            if name is not None:
                self._running.pop()
                self.note("output", output, name)

        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        _WATCHING.append(self)
        try:
            yield
        finally:
            _WATCHING.pop()
            for handle in handles:
                handle.remove()
            self._running.clear()


_WATCHING: list[Peaks] = []  # the Peaks whose ``watching`` is running, innermost last


def _watched(module: nn.Module) -> tuple[Peaks | None, str | None]:
    """The watching ``Peaks`` (innermost) and ``module``'s name there; (None, None) when nothing watches it."""
    peaks = _WATCHING[-1] if _WATCHING else None
    return (peaks, peaks.names.get(id(module))) if peaks is not None else (None, None)


@contextmanager
def within(module: nn.Module) -> Iterator[None]:
    """What the body computes is noted under ``module``'s name by the watching ``Peaks``, if any: for code that computes
    with a module's weights without calling its forward (the ane layout's 1x1 convolutions, its decoder loops)."""
    peaks, name = _watched(module)
    if name is None:
        yield
        return
    peaks._running.append(name)
    try:
        yield
    finally:
        peaks._running.pop()


def noted_output(module: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``value`` noted as ``module``'s output by the watching ``Peaks``, if any (a decoder layer's rows in a loop that
    does not call its forward); returns ``value``."""
    peaks, name = _watched(module)
    if name is not None:
        peaks.note("output", value, name)
    return value


def _fp16(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float16 for t in tensors)


def _pointwise_conv(x, weight, stride, padding, dilation, transposed, groups):
    """A convolution the device modes compute as a product: ``(operand [..., M, K], weight [K, N], back)`` where
    ``back`` takes the product [..., M, N] to the convolution's output; None for a form we do not model."""
    if transposed or any(s != 1 for s in stride) or any(d != 1 for d in dilation):
        return None
    kernel = weight.shape[2:]
    if groups == 1 and all(k == 1 for k in kernel) and all(p == 0 for p in padding):  # a 1x1 convolution
        rows = x.movedim(1, -1)  # [N, *spatial, C]
        return rows, weight.flatten(1).T, lambda out: out.movedim(-1, 1)
    if groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1 and len(kernel) == 1:  # depthwise conv1d
        taps = kernel[0]
        windows = nn.functional.pad(x, (padding[0], padding[0])).unfold(-1, taps, 1)  # [N, C, L, taps]
        return windows[..., None, :], weight[:, 0, :, None][:, None], lambda out: out[..., 0, 0]
    return None


class DeviceArithmetic(TorchDispatchMode):
    """Dispatch mode: fp16 matrix products and convolutions computed as ``device`` computes them (``ane``:
    ``ane_accumulate`` then ``ane_port``; ``gpu``: ``gpu_accumulate`` then ``gpu_port``), a bias added in fp16 after;
    every other op as torch computes it (an fp16 elementwise op rounds its result, as on the device). With ``peaks``,
    every product's accumulated output is noted (``port``) with its activations (``input``) and,
    where ``peaks.stores``, every other op's floating result (``store``): without a device, the mode only watches (the
    range of an fp32 run)."""

    def __init__(self, device: str | None, peaks: Peaks | None = None):
        super().__init__()
        if device is not None and device not in DEVICES:
            raise ValueError(f"device arithmetic {device!r}: one of {', '.join(DEVICES)}")
        self.device, self.peaks = device, peaks
        self.accumulate = {"ane": ane_accumulate, "gpu": gpu_accumulate, None: None}[device]
        self.port = {"ane": ane_port, "gpu": gpu_port, None: None}[device]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _PRODUCTS:
            out = self._product(packet, func, args, kwargs)
            if out is not None:
                return out
        out = func(*args, **kwargs)
        if self.peaks is not None and self.peaks.stores and not _aliases(func):
            self.peaks.note("store", out)
        return out

    def _product(self, packet, func, args, kwargs):
        operands, back, bias, alpha, beta = self._operands(packet, args, kwargs)
        if self.device is None or not _fp16(*operands):
            return self._torch_product(func, args, kwargs, operands[0])
        if self.peaks is not None:
            self.peaks.note("input", operands[0])  # the activations entering the product, as stored (fp16)
        accumulated = self.accumulate(*operands)
        if alpha != 1:
            accumulated = accumulated * alpha
        if self.peaks is not None:
            self.peaks.note("port", accumulated)
        out = self.port(accumulated)
        if back is not None:
            out = back(out)
        if bias is not None:
            out = out + (bias if beta == 1 else bias * beta).to(out.dtype)
        return out

    def _operands(self, packet, args, kwargs):
        """A product op's (matmul operands, what turns the matmul's output back into the op's or None, bias, alpha,
        beta)."""
        if packet in (aten.addmm, aten.baddbmm):
            bias, a, b = args[:3]
            return (a, b), None, bias, kwargs.get("alpha", 1), kwargs.get("beta", 1)
        if packet is aten.mv:
            return (args[0], args[1][:, None]), lambda out: out[..., 0], None, 1, 1
        if packet is aten.dot:
            return (args[0][None], args[1][:, None]), lambda out: out[0, 0], None, 1, 1
        if packet is aten.convolution:
            return self._convolution_operands(args)
        return tuple(args[:2]), None, None, 1, 1

    def _convolution_operands(self, args):
        """A convolution's, as a matmul where the device computes it (a pointwise one); its own where not."""
        x, weight, bias = args[:3]
        if self.device is None or not _fp16(x, weight):
            return (x, weight), None, bias, 1, 1
        formed = _pointwise_conv(x, weight, *args[3:6], args[6], args[8])
        if formed is None:
            raise NotImplementedError(f"device arithmetic: a convolution of weight {list(weight.shape)}, "
                                      f"groups {args[8]}, is not modelled")
        *operands, back = formed
        if bias is not None:
            bias = bias.reshape(-1, *[1] * (x.dim() - 2))
        return tuple(operands), back, bias, 1, 1

    def _torch_product(self, func, args, kwargs, operand):
        """A product torch computes itself (no device, or not fp16: the range of an fp32 run), its activations
        ``operand`` and its output noted; None (computed by the caller) when nothing watches."""
        if self.peaks is None:
            return None
        self.peaks.note("input", operand)
        out = func(*args, **kwargs)
        self.peaks.note("port", out)
        return out


def _aliases(func) -> bool:
    """Whether ``func`` returns a view or its input (nothing computed)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None


@contextmanager
def device_arithmetic(device: str | None, peaks: Peaks | None = None) -> Iterator[None]:
    """Run the body in ``device``'s arithmetic (``DeviceArithmetic``), noting ``peaks`` (and which module computed
    each) when given; ``device=None`` with ``peaks``: torch's own arithmetic, watched."""
    if device is None and peaks is None:
        yield
        return
    with DeviceArithmetic(device, peaks):
        if peaks is None:
            yield
        else:
            with peaks.watching():
                yield


# ---- The floor: fp16 storage of a product's input and nothing else (docs/fp16.md, "The floor") ----------------------

_PROJECTIONS = (nn.functional.linear, nn.functional.conv1d, nn.functional.conv2d)


class StoredInputs(TorchFunctionMode):
    """Torch function mode for fp32 modules: every linear's and convolution's input stored in fp16 first (the shipped
    weights are fp16 values already), all else in fp32: what any device that stores a projection's input in fp16
    cannot avoid, whatever form the rest of the graph takes. ``dither`` > 0 perturbs each input by a seeded uniform
    relative amount within half an fp16 step before it is stored: another realisation of the same storage error, so
    the spread over realisations is the fp32 function's own sensitivity to it."""

    def __init__(self, dither: int = 0):
        super().__init__()
        self.generator = torch.Generator().manual_seed(dither) if dither else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PROJECTIONS and args[0].dtype == torch.float32:
            x = args[0]
            if self.generator is not None:
                x = x * (1 + (torch.rand(x.shape, generator=self.generator) - 0.5) * 2.0**-11).to(x.device)
            args = (x.half().float(), *args[1:])
        return func(*args, **(kwargs or {}))
