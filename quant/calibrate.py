"""Calibration for GPTQ: token samples from a corpus, and layer-sequential Hessian capture over a target's export core.

Samples: the corpus text goes through the real tokenizer as one token stream; ``n`` windows of ``length`` tokens
start at offsets drawn from a seeded generator. ``CalibrationSet`` records the text's sha256, n, length and seed
(the calibration identity the manifest records).

Capture (as in the GPTQ reference's layer-sequential loop): the embeddings of every sample, then for each decoder
layer, each group of its linears in turn (the architecture's ``linear_groups``; for attention q/k/v, then o, then
gate/up, then down: "true sequential", so o_proj's Hessian sees the already-quantized q/k/v; for a Gated DeltaNet
in_proj_qkv/in_proj_z, then out_proj): run the layer over every sample, as far as that group's inputs, with hooks
that accumulate the group's input Hessians, hand each linear to the caller's ``quantize_linear``, put the
dequantized weight back. Then the layer's outputs, computed with its quantized weights, become the next layer's
inputs; only one layer's activations are held at a time. Layers run unbatched (the export core works on one
sequence), causally over the sample itself from zeroed states (the architecture's ``calibration_runner``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from convert.models import family_of
from quant.gptq import HessianAccumulator
from quant.types import QuantizedWeight

# (transformers name without ".weight", weight [out, in], Hessian [in, in]) -> quantized weight, or None to keep it
QuantizeLinear = Callable[[str, torch.Tensor, torch.Tensor], "QuantizedWeight | None"]


@dataclass(frozen=True)
class CalibrationSet:
    tokens: torch.Tensor  # int64 [n, length]
    corpus_sha256: str  # of the UTF-8 text that was tokenized
    n: int
    length: int
    seed: int

    def identity(self) -> dict:
        return {"corpus_sha256": self.corpus_sha256, "n": self.n, "length": self.length, "seed": self.seed}


def fixture_corpus_text(split: str = "train") -> str:
    """A fixture corpus split as the model was trained on it: every file as ``<|bos|> text <|eos|>``.

    The train split is rebuilt by ``python -m fixtures.build_corpus``; validation and eval are shipped.
    """
    from fixtures.corpus import read_split
    from fixtures.train_tokenizer import BOS, EOS

    return "".join(f"{BOS}{f.text}{EOS}" for f in read_split(split))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` through a ``tokenizers.Tokenizer`` or a transformers tokenizer, no added specials."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(encoded, "ids", encoded))


def sample_calibration(text: str, tokenizer, n: int = 128, length: int = 2048, seed: int = 0) -> CalibrationSet:
    """``n`` windows of ``length`` tokens of ``text``, at offsets drawn from ``seed`` (windows may overlap)."""
    ids = torch.tensor(encode(tokenizer, text), dtype=torch.int64)
    if ids.numel() < length:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than one sample of {length}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length + 1, (n,), generator=generator)
    tokens = ids[starts[:, None] + torch.arange(length)]
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return CalibrationSet(tokens=tokens, corpus_sha256=sha, n=n, length=length, seed=seed)


class _Captured(Exception):
    """Raised by the hook of a capture pass's last linear: the rest of the layer is not needed for this sample."""


def capture_hessians(layer: torch.nn.Module, names: tuple[str, ...], x: torch.Tensor,
                     runner: Callable) -> dict[str, HessianAccumulator]:
    """Input Hessians of the linears ``names`` (e.g. ``mlp.down_proj``) of ``layer`` over the inputs ``x``.

    Each sample runs only until every one of the linears has seen its input (a q/k/v pass stops before attention
    is computed), one sample per runner call, in order: the same sums as a full pass, for less than its work."""
    accumulators, hooks, seen = {}, [], set()

    def hook(name: str, acc: HessianAccumulator):
        def add(_module, args):
            acc.add(args[0])
            seen.add(name)
            if len(seen) == len(names):
                raise _Captured

        return add

    for name in names:
        linear = layer.get_submodule(name)
        accumulators[name] = HessianAccumulator(linear.in_features, linear.weight.device)
        hooks.append(linear.register_forward_pre_hook(hook(name, accumulators[name])))
    try:
        for i in range(x.shape[0]):
            seen.clear()
            try:
                runner(layer, x[i : i + 1])
            except _Captured:
                pass
    finally:
        for h in hooks:
            h.remove()
    return accumulators


@dataclass
class SequentialResult:
    quantized: dict[str, QuantizedWeight]  # by transformers name, without ".weight"
    hidden: torch.Tensor  # [n, length, hidden]: the last decoder layer's outputs


@torch.no_grad()
def quantize_layer(layer: torch.nn.Module, index: int, groups: tuple[tuple[str, ...], ...], x: torch.Tensor,
                   runner: Callable, quantize_linear: QuantizeLinear) -> dict[str, QuantizedWeight]:
    """Quantize decoder layer ``index``'s linears in place, group by group over its inputs ``x``: each group's
    Hessians are captured with the earlier groups already quantized (their dequantized weights put back)."""
    quantized = {}
    for names in groups:
        accumulators = capture_hessians(layer, names, x, runner)
        for name, acc in accumulators.items():
            full_name = f"model.layers.{index}.{name}"
            linear = layer.get_submodule(name)
            qw = quantize_linear(full_name, linear.weight, acc.hessian())
            if qw is not None:
                linear.weight.copy_(qw.dequantize().to(linear.weight.dtype))
                quantized[full_name] = qw
    return quantized


@torch.no_grad()
def quantize_sequential(core: torch.nn.Module, tokens: torch.Tensor,
                        quantize_linear: QuantizeLinear) -> SequentialResult:
    """Quantize every decoder-layer linear of an export ``core`` in place, layer by layer, on calibration ``tokens``
    [n, L]; the core's architecture family says how a layer runs over a sample and which linears it quantizes.
    (The whole core in memory: the build streams the same loop from the checkpoint, ``convert/quantize.py``.)"""
    family = family_of(core.args)
    runner = family.calibration_runner(core, tokens.shape[1])
    x = core.embed_tokens(tokens.to(core.embed_tokens.weight.device).long())
    quantized = {}
    for i, layer in enumerate(core.layers):
        quantized.update(quantize_layer(layer, i, family.linear_groups(core, layer), x, runner, quantize_linear))
        x = runner(layer, x)
    return SequentialResult(quantized=quantized, hidden=x)
