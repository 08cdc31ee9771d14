"""Which parameters of a target's shipped core keep fp32 instead of the shipping dtype (fp16).

``target.quantization.method: exact`` promises the pack's own function (``convert/inputs/prism.py``). A Ternary Bonsai
pack stores its small dense tensors (the norms' gains, the delta rule's ``A_log`` and ``dt_bias``, the conv) in fp32,
as mlx-vlm's reader computes with them: a tiny such pack gated with all of them in fp32 measured a mean KL of 2.4e-10,
and rounded to fp16 4.8e-7, one top-1 id in 256 flipped (docs/benchmarks.md "Exact packs at fp32"). Where
the export core already computes that op in fp32 (an fp32 island: Core AI keeps them, docs/hybrid.md), the parameter
is kept fp32, so the package holds the pack's value and computes with it as the pack does:

- a norm's gain (``*norm.weight``): the zero-centred norm multiplies ``(1 + w)`` into the fp32 normed rows, the gated
  norm ``w`` into its normed rows before its fp32 product with ``silu(z)``;
- ``A_log`` and ``dt_bias``: the decay gate ``g = -exp(A_log) softplus(a + dt_bias)`` is computed in the core's
  ``recurrence_dtype`` (fp32 in the stateful layout);
- the Gated DeltaNet's depthwise conv weight (``conv1d.weight``): the core computes its conv in the weight's dtype, so
  kept in fp32 it is an fp32 conv of the window's fp16 rows, whose output goes on in the fp32 recurrence.

Not kept: ``in_proj_a`` / ``in_proj_b`` (fp16 linears); the ``ane`` layout (the Neural Engine computes nothing in
fp32, and its core casts every gain, gate and the conv weight to the activations' dtype); any method but ``exact``
(a checkpoint is shipped in fp16 as before). What fp16 costs on the tensors left in fp16 is what ``exact``'s gate
bars are set from (``convert/inputs/thresholds.py``). Core ML's program computes in fp16 throughout
(``compute_precision`` FLOAT16), so its converter stores these constants in fp16 too; Core AI stores them as fp32
constants (tests/test_exact_build.py reads both back).
"""

from __future__ import annotations

import torch
from torch import nn

from convert.models.part import KEPT_FP32

_SUFFIXES = ("norm.weight", ".A_log", ".dt_bias")  # 1-D gains and gates
CONV = ".conv1d.weight"  # the Gated DeltaNet's depthwise conv, [C, 1, K]


def kept_fp32_names(core: nn.Module, target) -> frozenset[str]:
    """The parameters of ``core`` (an export core of ``target``, the recipe's target section) that keep fp32."""
    method = getattr(getattr(target, "quantization", None), "method", None)
    if method != "exact" or getattr(target, "layout", "stateful") != "stateful":
        return frozenset()
    if getattr(core, "recurrence_dtype", None) != torch.float32:
        return frozenset()
    return frozenset(name for name, p in core.named_parameters(remove_duplicate=False)
                     if (p.dim() == 1 and name.endswith(_SUFFIXES)) or name.endswith(CONV))


def keep_fp32(core: nn.Module, target) -> frozenset[str]:
    """Make the parameters ``kept_fp32_names`` names fp32 (on their device, values cast exactly) and record them on the
    core (``models.part.KEPT_FP32``: ``Streamer`` fills them uncast, ``part.core_dtype`` passes them over); returns
    them."""
    names = record(core, target)
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = core.get_submodule(owner)
        module._parameters[leaf] = nn.Parameter(module._parameters[leaf].detach().float(), requires_grad=False)
    return names


def record(core: nn.Module, target) -> frozenset[str]:
    """Record on ``core`` the names ``kept_fp32_names`` gives, converting nothing: a part's core
    (``shipped.part_modules``) shares the whole core's tensors, already kept."""
    names = kept_fp32_names(core, target)
    setattr(core, KEPT_FP32, names)
    return names


def kept(core: nn.Module) -> frozenset[str]:
    """The names ``keep_fp32`` or ``record`` recorded on ``core`` (none when neither was called)."""
    return getattr(core, KEPT_FP32, frozenset())
