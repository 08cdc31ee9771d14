"""The gate's bars: each quantization method's default thresholds (measured on the fixture), the names a recipe may
override, and the near-tie margin that the package checks and the block-vs-chain probe share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from convert.errors import InputError

METHODS = ("none", "affine4", "lut4", "affine4-gptq", "lut4-gptq", "exact")


class GateThresholds(BaseModel):
    """Bars a candidate must meet; ``*_max`` are upper bounds, ``*_min`` lower bounds (inclusive)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean_kl_max: float = Field(ge=0, description="mean next-token KL(reference || candidate), nats")
    p99_kl_max: float = Field(ge=0, description="99th percentile of the per-position KL")
    max_kl_max: float = Field(ge=0, description="largest per-position KL")
    top1_min: float = Field(ge=0, le=1, description="fraction of positions whose argmax ids agree")
    cosine_min: float = Field(ge=-1, le=1, description="mean cosine of the logit vectors")
    greedy_match_min: float = Field(ge=0, le=1, description="mean fraction of G greedy tokens matched before "
                                    "the first divergence")
    tap_cosine_min: float = Field(ge=-1, le=1, description="mean cosine of each tapped layer's features")
    near_tie_margin: float = Field(ge=0, description="block-vs-chain: a flip between ids whose logits differ by "
                                   "less than this is a near tie")
    block_chain_real_flips_max: int = Field(0, ge=0, description="block-vs-chain flips that are not near ties")
    device_mean_kl_max: float = Field(ge=0, description="the device pass (the shipped modules in the device's "
                                      "arithmetic): mean next-token KL against the reference")
    device_top1_min: float = Field(ge=0, le=1, description="the device pass: top-1 agreement beyond near ties (a "
                                   "flip to an id the reference scores within near_tie_margin of its best agrees)")
    device_greedy_match_min: float = Field(ge=0, le=1, description="the device pass: greedy continuation match")


# The device pass's bars (the shipped modules in the device's arithmetic, on target.gate.device_samples windows, 1 by
# default): the fp16 arithmetic measured on the fixtures (docs/fp16.md, "The gate's device pass") costs a mean KL of
# 2.4e-6 to 9.6e-6 and at most 1 of 1,024 top-1 ids, so 1e-4 and 0.99 leave 10x headroom while a package whose
# ranges overflow (KL nan, top-1 near 0) fails; a quantized method keeps its fp32 bars, which its quantization error
# dominates. Greedy match over one window moves in steps of 1/16: one early divergence at a near tie costs half.
_FP16_DEVICE = dict(device_mean_kl_max=1e-4, device_top1_min=0.99, device_greedy_match_min=0.5)
_QUANTIZED_DEVICE = dict(device_mean_kl_max=0.1, device_top1_min=0.85, device_greedy_match_min=0.4)
# Measured on the fixture (python -m bench.gates, 32 x 256 held-out tokens; docs/benchmarks.md "Gates").
_DEFAULTS = {
    "none": dict(mean_kl_max=1e-4, p99_kl_max=1e-3, max_kl_max=1e-2, top1_min=0.99, cosine_min=0.9999,
                 greedy_match_min=0.9, tap_cosine_min=0.9999, **_FP16_DEVICE),
    "affine4": dict(mean_kl_max=0.1, p99_kl_max=0.5, max_kl_max=3.0, top1_min=0.85, cosine_min=0.99,
                    greedy_match_min=0.4, tap_cosine_min=0.98, **_QUANTIZED_DEVICE),
    "lut4": dict(mean_kl_max=0.1, p99_kl_max=0.5, max_kl_max=3.0, top1_min=0.85, cosine_min=0.99,
                 greedy_match_min=0.4, tap_cosine_min=0.98, **_QUANTIZED_DEVICE),
    # a pack's own codes against its unfolded weights: the codes, the scales, the rotations and (``weights.precision``)
    # the norms, the decay gate and the conv ship as the pack stores them, so what differs is fp32 rounding and the
    # fp16 of the pack's other dense tensors (in_proj_a / in_proj_b) and of the activations. Measured where the pack
    # stores them in fp32 (tests/helpers/prism_packs.py, seeds 0-5, 16 x 64 held-out tokens): with the conv in fp16
    # (docs/lab/2026-12-06-exact-packs-fp32.md) mean KL 2.3e-7 to 4.5e-7, p99 at most 5.2e-6, max at most 1.1e-4, top-1
    # 0.9961 to 1.0 (every flip at a near tie of a random pack), cosine at least 0.9999993; with the conv in fp32, as
    # shipped since (2026-12-06), mean KL 3.3e-9 to 5.4e-9, p99 at most 5.2e-8, max at most 3.7e-7, top-1 0.9990 to
    # 1.0, cosine at least 0.99999999; a pack stored in bf16 (fp16 holds it): 1.3e-10 to 2.4e-10 and 1.0. The bars,
    # set from the conv-in-fp16 figures, stand: they leave 20x on mean KL over those (1,800x over the shipped form's),
    # room a 27B pack's 64 layers of fp16 activations may take and no tiny pack measures, and admit 10 flips in 1,024.
    # One rotated linear's signs negated in its first block is far past them: mean KL 0.053 (layer 1's v_proj) and
    # 0.32 (layer 0's down_proj), top-1 0.54 and 0.15.
    "exact": dict(mean_kl_max=1e-5, p99_kl_max=1e-4, max_kl_max=1e-3, top1_min=0.99, cosine_min=0.99999,
                  greedy_match_min=0.9, tap_cosine_min=0.9999, **_FP16_DEVICE),
}


def default_thresholds(method: str) -> GateThresholds:
    """The default bars for a quantization method (``Quantization.method`` of the recipe).

    GPTQ variants get their round-to-nearest format's bars: GPTQ must do at least as well as RTN, and
    their own measurements may tighten them.
    """
    if method not in METHODS:
        raise InputError(f"quantization method {method!r} has no gate thresholds; one of {', '.join(METHODS)}")
    bars = _DEFAULTS[method.removesuffix("-gptq")]
    return GateThresholds(**bars, near_tie_margin=NEAR_TIE_LOGITS, block_chain_real_flips_max=0)


# Measured on the fixture (bench/coreai_runtime.py, docs/benchmarks.md): the fp16 .aimodel's logits differ from
# the fp16 torch modules' by at most 0.10 (6.9e-3 of the largest |logit|). A flip between two ids whose torch
# logits are closer than 2.5x that error is a near tie; anything wider is a real difference.
NEAR_TIE_LOGITS = 0.25
