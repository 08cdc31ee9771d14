"""Recipes: the YAML a release engineer writes, validated into typed models.

Unknown keys, wrong types and impossible values are refused with one line that names the recipe
file and the field. Checks that need the checkpoint's config (taps within the layer count, context
within the model's positions) live in ``check_against_model``, run before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from convert.errors import InputError

Backend = Literal["coreai", "coreml"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Graphs(Strict):
    """Static widths (tokens per call) of the target functions."""

    prefill: int = Field(64, gt=0, description="tokens per prefill call")
    decode: Literal[1] = Field(1, description="tokens per decode call (always 1)")
    verify: int = Field(8, gt=0, description="tokens per verify call: the draft width")


QuantMethod = Literal["none", "affine4", "lut4", "affine4-gptq", "lut4-gptq", "exact"]
EXACT_GROUP = 128  # a Prism pack's input columns per fp16 scale (convert/prism.py GROUP_SIZE)


class TextSample(Strict):
    """n windows of length tokens of a text, through the target's tokenizer, at offsets drawn from seed."""

    corpus: str = Field(description="fixture:train | fixture:validation | fixture:eval | path:FILE (UTF-8 text)")
    samples: int = Field(32, gt=0)
    length: int = Field(256, gt=1)
    seed: int = 0


class Calibration(TextSample):
    """Calibration text for GPTQ: by default the fixture corpus's train split."""

    corpus: str = "fixture:train"


class GateData(TextSample):
    """Evaluation text for the numeric gate: by default the fixture corpus's held-out split."""

    corpus: str = "fixture:eval"


class Gate(Strict):
    data: GateData = GateData()
    greedy_tokens: int = Field(16, gt=0, description="greedy continuation length compared per window")
    thresholds: dict[str, float] = Field(
        default_factory=dict, description="overrides of the method's default bars (convert/gates.py GateThresholds)"
    )


class QuantizationMethod(Strict):
    """A quantization method and its group size; shared by the target's and the drafter's settings."""

    method: QuantMethod = "none"
    group_size: int | None = Field(
        None, gt=0, description="lut4: output rows per table (default 16); affine4: input columns (default 64)"
    )

    @property
    def format(self) -> str | None:
        """'affine4' / 'lut4' / 'exact2' (``exact``: a pre-quantized pack's own 2-bit codes), or None when nothing is
        quantized."""
        if self.method == "exact":
            return "exact2"
        return None if self.method == "none" else self.method.removesuffix("-gptq")

    @property
    def uses_gptq(self) -> bool:
        return self.method.endswith("-gptq")

    @property
    def resolved_group_size(self) -> int:
        if self.format == "exact2":
            return EXACT_GROUP
        return self.group_size or (16 if self.format == "lut4" else 64)

    @model_validator(mode="after")
    def _affine_groups(self) -> QuantizationMethod:
        if self.format == "affine4" and self.resolved_group_size not in (32, 64, 128):
            raise ValueError(f"affine4 groups are 32, 64 or 128 input columns (got {self.group_size})")
        if self.format == "exact2" and self.group_size is not None:
            raise ValueError("exact ships the pack's own groups (128 input columns); leave group_size out")
        return self


class Quantization(QuantizationMethod):
    keep_fp16: list[str] = Field(
        default_factory=list, description="weights kept fp16: 'embeddings', 'lm_head' or a module name"
    )
    lut_refits: int = Field(0, ge=0, description="lut4-gptq: refit the tables and sweep again while the error falls")
    calibration: Calibration = Calibration()


class Target(Strict):
    source: str = Field(description="path:DIR (relative to the recipe) or hf://org/name@revision")
    graphs: Graphs = Graphs()
    context: int = Field(512, gt=0, description="KV cache capacity in tokens")
    taps: list[int] | None = Field(None, description="layers whose outputs are returned, in this order (0-based)")
    logits: bool = Field(False, description="also return full [1,S,vocab] logits from every function")
    hidden: bool = Field(
        False, description="also return the final-norm hidden states [1,S,hidden] (an MTP head's input)"
    )
    quantization: Quantization = Quantization()
    max_part_mb: float = Field(
        2000, gt=0, description="no package over this many MB (10^6 bytes): a bigger target ships as parts "
        "(embedding, layer chunks, head; convert/parts.py). forge keeps parts under 2 GB; about 1 GB is Core ML's "
        "practice on iOS")
    max_host_memory_gb: float = Field(
        16, gt=0, description="host memory the build may take (10^9 bytes): a target whose build in memory would "
        "take more is built part by part, streamed, with parts small enough to package within it (convert/parts.py)")
    gate: Gate = Gate()
    contract: dict[str, Any] = Field(
        default_factory=dict, description="config.json values the checkpoint must have (dotted keys for nested ones)"
    )

    @field_validator("taps")
    @classmethod
    def _taps_distinct(cls, taps: list[int] | None) -> list[int] | None:
        if taps is not None:
            if any(t < 0 for t in taps):
                raise ValueError(f"layer indices are 0-based and >= 0 (got {taps})")
            if len(set(taps)) != len(taps):
                raise ValueError(f"duplicated layer index (got {taps})")
        return taps

    @model_validator(mode="after")
    def _context_holds_widths(self) -> Target:
        widest = max(self.graphs.prefill, self.graphs.verify)
        if self.context < widest:
            raise ValueError(f"context {self.context} is smaller than the widest function ({widest} tokens)")
        return self


DrafterKind = Literal["dflash2", "mtp"]


class DrafterCalibration(TextSample):
    """GPTQ calibration of a drafter: speculative decoding over n prompts, the drafter's inputs as deployed."""

    corpus: str = "fixture:train"
    samples: int = Field(16, gt=0)
    length: int = Field(64, gt=1)
    tokens: int = Field(64, gt=0, description="tokens generated after each prompt")


class DrafterQuantization(QuantizationMethod):
    """4-bit for the drafter's own linears; the borrowed lm_head (and embeddings) stay exactly as the target
    ships them."""

    calibration: DrafterCalibration = DrafterCalibration()

    @model_validator(mode="after")
    def _not_exact(self) -> DrafterQuantization:
        if self.method == "exact":
            raise ValueError("exact ships a pre-quantized target pack's own codes; a drafter's are quantized here "
                             "(none, affine4, lut4, affine4-gptq, lut4-gptq)")
        return self


class Acceptance(TextSample):
    """Held-out prompts for `spec-convert accept` and the quantized drafter's A/B: n prompts of `length` tokens."""

    corpus: str = "fixture:eval"
    samples: int = Field(8, gt=0)
    length: int = Field(64, gt=1)
    tokens: int = Field(64, gt=0, description="tokens generated greedily after each prompt")
    max_p_value: float = Field(
        0.05, gt=0, lt=1, description="a quantized drafter that accepts fewer drafts with sign-test p below this fails"
    )


class Drafter(Strict):
    kind: DrafterKind
    source: str | None = Field(
        None, description="path:DIR or hf://org/name@revision; an MTP head defaults to the target's own checkpoint"
    )
    context_update: int = Field(64, gt=0, description="dflash2: rows per context_update call (prefill)")
    context_append: int = Field(8, gt=0, description="dflash2: rows per context_append call (new-context capacity)")
    ring: int = Field(2048, gt=0, description="dflash2: context ring rows (slot = position mod ring)")
    mask_scale: float = Field(1.0, gt=0, description="dflash2: the mask row is the target's embedding row times this")
    quantization: DrafterQuantization = DrafterQuantization()
    accept: Acceptance = Acceptance()
    contract: dict[str, Any] = Field(
        default_factory=dict, description="config.json values the checkpoint must have (dotted keys for nested ones)"
    )


class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="bundle and package file stem")
    target: Target
    drafter: Drafter | None = Field(
        None, description="a drafter built and bound to this target (the bundle then holds target/ and drafter/)"
    )
    backends: list[Backend] = Field(default_factory=lambda: ["coreai", "coreml"], min_length=1)
    output: str | None = Field(None, description="bundle directory, relative to the current directory")

    @field_validator("backends")
    @classmethod
    def _backends_distinct(cls, backends: list[str]) -> list[str]:
        if len(set(backends)) != len(backends):
            raise ValueError(f"duplicated backend (got {backends})")
        return backends

    @model_validator(mode="after")
    def _drafter_fits_target(self) -> Recipe:
        drafter = self.drafter
        if drafter is None:
            return self
        if drafter.kind == "dflash2" and drafter.context_append < self.target.graphs.verify:
            raise ValueError(
                f"drafter.context_append {drafter.context_append} is below target.graphs.verify "
                f"{self.target.graphs.verify}: one round can accept that many rows"
            )
        if drafter.kind == "mtp" and self.target.graphs.verify < 2:
            raise ValueError("an MTP drafter needs target.graphs.verify >= 2 (the bonus token and one draft)")
        return self


def load_recipe(path: Path) -> Recipe:
    if not path.is_file():
        raise InputError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InputError(f"{path}: malformed YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a recipe is a YAML mapping with 'name' and 'target'")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "recipe"
        message = {"extra_forbidden": "unknown field", "missing": "required field is missing"}.get(err["type"])
        if message is None:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], dict):
                message += f" (got {err['input']!r})"
        raise InputError(f"{path}: {field}: {message}") from None


def check_against_model(recipe: Recipe, num_layers: int, max_positions: int, where: Path) -> None:
    taps = recipe.target.taps or []
    bad = [t for t in taps if t >= num_layers]
    if bad:
        raise InputError(f"{where}: target.taps: layer {bad[0]} is out of range (the model has {num_layers} layers)")
    gate = recipe.target.gate
    if gate.data.length + gate.greedy_tokens > recipe.target.context:
        raise InputError(
            f"{where}: target.gate.data.length: {gate.data.length} + greedy_tokens {gate.greedy_tokens} exceeds the "
            f"context ({recipe.target.context}); lower them or raise target.context"
        )
    if recipe.target.context > max_positions:
        raise InputError(
            f"{where}: target.context: {recipe.target.context} exceeds the model's max_position_embeddings "
            f"({max_positions})"
        )
