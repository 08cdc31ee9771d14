"""Recipes: the YAML a release engineer writes, validated into typed models.

Unknown keys, wrong types and impossible values are refused with one line that names the recipe
file and the field. Checks that need the checkpoint's config (taps within the layer count, context
within the model's positions) live in ``check_against_model``, run before any weight is read.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from convert.errors import InputError, field_name, quote
from convert.inputs.thresholds import GateThresholds, default_thresholds

# What a recipe's YAML may expand to: values counted at every use of an alias (a "billion laughs" recipe of 310 KB
# expands to 9^9 strings), and how deep it may nest. The release recipes hold under 250 values, 4 levels deep.
YAML_VALUES_LIMIT = 10_000
YAML_DEPTH_LIMIT = 64
ECHO_LIMIT = 120  # characters of a value an error quotes back (beside the file, the field and what to do)

Backend = Literal["coreai", "coreml"]


INT_LIMIT = 2**31  # every integer of a recipe (widths, counts, seeds) is below it


def sub_field(name: str, message: str) -> PydanticCustomError:
    """A validator's error about one entry of a mapping field (a contract's key, a threshold's name): ``load_recipe``
    names it as ``field.name``."""
    return PydanticCustomError("sub_field", "{name}: {message}", {"name": name, "message": message})


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*")
    @classmethod
    def _finite(cls, value):
        """Integers below ``INT_LIMIT`` in size and floats finite: a 5000-digit width would pass ``gt=0`` and fail
        wherever it is printed (Python refuses to write ints of over 4300 digits), an infinite size everywhere."""
        if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT < value < INT_LIMIT:
            raise ValueError(f"{quote(value, 40)} is out of range (integers here are below 2**31)")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        return value


class Graphs(Strict):
    """Static widths (tokens per call) of the target functions."""

    prefill: int = Field(64, gt=0, description="tokens per prefill call")
    decode: Literal[1] = Field(1, description="tokens per decode call (always 1)")
    verify: int = Field(8, gt=0, description="tokens per verify call: the draft width")


QuantMethod = Literal["none", "affine4", "lut4", "affine4-gptq", "lut4-gptq", "exact"]
EXACT_GROUP = 128  # a Prism pack's input columns per fp16 scale (convert/inputs/prism.py GROUP_SIZE)


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
    device_samples: int = Field(1, gt=0, description="windows (the first of the data's) also computed in the "
                                "arithmetic of the device the layout targets (the gate's device pass, docs/fp16.md)")
    thresholds: dict[str, float] = Field(
        default_factory=dict, description="overrides of the method's default bars (GateThresholds, "
        "convert/inputs/thresholds.py)"
    )

    @field_validator("thresholds")
    @classmethod
    def _known_thresholds(cls, thresholds: dict[str, float]) -> dict[str, float]:
        """Each name a bar of ``GateThresholds`` (a misspelt bar would leave the default in force unnoticed) and each
        value within its bounds."""
        if not thresholds:
            return thresholds
        names = list(GateThresholds.model_fields)
        unknown = [name for name in thresholds if name not in names]
        if unknown:
            raise sub_field(unknown[0], f"unknown metric; one of {', '.join(names)}")
        try:
            GateThresholds.model_validate({**default_thresholds("none").model_dump(), **thresholds})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise sub_field(field_name(err["loc"]), f"{err['msg']} (got {quote(err.get('input'), ECHO_LIMIT)})") \
                from None
        return thresholds


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


# config.json fields that are sizes or counts (a positive integer), positive numbers, and lists of layer indices:
# a contract pins them as the checkpoint must have them, and plans from them when the checkpoint is not here.
SIZE_FIELD = re.compile(r"^num_|_size$|_dim$|_heads$|_rank$|_top_k$|_interval$|^max_position_embeddings$")
POSITIVE_FIELD = re.compile(r"_theta$|_eps$|_factor$")
LAYER_LIST_FIELD = re.compile(r"_layer_ids$")


def check_contract(contract: dict[str, Any]) -> dict[str, Any]:
    """A contract's keys are dotted config.json paths that do not overlap (``text_config.hidden_size`` beside a
    ``text_config`` mapping, or ``a.b`` beside ``a``, would pin one field twice); sizes are positive integers,
    ``*_theta`` / ``*_eps`` / ``*_factor`` positive numbers, ``*_layer_ids`` lists of layer indices."""
    owners: dict[tuple[str, ...], str] = {}  # every pinned path (mappings too) -> the contract key that pins it
    within: dict[tuple[str, ...], str] = {}  # the paths above them -> a contract key that pins a field inside
    pending = [((), contract, None)]
    while pending:
        prefix, mapping, owner = pending.pop()
        for key, value in mapping.items():
            if not isinstance(key, str) or any(not part for part in key.split(".")):
                raise ValueError(f"key {quote(key, 60)} is not a config.json field name (dotted for nested fields)")
            path = prefix + tuple(key.split("."))
            mine = owner or key
            others = [owners.get(path[:end]) for end in range(1, len(path) + 1)] + [within.get(path)]
            other = next((o for o in others if o is not None and o != mine), None)
            if other is not None:
                raise ValueError(f"{quote(other, 60)} and {quote(mine, 60)} overlap (one pins a field inside the "
                                 "other): write each field once, dotted or nested")
            owners[path] = mine
            within.update((path[:end], mine) for end in range(1, len(path)))
            if isinstance(value, dict):
                pending.append((path, value, mine))
            else:
                _check_contract_value(path[-1], value, ".".join(path))
    _check_leaves(contract)
    return contract


def _check_leaves(value: Any) -> None:
    """No integer of a contract, however nested, is 64 bits or more (config.json holds none; Python refuses to
    print one of over 4300 digits)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**63:
            raise ValueError(f"{quote(item, 40)} is out of range for a config.json value (64 bits)")


def _check_contract_value(name: str, value: Any, key: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if SIZE_FIELD.search(name) and not (number and isinstance(value, int) and value > 0):
        raise sub_field(key, f"is {quote(value, ECHO_LIMIT)}; expected a positive integer (a size or count)")
    if POSITIVE_FIELD.search(name) and not (number and math.isfinite(value) and value > 0):
        raise sub_field(key, f"is {quote(value, ECHO_LIMIT)}; expected a finite positive number")
    if LAYER_LIST_FIELD.search(name) and not (
            isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise sub_field(key, f"is {quote(value, ECHO_LIMIT)}; expected a list of 0-based layer indices")


class Target(Strict):
    source: str = Field(description="path:DIR (relative to the recipe file's directory, or absolute) or "
                        "hf://org/name@<commit hash>")
    graphs: Graphs = Graphs()
    context: int = Field(512, gt=0, description="KV cache capacity in tokens")
    layout: Literal["stateful", "ane"] = Field(
        "stateful", description="stateful: the packages keep the KV caches as states (the GPU path, as Apple's own "
        "exports); ane: no states, the host owns the history and writes each call's rows, activations channels first "
        "with 1x1 convolutions (the Neural Engine's layout, as anemll-forge ships; docs/layouts.md)")
    ladder: list[int] = Field(
        default_factory=list, description="layout ane: smaller contexts whose prefill / decode / verify the package "
        "also holds (named prefill_<context> ...; the same weights), each below context; the host calls the smallest "
        "that holds a call's rows and passes that much history (forge ships an entry per context; docs/layouts.md)")
    taps: list[int] | None = Field(None, description="layers whose outputs are returned, in this order (0-based)")
    logits: bool = Field(False, description="also return full [1,S,vocab] logits from every function")
    hidden: bool = Field(
        False, description="also return the final-norm hidden states [1,S,hidden] (an MTP head's input)"
    )
    quantization: Quantization = Quantization()
    rescale: bool = Field(True, description="fold the function-preserving range scales (powers of two on the residual "
                          "stream and each MLP intermediate) that keep the device's fp16 tensors within their limits "
                          "(docs/fp16.md); false: ship the checkpoint's own magnitudes, which the device pass judges")
    max_part_mb: float = Field(
        2000, gt=0, description="no package over this many MB (10^6 bytes): a bigger target ships as parts "
        "(embedding, layer chunks, head; convert/pipeline/partition.py). forge keeps parts under 2 GB; about 1 GB is "
        "Core ML's practice on iOS")
    max_host_memory_gb: float = Field(
        16, gt=0, description="host memory the build may take (10^9 bytes): a target whose build in memory would "
        "take more is built part by part, streamed, with parts small enough to package within it "
        "(convert/pipeline/partition.py)")
    gate: Gate = Gate()
    contract: dict[str, Any] = Field(
        default_factory=dict, description="config.json values the checkpoint must have (dotted keys for nested ones)"
    )

    @field_validator("taps")
    @classmethod
    def _taps_distinct(cls, taps: list[int] | None) -> list[int] | None:
        if taps is not None:
            if any(t < 0 for t in taps):
                raise ValueError(f"layer indices are 0-based and >= 0 (got {quote(taps, ECHO_LIMIT)})")
            if len(set(taps)) != len(taps):
                raise ValueError(f"duplicated layer index (got {quote(taps, ECHO_LIMIT)})")
        return taps

    @field_validator("contract")
    @classmethod
    def _contract(cls, contract: dict[str, Any]) -> dict[str, Any]:
        return check_contract(contract)

    @model_validator(mode="after")
    def _context_holds_widths(self) -> Target:
        widest = max(self.graphs.prefill, self.graphs.verify)
        if self.context < widest:
            raise ValueError(f"context {self.context} is smaller than the widest function ({widest} tokens)")
        if self.ladder and self.layout != "ane":
            raise ValueError("ladder is the ane layout's (its host passes the history): set layout ane or drop it")
        for rung in self.ladder:
            if not widest <= rung < self.context:
                raise ValueError(f"ladder: {rung} is not between the widest function ({widest} tokens) and the "
                                 f"context ({self.context}, the largest entry's)")
        if self.ladder != sorted(set(self.ladder)):
            raise ValueError(f"ladder: {quote(self.ladder, ECHO_LIMIT)}: list each context once, smallest first")
        return self


DrafterKind = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$", description=(
    "a drafter family's name (``convert.models.DRAFTERS``; docs/drafters.md lists them); planning refuses a kind no "
    "family registers"))]


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
        None, description="path:DIR (relative to the recipe file's directory) or hf://org/name@<commit hash>; an MTP "
        "head defaults to the target's own checkpoint"
    )
    context_update: int = Field(64, gt=0, description="dflash2: rows per context_update call (prefill)")
    context_append: int = Field(8, gt=0, description="dflash2: rows per context_append call (new-context capacity)")
    ring: int = Field(2048, gt=0, description="dflash2: context ring rows (slot = position mod ring)")
    mask_scale: float = Field(1.0, gt=0, description="dflash2: the mask row is the target's embedding row times this")
    layout: Literal["stateful", "ane"] = Field(
        "stateful", description="stateful: the packages keep the drafter's ring / KV cache as states; ane: no states, "
        "the host owns them and writes each call's rows, computes the masks and takes the argmax (or walks the "
        "selector), activations channels first with 1x1 convolutions (docs/layouts.md)")
    quantization: DrafterQuantization = DrafterQuantization()
    accept: Acceptance = Acceptance()
    contract: dict[str, Any] = Field(
        default_factory=dict, description="config.json values the checkpoint must have (dotted keys for nested ones)"
    )

    @field_validator("contract")
    @classmethod
    def _contract(cls, contract: dict[str, Any]) -> dict[str, Any]:
        return check_contract(contract)


class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="bundle and package file stem")
    target: Target
    drafter: Drafter | None = Field(
        None, description="a drafter built and bound to this target (the bundle then holds target/ and drafter/)"
    )
    backends: list[Backend] = Field(default_factory=lambda: ["coreai", "coreml"], min_length=1)
    output: str | None = Field(None, description="bundle directory, relative to the working directory `build` runs "
                               "in (not to the recipe, unlike path: sources); `build --output` overrides it")

    @field_validator("backends")
    @classmethod
    def _backends_distinct(cls, backends: list[str]) -> list[str]:
        if len(set(backends)) != len(backends):
            raise ValueError(f"duplicated backend (got {backends})")
        return backends



def load_recipe(path: Path) -> Recipe:
    if not path.is_file():
        raise InputError(f"{path}: recipe file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); a recipe is a UTF-8 YAML file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    data = _parse_yaml(text, path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: a recipe is a YAML mapping with 'name' and 'target'")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = field_name(err["loc"]) or "recipe"
        message = {"extra_forbidden": "unknown field", "missing": "required field is missing"}.get(err["type"])
        if err["type"] == "extra_forbidden":
            message += did_you_mean(err["loc"])
        if err["type"] == "sub_field":
            field, message = f"{field}.{field_name([err['ctx']['name']])}", err["ctx"]["message"]
        elif message is None:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], dict) and err["type"] != "value_error":
                message += f" (got {quote(err['input'], ECHO_LIMIT)})"
        raise InputError(f"{path}: {field}: {message}") from None


def did_you_mean(loc: tuple) -> str:
    """For an unknown field at ``loc``, "; did you mean 'x'?" naming the closest field of the model it is in
    (``difflib``), or "; fields here: ..." when none is close."""
    model: type[BaseModel] = Recipe
    for step in loc[:-1]:
        info = model.model_fields.get(step) if isinstance(step, str) else None
        inner = next((t for t in (info.annotation, *typing.get_args(info.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None) if info else None
        if inner is None:
            return ""
        model = inner
    names = list(model.model_fields)
    key = str(loc[-1])
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6) if len(key) <= 100 else []
    return f"; did you mean {close[0]!r}?" if close else f"; fields here: {', '.join(names)}"


def _parse_yaml(text: str, path: Path):
    """``yaml.safe_load`` that refuses a document expanding to more than ``YAML_VALUES_LIMIT`` values (aliases counted
    at each use: an alias bomb) or nested deeper than ``YAML_DEPTH_LIMIT``, before anything is built from it."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses control characters here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, path)
        return loader.construct_document(node)
    except yaml.reader.ReaderError as exc:
        raise InputError(f"{path}: malformed YAML: character {exc.character!r} at position {exc.position}: "
                         f"{exc.reason}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc)
        problem = problem if len(problem) <= 200 else f"{problem[:200]}..."
        raise InputError(f"{path}: malformed YAML{where}: {' '.join(problem.splitlines())}") from None
    except RecursionError:
        raise InputError(f"{path}: YAML nested too deeply (a recipe nests {YAML_DEPTH_LIMIT} levels at most)") from None
    except ValueError as exc:  # a scalar YAML resolves but cannot build: an int of over 4300 digits, a 30 February
        raise InputError(f"{path}: a YAML value cannot be read ({str(exc).split(':')[0][:120]})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_expansion(root: yaml.Node, path: Path) -> None:
    """Count the values ``root`` builds (a node reached through an alias counts at each use) and its depth, without
    recursion; a node that contains itself is refused."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if depth > YAML_DEPTH_LIMIT:
            raise InputError(f"{path}: YAML nested more than {YAML_DEPTH_LIMIT} levels deep (line "
                             f"{node.start_mark.line + 1}); a recipe is a few levels of mappings")
        children = _children(node)
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > YAML_VALUES_LIMIT:
                raise InputError(f"{path}: YAML of more than {YAML_VALUES_LIMIT:,} values, an alias counted at each "
                                 f"use (line {node.start_mark.line + 1}); a recipe holds a few hundred: no alias bombs")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise InputError(f"{path}: YAML alias at line {node.start_mark.line + 1} refers to a value that contains "
                             "it; a recipe cannot be self-referencing")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in children if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


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
