"""True fp16 arithmetic in torch: products of fp16 tensors accumulated in fp16, as the device computes them.

torch's CPU kernels compute an fp16 matrix product with an fp32 accumulator and round once at the end, so fp16 torch
modules are more exact than the device. The Core AI runtime on a CPU with native fp16 (AVX512-FP16) rounds every
product and every partial sum to fp16; measured (``tests/test_fp16.py``, coreai-core 1.0.0b3): its fp16 linear and
matmul equal, bit for bit, the sequential sum over the inner dimension in which each product is rounded to fp16 and
each partial sum is rounded to fp16, while its depthwise conv1d equals torch's own bit for bit. On a CPU without native
fp16 the same runtime computes closer to torch.

``true_fp16()`` is a dispatch mode under which torch computes that way on any CPU: ``aten.mm``, ``bmm``, ``addmm``,
``baddbmm``, ``mv`` and ``dot`` of fp16 operands accumulate in fp16, in order. Elementwise fp16 ops already round their
result to fp16 in torch, as on the device. Every other reduction in our graphs (norms,
softmax, the delta rule) runs in fp32, where the device keeps fp32 too. It is slow (one elementwise op per inner
index): meant for the gates' and checks' references on small models and short sequences.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
CPUINFO = Path("/proc/cpuinfo")


@cache
def native_fp16_cpu() -> bool:
    """Whether this CPU computes fp16 natively (AVX512-FP16): then the Core AI runtime accumulates in fp16."""
    try:
        return "avx512_fp16" in CPUINFO.read_text().split()
    except OSError:
        return False


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


def like_the_runtime():
    """The arithmetic of this CPU's Core AI runtime, for the torch side of a package check: true fp16 where the CPU
    computes fp16 natively, torch's own kernels elsewhere (``native_fp16_cpu``). The check then compares a package
    with the modules computing as the runtime does, on either kind of CPU."""
    return true_fp16(native_fp16_cpu())
