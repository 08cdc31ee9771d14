"""What a model family is, as code: the hooks the registry's callers use (``typing.Protocol``s, which a family's
module satisfies by defining them; ``tests/test_contracts.py`` and ``tests/test_drafter_registry.py`` check every
registered family against them). docs/contributing.md says how to add one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from convert.export.spec import FunctionSpec


@runtime_checkable
class TargetFamily(Protocol):
    """A target architecture (``convert.models.FAMILIES``; ``convert/models/__init__.py`` says what each hook does)."""

    FAMILY: str
    Args: Any  # .from_config(config, where) -> the family's args
    FunctionModule: Any
    KEEP_FP16: tuple[str, ...]
    MLP_REBALANCE: Any
    PLAN_FIELDS: tuple[str, ...]
    PLAN_ALTERNATIVES: dict

    def accepts(self, config: dict) -> bool: ...

    def sanitize(self, shapes: dict, args, where: str): ...

    def build_core(self, args, target, part=None) -> torch.nn.Module: ...

    def function_specs(self, args, target, dtype: torch.dtype, part=None) -> list[FunctionSpec]: ...

    def host_contract(self, args, target) -> dict: ...

    def architecture_record(self, args, target) -> dict: ...

    def plan_lines(self, args, target) -> list[str]: ...

    def calibration_runner(self, core, length: int): ...

    def linear_groups(self, core, layer: int): ...

    def cached_blocks(self, core, layer: int): ...

    def reference_layers(self, model): ...


@runtime_checkable
class DrafterFamily(Protocol):
    """A drafter family (``convert.models.DRAFTERS``, by the recipe's ``drafter.kind``). ``recipe`` is the recipe
    (``convert.inputs.recipe.Recipe``), ``config`` its drafter section, ``args`` the family's args."""

    KIND: str  # the recipe's drafter.kind
    SOURCE_REQUIRED: bool  # whether drafter.source must be given (else the target's checkpoint is read)
    Args: Any  # .from_config(config, where) -> args (hidden_size, vocab_size, heads, head_dim, parameter_count...)
    driver: Any  # (functions, widths, embeddings) -> convert.runtime.speculative.DrafterDriver

    def recipe_problems(self, recipe) -> list[str]:
        """What in the recipe the drafter cannot be built with (before anything is read)."""

    def check_checkpoint(self, args, directory: Path, recipe, where, config_path: Path) -> str:
        """Refuse a checkpoint that is not the config's or does not fit the recipe; returns its tensors' layout."""

    def specs(self, args, recipe, dtype: torch.dtype, head_ranges) -> list[FunctionSpec]:
        """The drafter's functions for the recipe."""

    def host_contract(self, args, config, head_ranges) -> dict:
        """The ane layout's host contract."""

    def own_shapes(self, args) -> dict[str, tuple[int, ...]]:
        """Its own tensors (not the target's tables it borrows) by canonical name."""

    def stream_scale(self, target_scale: float) -> float:
        """The factor its residual stream starts at, given the target's range scale."""

    def modules(self, args, directory: Path, recipe, lm_head: torch.Tensor, table, dtype: torch.dtype,
                head_ranges, target_scale: float, own_scale: float):
        """Its export modules with the target's head and embedding table, the range scales folded."""

    def recorded_bytes(self, inputs: dict[str, int], widths: dict[str, int], length: int, tokens: int) -> int:
        """At most the input bytes one prompt's speculative run passes it."""

    def binding(self, args) -> dict:
        """``mask_token_id`` and ``hidden_convention`` of the manifest's target binding."""

    def architecture(self, args, config, widths: dict[str, int], core) -> dict:
        """``kind``, ``architectures``, ``num_layers`` and ``runtime`` of the manifest's architecture."""

    def plan_lines(self, args, config) -> list[str]:
        """The plan's lines on it beyond its shapes."""

    def contract_plan(self, recipe, recipe_path: Path, pinned: dict) -> tuple[list[str], Any, str | None]:
        """Its plan from the recipe's contracts: lines, args (None: not planned), checkpoint layout (None: partly)."""
