"""The quantize stage: the recipe's method applied to the target's export core, weights exactly as they ship.

Round-to-nearest methods quantize every weight on its own. GPTQ methods run the layer-sequential
calibration of ``quant/calibrate.py`` on an fp32 copy of the core (each decoder linear quantized under the
Hessian of its real inputs, the quantized layer's outputs feeding the next), then the lm_head under the
Hessian of the final-norm outputs. The embedding table has no input Hessian (its "input" is a one-hot row)
and is always rounded to nearest. The resulting ``QuantizedWeight``s replace the fp16 core's modules
(``convert/compress.py``), so the gates, the checks and both packages see the same codes and tables.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from convert.compress import apply_quantized
from convert.errors import InputError
from convert.models import family_of
from convert.recipe import Quantization
from quant.affine import quantize_affine
from quant.calibrate import CalibrationSet, quantize_sequential, sample_calibration
from quant.gptq import HessianAccumulator, gptq_quantize
from quant.lut import quantize_lut
from quant.types import QuantizedWeight

ALIASES = {"embeddings": "embed_tokens", "lm_head": "lm_head"}


@dataclass
class QuantizeResult:
    weights: dict[str, QuantizedWeight]  # by export-core module name
    calibration: CalibrationSet | None
    corpus: str | None


def quantize_core(core: nn.Module, quant: Quantization, source: Path, recipe_dir: Path) -> QuantizeResult:
    """Quantize ``core`` (the fp16 shipping core) in place as ``quant`` says; returns what was done.

    The architecture's small weights (``KEEP_FP16``: a Gated DeltaNet's in_proj_a / in_proj_b) stay fp16 always."""
    keep = _kept(core, quant.keep_fp16)
    small = family_of(core.args).KEEP_FP16
    keep |= {name for name, _ in core.named_modules() if small and name.endswith(small)}
    if core.args.tie_word_embeddings:
        keep |= {"embed_tokens", "lm_head"}  # one shared table: quantizing it would untie and duplicate it
    group = quant.resolved_group_size
    calibration = None
    weights: dict[str, QuantizedWeight] = {}
    if quant.uses_gptq:
        calibration = _calibration_set(quant, source, recipe_dir)
        weights.update(_gptq(core, quant, calibration, keep))
    for name, module in core.named_modules():
        if name in keep or name in weights or not hasattr(module, "weight") or module.weight.dim() != 2:
            continue
        weights[name] = round_to_nearest(quant.format, module.weight.detach(), group)
    apply_quantized(core, weights)
    return QuantizeResult(weights, calibration, quant.calibration.corpus if calibration else None)


def _kept(core: nn.Module, names: list[str]) -> set[str]:
    modules = dict(core.named_modules())
    kept = set()
    for name in names:
        resolved = ALIASES.get(name, name)
        if resolved not in modules:
            raise InputError(f"target.quantization.keep_fp16: {name!r} is not 'embeddings', 'lm_head' or a module name")
        kept.add(resolved)
    return kept


def round_to_nearest(method: str, weight: torch.Tensor, group: int) -> QuantizedWeight:
    if method == "lut4":
        return quantize_lut(weight.float(), group)
    return quantize_affine(weight.float(), group)


LAYER_STATS = ("weight_mse", "gptq_output_error", "rtn_output_error", "damping", "cholesky_retries")


def summary(weights: dict[str, QuantizedWeight], parameters) -> tuple[float, list[dict]]:
    """Bits per weight over ``parameters`` (those not in ``weights`` count 16) and the per-layer records the
    manifests carry (method, group size, bits per weight and the quantizer's statistics)."""
    params = {id(p): p for p in parameters}.values()
    quantized = sum(qw.codes.numel() for qw in weights.values())
    bits = sum(qw.bits_per_weight * qw.codes.numel() for qw in weights.values())
    bits += 16 * (sum(p.numel() for p in params) - quantized)
    layers = [{"name": name, "method": qw.method, "group_size": qw.group_size, "bits_per_weight": qw.bits_per_weight,
               **{k: qw.stats[k] for k in LAYER_STATS if qw.stats.get(k) is not None}}
              for name, qw in sorted(weights.items())]
    return bits / sum(p.numel() for p in params), layers


def _gptq(core: nn.Module, quant: Quantization, calibration: CalibrationSet, keep: set[str]):
    """GPTQ every decoder linear (layer-sequential, on an fp32 copy) and the lm_head."""
    method, group = quant.format, quant.resolved_group_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = copy.deepcopy(core).float().to(device)

    def quantize_linear(name: str, weight: torch.Tensor, hessian: torch.Tensor) -> QuantizedWeight | None:
        if name.removeprefix("model.") in keep:
            return None
        return _to_cpu(gptq_quantize(weight, hessian, method, group, lut_refits=quant.lut_refits, name=name))

    result = quantize_sequential(work, calibration.tokens.to(device), quantize_linear)
    weights = {name.removeprefix("model."): qw for name, qw in result.quantized.items()}
    if "lm_head" not in keep:
        accumulator = HessianAccumulator(core.args.hidden_size, device=device)
        with torch.no_grad():
            for sample in result.hidden:
                accumulator.add(work.norm(sample))
        weights["lm_head"] = _to_cpu(
            gptq_quantize(work.lm_head.weight, accumulator.hessian(), method, group, lut_refits=quant.lut_refits,
                          name="lm_head")
        )
    return weights


def _to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    for field in ("codes", "scale", "zero_point", "lut"):
        value = getattr(qw, field)
        if value is not None:
            setattr(qw, field, value.cpu())
    return qw


def _calibration_set(quant: Quantization, source: Path, recipe_dir: Path) -> CalibrationSet:
    from transformers import PreTrainedTokenizerFast

    spec = quant.calibration
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    try:
        return sample_calibration(calibration_text(spec.corpus, recipe_dir), tokenizer, spec.samples, spec.length,
                                  spec.seed)
    except ValueError as exc:
        raise InputError(f"target.quantization.calibration: {exc}") from None


def calibration_text(corpus: str, recipe_dir: Path, field: str = "target.quantization.calibration.corpus") -> str:
    """The text named by ``fixture:SPLIT`` or ``path:FILE`` (relative to the recipe); errors name ``field``."""
    from fixtures import corpus as fixture_corpus
    from quant.calibrate import fixture_corpus_text

    kind, _, value = corpus.partition(":")
    if kind == "path":
        path = Path(value) if Path(value).is_absolute() else recipe_dir / value
        if not path.is_file():
            raise InputError(f"{field}: {path} does not exist")
        return path.read_text(encoding="utf-8")
    if kind != "fixture" or value not in fixture_corpus.SPLITS:
        raise InputError(f"{field}: {corpus!r} is not fixture:SPLIT or path:FILE")
    try:
        if value == "train" and not fixture_corpus.TRAIN_TEXT_PATH.is_file():
            from fixtures.build_corpus import write_train_split

            write_train_split()
        return fixture_corpus_text(value)
    except fixture_corpus.CorpusError as exc:
        raise InputError(f"{field}: {corpus}: {exc}") from None
