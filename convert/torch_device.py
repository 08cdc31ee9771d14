"""Where the build's torch stages compute: ``--device auto|cpu|cuda|mps`` (the "torch device"; "device" alone means
the Apple device a package runs on, docs/development.md's glossary).

``resolve`` turns the option into a ``torch.device`` once, refusing one this machine does not have; the stages take
the result. fp32 on it is fp32: TF32 (which CUDA may use for fp32 matrix products and convolutions) is turned off, so
a gate computed on the GPU measures the same arithmetic as on the CPU, to the order in which sums are taken.
"""

from __future__ import annotations

import torch

from convert.errors import InputError

CHOICES = ("auto", "cpu", "cuda", "mps")
DEFAULT = "cpu"


def _available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return torch.backends.mps.is_available()
    return kind == "cpu"


def resolve(name: str | torch.device | None, where: str = "--device") -> torch.device:
    """The torch device ``name`` asks for (None: ``DEFAULT``); ``auto``: CUDA, else MPS, else the CPU. Refuses
    (``InputError`` naming ``where``) a kind this machine does not have."""
    if isinstance(name, torch.device):
        return name
    name = name or DEFAULT
    if name not in CHOICES:
        raise InputError(f"{where}: {name!r} is not one of {', '.join(CHOICES)}")
    if name == "auto":
        name = next(kind for kind in ("cuda", "mps", "cpu") if _available(kind))
    if not _available(name):
        raise InputError(f"{where} {name}: this machine has no {name} device torch can use (torch "
                         f"{torch.__version__}); use --device cpu or auto")
    device = torch.device(name)
    exact_fp32()
    return device


def exact_fp32() -> None:
    """fp32 products and convolutions in fp32 (no TF32) on CUDA: the gate's reference is fp32 arithmetic."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def describe(device: torch.device) -> str:
    """``cpu (16 threads)``, ``cuda (NVIDIA H100 80GB HBM3)``, ``mps``: what a plan and a log print."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return device.type


def cache_key(device: torch.device) -> dict:
    """The torch device in a build cache key of what a stage computed there (a GPU's fp32 sums in another order than
    the CPU's, its GPTQ's codes possibly in other last bits): its type, and nothing for the CPU, whose entries keep
    the keys they had."""
    return {} if device.type == "cpu" else {"torch_device": device.type}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a stage's timing ends after its last kernel)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def free_bytes(device: torch.device) -> int:
    """The memory ``device`` has free now (0 for the CPU, whose memory the recipe's ``max_host_memory_gb`` sets)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return max(0, torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return 0
