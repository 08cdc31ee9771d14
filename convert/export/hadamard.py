"""The signed blockwise Walsh-Hadamard transform of a Prism pack (``convert/inputs/prism.py``) as a graph module.

A rotated linear computes ``y = W' . H(s * x)`` and the rotated embedding turns a looked-up row ``r`` into
``s * H(r)``; ``H`` is the normalised Sylvester transform of each block of ``block`` consecutive features
(``convert/inputs/prism.py`` says where this comes from). ``SignedHadamard`` computes either direction in the dtype of
its input, its constants cast to it: fp16 in the packages, where they are exact (the signs +-1, the butterflies' scale
1/sqrt(block), a power of two at the 27B block of 1024), and fp32 when the gates run the modules in fp32.
MLX computes the transform in fp32 and rounds to fp16 once; the fp16 graph rounds inside and after each product.

Three forms, measured by ``bench/hadamard.py`` at the 27B widths (n 5120, 6144, 17408; block 1024; S 1 to 64 rows;
N(0, 1) inputs; errors against the fp64 formula, "floor" the fp16 rounding of the exact value):

* ``kronecker``: ``H_b = H_b1 (x) H_b2``, b1 = b2 = 32, two small matmuls on the [..., n/b, b1, b2]
  view. fp32 within 1.5e-6; fp16 within 1.65x the floor in torch, which accumulates an fp16 matmul in fp32, and
  8.7x (8.5e-3, n 5120, S 8) on the Linux Core AI runtime, which accumulates it in fp16 (2048 plus 63 ones sums to
  2048 there); 64 multiply-adds a feature; 4 KiB of fp16 constants; 8 ops in the Core AI graph, 6 in Core ML's.
* ``matmul``: one b x b matmul on the [..., n/b, b] view. At the floor in torch but 21x it on the Core AI runtime
  (3.7e-2: 1024-term fp16 sums); 1024 multiply-adds a feature (18M a token at n 17408, a fifth of that width's
  down projection); a 2 MiB constant; 4 ops.
* ``butterfly`` (the default): log2(b) add/sub stages (no constant, 10 adds a feature), then the scale.
  Elementwise, so it rounds the same everywhere: 1.7-3.6x the floor in torch, 2.6x on the runtime (3.5e-3); but
  54 ops in either format.

The butterflies ship: they are the closest under fp16 accumulation, where it matters. Inside a model the Kronecker
form's error grows: a tiny Ternary Bonsai pack built as parts (tests/test_exact_build.py) had its Gated DeltaNet
layer part's rows on the Core AI runtime 3.7% (relative) off the torch part's in verify with the Kronecker form, over
the package check's 2% bound, and within it with the butterflies. They cost more ops in the graph (54 a transform at
block 1024, against 8) and no constant; the Kronecker form stays measured beside them.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from quant.types import Rotation, hadamard

FORMS = ("kronecker", "matmul", "butterfly")


class SignedHadamard(nn.Module):
    """[..., n] -> [..., n]: ``H(s * x)``, or ``s * H(x)`` when ``inverse`` (``H`` is its own inverse), ``n`` the
    width of ``signs``. The buffers are fp32; ``.to(dtype)`` or the input's dtype sets what it computes in."""

    def __init__(self, signs: torch.Tensor, block: int, inverse: bool = False, form: str = "butterfly"):
        super().__init__()
        check_signs(signs)
        check_block(block, signs.numel())
        if form not in FORMS:
            raise ValueError(f"Hadamard form {form!r} is not one of {FORMS}")
        self.width, self.block, self.inverse, self.form = signs.numel(), block, inverse, form
        self.register_buffer("signs", signs.detach().float().clone())
        if form == "matmul":
            self.register_buffer("hadamard", hadamard(block).float())
        elif form == "kronecker":
            left, right = kronecker_factors(block)
            self.orders = (left.shape[0], right.shape[0])
            self.register_buffer("left", left)
            self.register_buffer("right", right)

    def rotation(self) -> Rotation:
        """The transform as ``quant.types.Rotation`` (its signs and block)."""
        return Rotation(self.signs.float(), self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        signs = self.signs.to(x.dtype)
        if self.inverse:
            return self.transform(x) * signs
        return self.transform(x * signs)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """H per block. The views use the module's own sizes: sizes read from ``x.shape`` trace into int ops that
        coremltools cannot convert."""
        blocks = x.unflatten(-1, (self.width // self.block, self.block))
        if self.form == "matmul":
            return (blocks @ self.hadamard.to(x.dtype)).flatten(-2)
        if self.form == "kronecker":
            return kronecker(blocks.unflatten(-1, self.orders), self.left.to(x.dtype), self.right.to(x.dtype))
        return (butterflies(blocks, self.block) * (1 / math.sqrt(self.block))).flatten(-2)


def as_products(core: nn.Module) -> None:
    """Each ``SignedHadamard`` of ``core`` computed as one product by its block's matrix (the ``matmul`` form): on an
    accelerator one kernel where the butterflies launch 31 (a compute copy's Python dispatch is what its calls wait
    on there), the same transform within fp32's rounding (the module docstring: at the floor in torch). For an fp32
    compute copy on an accelerator (the gate's candidate, ``verify/gates.py``), never a package: the butterflies
    ship."""
    for module in core.modules():
        if isinstance(module, SignedHadamard) and module.form != "matmul":
            module.register_buffer("hadamard", _matrix(module.block, module.signs.device))
            module.form = "matmul"


@functools.lru_cache(maxsize=8)
def _matrix(block: int, device: torch.device) -> torch.Tensor:
    """A block's fp32 Hadamard matrix on ``device``, made once and shared by every rotation of that block (read
    only; py-spy on an H100: making it again for each rotation of each piece loaded took 14% of the gate's
    candidate)."""
    return hadamard(block).float().to(device)


def check_signs(signs: torch.Tensor) -> None:
    if signs.dim() != 1 or signs.numel() == 0:
        raise ValueError(f"signs must be one vector of the input width, not a tensor of shape {list(signs.shape)}")
    if not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError(f"the signs of width {signs.numel()} hold values other than -1 and +1")


def check_block(block: int, width: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"Hadamard block {block} is not a power of two")
    if width % block:
        raise ValueError(f"Hadamard block {block} does not divide the width {width}")


def kronecker_factors(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``H_block = left (x) right``, fp32, orders near sqrt(block): ``left`` the +-1 Sylvester matrix, ``right``
    the one with entries +-1/sqrt(block). ``right`` carries the whole normalisation, so ``right`` is applied first and
    its product, an average of its inputs, never outgrows them in fp16."""
    left_order = 2 ** (block.bit_length() // 2)
    right_order = block // left_order
    return hadamard(left_order).sign().float(), (hadamard(right_order).sign() / math.sqrt(block)).float()


def kronecker(pairs: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ P @ right`` for each [b1, b2] block ``P`` (left symmetric), flattened back to [..., n]. The left
    product is a right product between transposes: ``left @ A`` would export as a batched matmul with ``left``
    broadcast, which coreai-torch stores expanded (80 KiB at width 5120, 8 rows); ``contiguous`` makes torch
    export the second product as one matmul too."""
    turned = (pairs @ right).transpose(-1, -2).contiguous() @ left
    return turned.transpose(-1, -2).flatten(-3)


def butterflies(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """The unnormalised transform of the last axis (of size ``block``) in log2(block) identical stages: the sums of
    the even and odd entries, then their differences (the constant-geometry form, which gives the Sylvester order).
    The sums reach sqrt(block) times the normalised output, so in fp16 an output above 65504 / sqrt(block) overflows."""
    for _ in range(block.bit_length() - 1):
        even, odd = blocks[..., 0::2], blocks[..., 1::2]
        blocks = torch.cat([even + odd, even - odd], dim=-1)
    return blocks


