"""Model families behind two registries: target architectures (``FAMILIES``, picked from a checkpoint's config.json)
and drafter families (``DRAFTERS``, by a recipe's ``drafter.kind``: each one's ``family.py`` defines the hooks of
``contracts.DrafterFamily``; docs/contributing.md). The hooks are typed in ``contracts.py``.

Every family package (``qwen3``: Qwen3 dense; ``qwen3_5``: the hybrid Qwen3.5 family) defines the same names, and
nothing outside ``convert/models`` names a family:

- ``FAMILY``: the manifest's ``architecture.family``; ``accepts(config)``: whether a config.json is this family's.
- ``Args.from_config(config, where)``: the family's args dataclass (``args.family`` names the family back).
- ``sanitize(shapes, args, where) -> Layout``: refuse a checkpoint whose keys or shapes are not the config's.
- ``build_core(args, target, part=None)``: the export core (``load_weights(tensors, layout)``, ``forward`` per
  function), of the whole target or of one part of it (``convert/pipeline/partition.py``: its embedding rows, layers,
head rows).
- ``function_specs(args, target, dtype, part=None)``, ``FunctionModule``: the functions' shape contract (the whole
  target's or a part's) and the module class that calls the core for one function.
- ``host_contract(args, target)``: what a runtime sets between calls (``manifests.schema.HostContract``).
- ``architecture_record(args, target)``: the manifest's architecture fields; ``plan_lines(args, target)``: the
  plan's lines on the architecture and its states.
- ``calibration_runner(core, length)`` and ``linear_groups(core, layer)``: how GPTQ runs one decoder layer over a
  calibration sample and which of its linears it quantizes together (``quant/calibrate.py``); ``KEEP_FP16``:
  module-name suffixes of small weights never quantized; ``MLP_REBALANCE``: the (up, down) linears of a layer's MLP
  whose intermediate one power of two can divide (``convert/weights/rescale.py``); ``cached_blocks(core, layer)``:
  the layer's blocks (the token mixer, the MLP) whose output is their last linear's, as (block, last linear) names
  (GPTQ's later passes replay that linear on its kept inputs instead of running the block; the range scale
  multiplies those linears: they write the residual stream).
- ``reference_layers(model)``: the decoder layers of the transformers reference (the gates hook their outputs).
- ``PLAN_FIELDS`` (and ``PLAN_ALTERNATIVES``): the config fields a recipe contract pins so that ``build --dry-run``
  plans the functions without the checkpoint.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from convert import fields
from convert.errors import InputError, quote

FAMILIES = ("qwen3_5", "qwen3")  # first match wins
DRAFTERS: dict[str, str | ModuleType] = {"dflash2": "convert.models.dflash2.family", "mtp": "convert.models.mtp.family"}
"""Drafter families by the recipe's ``drafter.kind``: the module of each one's hooks (``contracts.DrafterFamily``), or
its import path."""
# Families we know by name and do not convert: (model_type, architecture) -> what to say
REFUSED = {
    "qwen3_next": "Qwen3-Next (fused in_proj_qkvz / in_proj_ba and mixture-of-experts MLPs) is not supported",
    "qwen3_5_moe": "Qwen3.5 MoE (mixture-of-experts MLPs) is not supported; dense Qwen3.5 / 3.6 / 3.8 models are",
    "qwen3_moe": "Qwen3 MoE (mixture-of-experts MLPs) is not supported; Qwen3 dense models are",
}


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise InputError(f"unknown architecture family {name!r}; one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"convert.models.{name}")


def drafter_family(kind: str) -> ModuleType:
    """The hooks of the drafter family a recipe's ``drafter.kind`` names, or an error listing the kinds there are."""
    entry = DRAFTERS.get(kind)
    if entry is None:
        raise InputError(f"drafter.kind: {quote(kind)} is not a drafter kind; one of {', '.join(DRAFTERS)}")
    return importlib.import_module(entry) if isinstance(entry, str) else entry


def family_of(args) -> ModuleType:
    """The family module of a family's args."""
    return family(args.family)


def family_for(config: dict, where: str = "config.json") -> ModuleType:
    """The family whose config this is, or an error naming the model type and what is supported."""
    text = fields.section(config, where)
    for section in (config, text):  # the families' ``accepts`` read these as lists of names
        fields.strings(section, "architectures", where)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    for key in (model_type, str(config.get("model_type") or "")):
        if key in REFUSED:
            raise InputError(f"{where}: model_type {key!r}: {REFUSED[key]}")
    for name in FAMILIES:
        module = family(name)
        if module.accepts(config):
            return module
    archs = config.get("architectures") or []
    raise InputError(f"{where}: architectures {quote(archs)} (model_type {quote(model_type or 'not set')}) is not a "
                     "supported target: Qwen3 dense (Qwen3ForCausalLM) or the Qwen3.5 family (Qwen3_5ForCausalLM, "
                     "Qwen3_5ForConditionalGeneration)")


def read_args(config: dict, where: str = "config.json"):
    """The args of whatever family ``config`` is."""
    return family_for(config, where).Args.from_config(config, where)


