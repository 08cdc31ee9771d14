"""convert/export/hadamard.py: every form of ``SignedHadamard`` computes the fp64 formula of convert/inputs/prism.py in
fp32, both directions, and undoes itself; malformed signs and blocks are refused; the default form packaged in fp16 (the
tiny packs' width 256, block 64) runs on the Core AI runtime as torch computes it, and the Core ML package ships its
signs and Kronecker factors bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from convert.backends import coreai, coreml
from convert.export.hadamard import FORMS, SignedHadamard, kronecker_factors
from convert.export.spec import FunctionSpec, TensorSpec
from quant.types import hadamard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Measured by bench/hadamard.py (N(0, 1) inputs, every form, n up to 17408, block 1024): fp32 within 1.9e-6.
FP32_BOUND = 5e-6
# Measured (4 seeds, S 2 to 64, outputs up to 4.3): the Core AI runtime's fp16 is within 5.9e-3 of torch's fp16
# (3.9e-3 at S = 2: two fp16 spacings at 2..4) and within 5.1e-3 of the fp64 formula; its emulated fp16 matmuls
# round differently from torch's, which accumulates in fp32.
FP16_RUNTIME_BOUND = 8e-3
SHAPES = ((256, 64), (5120, 1024))
TINY_WIDTH, TINY_BLOCK, TINY_ROWS = 256, 64, 2


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def random_signs(width: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2, (width,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1


def exact(x: torch.Tensor, signs: torch.Tensor, block: int, inverse: bool) -> torch.Tensor:
    """``H(s * x)`` or ``s * H(x)`` in fp64, ``H`` the normalised Sylvester matrix per block of features."""
    x, signs = x.double(), signs.double()
    if not inverse:
        x = x * signs
    turned = (x.unflatten(-1, (-1, block)) @ hadamard(block)).flatten(-2)
    return turned * signs if inverse else turned


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_computes_the_formula_in_fp32(form, inverse):
    for width, block in SHAPES:
        signs, x = random_signs(width), seeded(1, 8, width)
        module = SignedHadamard(signs, block, inverse, form)
        with torch.no_grad():
            got = module(x)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert (got.double() - exact(x, signs, block, inverse)).abs().max() < FP32_BOUND, (width, block)


@pytest.mark.parametrize("form", FORMS)
def test_inverse_undoes_forward(form):
    signs, x = random_signs(5120), seeded(2, 3, 5120)
    forward, inverse = SignedHadamard(signs, 1024, form=form), SignedHadamard(signs, 1024, True, form)
    with torch.no_grad():
        assert (inverse(forward(x)) - x).abs().max() < FP32_BOUND


def test_the_kronecker_factors_multiply_to_the_hadamard_matrix():
    for block in (64, 512, 1024):
        left, right = kronecker_factors(block)
        assert left.abs().eq(1).all() and right.abs().eq(right.abs()[0, 0]).all()
        assert torch.allclose(torch.kron(left.double(), right.double()), hadamard(block), atol=1e-7), block


@pytest.mark.parametrize("signs, block, message", [
    (torch.tensor([1.0, -1.0, 0.0, 1.0]), 2, r"the signs of width 4 hold values other than -1 and \+1"),
    (torch.ones(2, 4), 2, r"signs must be one vector of the input width, not a tensor of shape \[2, 4\]"),
    (torch.ones(1536), 1024, "Hadamard block 1024 does not divide the width 1536"),
    (torch.ones(768), 96, "Hadamard block 96 is not a power of two"),
])
def test_bad_signs_and_blocks_are_refused(signs, block, message):
    with pytest.raises(ValueError, match=message):
        SignedHadamard(signs, block)


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="Hadamard form 'fft' is not one of"):
        SignedHadamard(torch.ones(64), 64, form="fft")


class Packaged(nn.Module):
    def __init__(self, transform: SignedHadamard):
        super().__init__()
        self.transform = transform

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.transform(x),)


@pytest.fixture(scope="module")
def tiny_functions():
    """The default form, forward and inverse over the same signs, in fp16 as the packages compute."""
    signs = random_signs(TINY_WIDTH, seed=3)
    shape = (1, TINY_ROWS, TINY_WIDTH)
    functions = {}
    for name in ("forward", "inverse"):
        module = Packaged(SignedHadamard(signs, TINY_BLOCK, inverse=name == "inverse")).half()
        spec = FunctionSpec(name, (TensorSpec("x", shape, "float16"),), (TensorSpec("y", shape, "float16"),))
        functions[name] = (module, spec)
    return signs, functions


def test_the_core_ai_runtime_computes_what_torch_computes(tiny_functions, tmp_path):
    signs, functions = tiny_functions
    coreai.package(functions, tmp_path / "hadamard.aimodel")
    x = seeded(4, 1, TINY_ROWS, TINY_WIDTH).half()
    with coreai.open_session(tmp_path / "hadamard.aimodel") as session:
        for name, (module, _) in functions.items():
            got = torch.from_numpy(session.call(name, {"x": x.numpy()})["y"])
            with torch.no_grad():
                want = module(x)[0]
            assert got.dtype == torch.float16
            assert (got.double() - want.double()).abs().max() < FP16_RUNTIME_BOUND, name
            assert (got.double() - exact(x, signs, TINY_BLOCK, name == "inverse")).abs().max() < FP16_RUNTIME_BOUND


def test_the_core_ml_package_ships_the_signs_bit_exact(tiny_functions, tmp_path):
    """The default form (butterflies) has no constant but the signs."""
    signs, functions = tiny_functions
    coreml.package(functions, tmp_path / "hadamard.mlpackage")
    expected = [signs.half().numpy()]
    for name in functions:
        shipped = list(coreml.function_constants(tmp_path / "hadamard.mlpackage", name).values())
        for constant in expected:
            assert any(bit_equal(value, constant) for value in shipped), (name, constant.shape)


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
