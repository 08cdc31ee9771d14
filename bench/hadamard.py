"""The three forms of ``convert/export/hadamard.py``'s ``SignedHadamard`` at the Ternary Bonsai 2 27B shapes, and their
graphs.

First table, torch on CPU: for each form, input width n (5120, 6144, 17408; block 1024) and rows S (1, 8, 64), the
largest |error| against the fp64 formula (``convert/inputs/prism.py``'s ``hadamard``), over both directions (forward
``H(s * x)`` and inverse ``s * H(x)``), for seeded N(0, 1) inputs: computed in fp32, and in fp16 against the fp16
input's exact transform, beside the fp16 floor (that exact value rounded to fp16 once, as MLX's fp32 transform and
cast back would give at best). Then the multiply-adds per token and the fp16 bytes of the constants (the signs,
2n bytes, are the same in every form and left out). torch on CPU accumulates an fp16 matmul in fp32.

Second table: each form packaged in fp16 (forward, S = 8) with the repo's backends at n = 256, block 64 (the tiny
packs) and n = 5120, block 1024: the ops of the Core AI graph and of the Core ML program by type (constants apart),
and the largest |error| against the fp64 formula of the Core AI runtime (the Linux runtime emulates fp16) and of
torch in fp16, on one seeded input.

    PYTHONPATH=. .venv/bin/python -m bench.hadamard [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from convert.backends import coreai, coreml
from convert.export.hadamard import FORMS, SignedHadamard, kronecker_factors
from convert.export.spec import FunctionSpec, TensorSpec
from quant.types import hadamard

WIDTHS = (5120, 6144, 17408)
BLOCK = 1024
ROWS = (1, 8, 64)
PACKAGED = ((256, 64), (5120, 1024))
PACKAGED_ROWS = 8
NOT_COUNTED = ("constant", "const", "output")  # constants, and the graph terminator


def random_signs(width: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (width,), generator=generator).float() * 2 - 1


def exact(x: torch.Tensor, signs: torch.Tensor, block: int, inverse: bool) -> torch.Tensor:
    """The fp64 formula: ``H(s * x)`` or ``s * H(x)``, ``H`` the normalised Sylvester matrix per block."""
    x, signs = x.double(), signs.double()
    if not inverse:
        x = x * signs
    turned = (x.unflatten(-1, (-1, block)) @ hadamard(block)).flatten(-2)
    return turned * signs if inverse else turned


def errors(form: str, signs: torch.Tensor, rows: int, generator: torch.Generator) -> dict[str, float]:
    """Largest |error| over both directions in fp32 and in fp16, and the fp16 floor (the exact value rounded once)."""
    x = torch.randn(rows, signs.numel(), generator=generator)
    found = {"fp32": 0.0, "fp16": 0.0, "fp16 floor": 0.0}
    for inverse in (False, True):
        module = SignedHadamard(signs, BLOCK, inverse, form)
        with torch.no_grad():
            found["fp32"] = max(found["fp32"], largest(module(x), exact(x, signs, BLOCK, inverse)))
            half = x.half()
            want = exact(half, signs, BLOCK, inverse)
            found["fp16"] = max(found["fp16"], largest(module.half()(half), want))
        found["fp16 floor"] = max(found["fp16 floor"], largest(want.half(), want))
    return found


def largest(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max())


def multiply_adds(form: str, width: int, block: int) -> int:
    """Per token, the signs' multiply included; an add or a scale counts as one."""
    if form == "matmul":
        return width * block + width
    if form == "kronecker":
        left, right = kronecker_factors(block)
        return width * (left.shape[0] + right.shape[0]) + width
    return width * (block.bit_length() - 1) + 2 * width


def constant_bytes(form: str, block: int) -> int:
    """fp16 bytes of the transform's constants (the signs apart)."""
    if form == "matmul":
        return 2 * block * block
    if form == "kronecker":
        return 2 * sum(factor.numel() for factor in kronecker_factors(block))
    return 0


class Packaged(nn.Module):
    """The transform as a package function: one input ``x``, a tuple with one output."""

    def __init__(self, transform: SignedHadamard):
        super().__init__()
        self.transform = transform

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.transform(x),)


def package_both(form: str, signs: torch.Tensor, block: int, directory: Path) -> tuple[Path, Path, nn.Module]:
    module = Packaged(SignedHadamard(signs, block, form=form)).half()
    shape = (1, PACKAGED_ROWS, signs.numel())
    spec = FunctionSpec("main", (TensorSpec("x", shape, "float16"),), (TensorSpec("y", shape, "float16"),))
    aimodel, mlpackage = directory / f"{form}.aimodel", directory / f"{form}.mlpackage"
    with contextlib.redirect_stdout(sys.stderr):  # coreai-torch prints its progress there: keep the table whole
        coreai.package({"main": (module, spec)}, aimodel)
    coreml.package({"main": (module, spec)}, mlpackage)
    return aimodel, mlpackage, module


def coreai_ops(path: Path) -> Counter:
    """The ops of the asset's graphs by type, as ``coreai.operation_types`` reads them, counted."""
    module = coreai._mlir_module(coreai.AIModelAsset.load(path).program)
    found = Counter()
    with module.context:
        for graph in module.body.operations:
            if graph.name == "coreai.graph":
                found.update(op.name.rsplit(".", 1)[-1] for op in graph.regions[0].blocks[0].operations)
    return found


def coreml_ops(path: Path) -> Counter:
    """The ops of the package's program by type (every function, every block specialisation), counted."""
    found = Counter()
    for function in coreml.ct.models.MLModel(str(path), skip_model_load=True).get_spec().mlProgram.functions.values():
        for block in function.block_specializations.values():
            found.update(op.type for op in block.operations)
    return found


def op_text(ops: Counter) -> str:
    compute = {name: count for name, count in sorted(ops.items()) if name not in NOT_COUNTED}
    listed = ", ".join(f"{name} {count}" for name, count in compute.items())
    return f"{sum(compute.values())}: {listed}"


def packaged_errors(aimodel: Path, module: nn.Module, signs: torch.Tensor, block: int,
                    generator: torch.Generator) -> tuple[float, float, float, float]:
    """Largest |error| against the fp64 formula of the Core AI runtime and of torch, on one seeded fp16 input, the
    fp16 floor, and the runtime call's seconds."""
    x = torch.randn(1, PACKAGED_ROWS, signs.numel(), generator=generator).half()
    want = exact(x, signs, block, inverse=False)
    with coreai.open_session(aimodel) as session:
        start = time.perf_counter()
        got = session.call("main", {"x": x.numpy()})["y"]
        seconds = time.perf_counter() - start
    with torch.no_grad():
        torch_error = largest(module(x)[0], want)
    return largest(torch.from_numpy(got), want), torch_error, largest(want.half(), want), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    generator = torch.Generator().manual_seed(0)
    signs = {width: random_signs(width, generator) for width in WIDTHS}
    start = time.perf_counter()
    print(f"block {BLOCK}; inputs N(0, 1); {platform.processor() or platform.machine()}, {options.threads} threads")
    print("| form | n | S | max err fp32 | max err fp16 | fp16 floor | fp16 / floor | MACs/token | constant bytes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for form in FORMS:
        for width in WIDTHS:
            for rows in ROWS:
                found = errors(form, signs[width], rows, generator)
                print(f"| {form} | {width} | {rows} | {found['fp32']:.2e} | {found['fp16']:.2e} | "
                      f"{found['fp16 floor']:.2e} | {found['fp16'] / found['fp16 floor']:.2f} | "
                      f"{multiply_adds(form, width, BLOCK):,} | {constant_bytes(form, BLOCK):,} |")
    print(f"\npackaged fp16, forward, S = {PACKAGED_ROWS}: ops by type (constants apart), max err vs fp64")
    print("| form | n | block | Core AI ops | Core ML ops | Core AI runtime | torch fp16 | fp16 floor | runtime s |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for width, block in PACKAGED:
        packed_signs = random_signs(width, generator)
        for form in FORMS:
            with tempfile.TemporaryDirectory(prefix="bench-hadamard-") as tmp:
                aimodel, mlpackage, module = package_both(form, packed_signs, block, Path(tmp))
                runtime, torch_fp16, floor, seconds = packaged_errors(aimodel, module, packed_signs, block, generator)
                print(f"| {form} | {width} | {block} | {op_text(coreai_ops(aimodel))} | "
                      f"{op_text(coreml_ops(mlpackage))} | {runtime:.2e} | {torch_fp16:.2e} | "
                      f"{floor:.2e} | {seconds:.2f} |")
    print(f"\n{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
