"""The bundle manifests: pydantic models, the single definition of every field a runtime reads.

``manifest.schema.json`` (targets) and ``drafter_manifest.schema.json`` (drafters) beside this file are
generated from these models (``python -m manifests.schema`` rewrites them; a test fails when one is stale).
Only ``built_at`` holds wall-clock time: two builds of the same recipe and inputs give manifests equal in
every other field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from convert.errors import quote

ARGMAX_IDS = "argmax_ids"  # the head's argmax output's name (convert/export/names.py takes it from here)
SCHEMA_VERSION = "2"  # 2: architecture families beyond Qwen3 dense, the host contract
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")
DRAFTER_SCHEMA_PATH = Path(__file__).with_name("drafter_manifest.schema.json")
TAP_CONVENTION = (
    "output of decoder layer i, 0-based, before the final norm "
    "(= transformers hidden_states[i+1] for i < num_layers-1; hidden_states[num_layers] is after the final norm)"
)


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


Size = Annotated[int, Field(ge=1, description="a size or count: a positive integer")]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def inside(path: str) -> str:
    """A recorded path stays inside the folder it is relative to (commands hash and open these files): relative,
    '/'-separated, without '..', printable, at most 1024 characters."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or "\\" in path or ".." in parts or not path.isprintable() \
            or len(path) > 1024:
        raise ValueError("a relative path inside the bundle ('/'-separated, no '..', printable, up to 1024 "
                         "characters)")
    return path


class FileEntry(Model):
    path: str = Field(description="relative to the bundle's folder that holds the package (a package's files) or to "
                      "the bundle (the others), '/'-separated")
    sha256: str
    size: Count

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        return inside(path)


def _range(rows: list[int] | None) -> list[int] | None:
    """[first, end) with 0 <= first <= end."""
    if rows is not None and not (len(rows) == 2 and 0 <= rows[0] <= rows[1]):
        raise ValueError("a range [first, end) of two integers, 0 <= first <= end")
    return rows


class Source(Model):
    reference: str = Field(description="the recipe's source string")
    repo: str | None = None
    revision: str | None = None
    files: list[FileEntry]


class HybridLayers(Model):
    """A hybrid target's layer pattern and Gated DeltaNet shapes (the Qwen3.5 family)."""

    layer_types: list[Literal["linear_attention", "full_attention"]]
    rotary_dim: Size = Field(description="RoPE on the first rotary_dim dims of each attention head")
    attention_output_gate: bool
    linear_num_key_heads: Size
    linear_num_value_heads: Size = Field(description="value head j reads key head j // (value heads / key heads)")
    linear_key_head_dim: Size
    linear_value_head_dim: Size
    linear_conv_kernel_dim: Size
    recurrent_state_scale: Positive = Field(
        description="recurrent_state holds the delta-rule state times this power of two (the device-safe scaling; "
                    "opaque to a runtime, which never reads it)")


class Architecture(Model):
    family: Literal["qwen3", "qwen3_5"]
    hidden_size: Size
    num_layers: Size
    num_heads: Size
    num_kv_heads: Size
    head_dim: Size
    intermediate_size: Size
    vocab_size: Size
    tie_word_embeddings: bool
    rope_type: str
    rope_theta: Positive
    rms_norm_eps: Positive
    context: Size = Field(description="KV cache capacity of the exported functions")
    hybrid: HybridLayers | None = None


class HostBuffer(Model):
    """A buffer the host owns (the ane layout: no package states): passed to every call as the input of its name,
    and after each call the output ``rows`` written into it: with ``write`` positions, along ``axis``, row j at the
    call's position j (modulo ``ring`` when set: a ring's slot), rows past the buffer dropped; leading, row j at row j
    (a hybrid's pending rows); whole, the output replaces the buffer (a hybrid's committed conv and recurrent
    state). An output the call does not return leaves the buffer as it is."""

    rows: str = Field(description="the output holding this call's rows for the buffer")
    axis: Count = Field(description="the row axis of the buffer and of the output")
    ring: Size | None = Field(None, description="rows wrap: slot = position mod ring")
    write: Literal["positions", "leading", "whole"] = Field("positions", description="where the rows go")


class HostCommit(Model):
    """The inputs the host computes from a commit count (a hybrid's ``accept`` or ``valid``, n) for the ane layout's
    functions, which take no integers: ``mask`` [1, R], 1 for rows below n and 0 for the rest, and ``select`` [K-1,
    K-1+R], the one-hot rows n .. n+K-2 (the conv history after the first n rows of a [history | rows] window)."""

    mask: str
    select: str


class HostPositions(Model):
    """What the host computes from a call's positions for the ane layout's functions (which take no position_ids):
    ``rope_cos`` / ``rope_sin`` [S, rotary_dim / 2], cos and sin of position x ``1 / rope_theta ** (2i / rotary_dim)``
    in fp32 (transformers' default RoPE), and ``history_mask`` [1, rows]: 0 below the call's first position, -1e4 at
    and past it."""

    rope_theta: Positive
    rotary_dim: Size
    first_row: Count = Field(0, description="the history's first row a call may read (an MTP head's: 1; its row 0 "
                             "holds no position): history_mask is -1e4 below it too")


class HostEmbedding(Model):
    """The embedding lookup the host does for the ane layout's functions (which take no input_ids): the rows of the
    call's ids, from the bundle's ``file`` (the fp16 rows as the target's lookups return them), as ``input`` [1, S,
    hidden] of the first part (or of the whole target)."""

    input: str = Field(description="the input the looked-up rows are passed as")
    file: str = Field(description="the bundle's file holding the rows (tensor weight [vocab, hidden])")


class HostSelector(Model):
    """A DFlash2 drafter's candidate-selector walk, which the host does for the ane layout's ``draft`` (it takes the
    top-k and gathers codebook rows, which the Neural Engine does not run): from the ``draft``'s ``logits`` and
    ``projection`` [1, S-1, rank], and the codebooks in the drafter bundle's ``file``, the host returns ``ids`` and
    ``scores`` as the stateful function computes them (``convert.models.dflash2.core.selector_walk``)."""

    projection: str = Field(description="the output holding the selector's projection of each draft row")
    file: str = Field(description="the drafter bundle's file holding the predecessor and successor codebooks")
    top_k: Size
    ids: str = Field(description="the output the walk's ids are returned as")
    scores: str = Field(description="the output its scores [1, S-1, top_k] are returned as")


class HostContract(Model):
    """What a runtime sets between calls and must never do: docs/hybrid.md explains it.
    A drafter binds the name and version of its target's contract."""

    name: str
    version: int
    rollback: Literal["positional", "commit-next-call"] = Field(
        description="positional: continue at an earlier position; commit-next-call: the next call's accept input "
                    "keeps the first rows of the previous decode / verify")
    inputs: dict[str, str] = Field(description="function inputs beyond input_ids and position_ids, by name")
    pending_rows: dict[str, int] = Field(description="functions that leave their rows pending, with the rows they "
                                         "can leave (the most the next call's accept may keep)")
    positions: HostPositions | None = Field(None, description="the ane layout's position inputs the host computes")
    embedding: HostEmbedding | None = Field(None, description="the ane layout's embedding lookup the host does")
    ladder: list[Size] = Field(
        default_factory=list, description="the ane layout's smaller contexts: each function also exists as "
        "<function>_<context> over that much history; the host calls the smallest whose history holds the call's "
        "positions (first position + width at most the context) and passes it the buffers' leading rows")
    commits: dict[str, HostCommit] = Field(
        default_factory=dict, description="the ane layout's inputs the host computes from each commit count, by the "
        "count's name (accept, valid)")
    argmax: Literal["function", "host"] = Field(
        "function", description="function: the head returns argmax_ids (and a split head its max_logit); host: the "
        "head returns logits and the host takes their argmax (the lowest id among equal maxima)")
    argmax_ids: str = Field(ARGMAX_IDS, description="with argmax host: the output the host returns the ids as")
    buffers: dict[str, HostBuffer] = Field(
        default_factory=dict, description="the ane layout's host-owned buffers by input name (none: the package keeps "
        "its states itself)")
    ring_masks: dict[str, Size | None] = Field(
        default_factory=dict, description="the ane layout's ring masks [ring, S] the host computes, by input name, "
        "with their sliding window (none: the whole ring): slot s is visible to the query at position q (0, else "
        "-1e4) when it holds a position below the call's first position and, with a window, above q - window")
    selector: HostSelector | None = Field(None, description="a DFlash2 drafter's selector walk, done by the host")
    logits_parts: dict[str, list[Count]] = Field(
        default_factory=dict, description="the ane layout's logits in parts of the vocabulary, by output name with "
        "their [first, end) rows (a head past the ANE's largest dim, 65,536): the host puts them side by side, in "
        "this order, as logits; none: the function returns logits whole")
    rules: list[str]


class Taps(Model):
    layers: list[Count]
    convention: str = TAP_CONVENTION
    scale: Positive = Field(1.0, description="the taps are the residual stream times this (rescale.residual_scale): a "
                            "drafter reads them so, its fc's norm folding the scale")


class Tokenizer(Model):
    tokenizer_json_sha256: str = Field(description="sha256 of tokenizer.json re-serialised canonically")
    probe_ids_sha256: str = Field(description="sha256 of the int32 ids the fixed probe text encodes to")
    probe_text_sha256: str
    vocab_size: Size
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    files: list[FileEntry]


class Weights(Model):
    dtype: str
    embedding_sha256: str = Field(description="sha256 of the embedding table exactly as shipped")
    lm_head_sha256: str = Field(description="sha256 of the lm_head exactly as shipped (the shared tensor if tied)")
    lm_head_tied: bool
    parameter_count: Count


class QuantizedLayer(Model):
    name: str
    method: str
    group_size: int
    bits_per_weight: float
    weight_mse: float
    gptq_output_error: float | None = None
    rtn_output_error: float | None = None
    damping: float | None = None
    cholesky_retries: int | None = None


class CalibrationIdentity(Model):
    corpus: str = Field(description="the recipe's corpus reference (fixture:SPLIT or path:FILE)")
    corpus_sha256: str = Field(description="sha256 of the UTF-8 text that was tokenized")
    n: int
    length: int
    seed: int


class Quantization(Model):
    method: Literal["affine4", "lut4", "affine4-gptq", "lut4-gptq", "exact"]
    bits: int = Field(4, description="bits per code: 4, or 2 for exact (a pre-quantized pack's own codes)")
    group_size: int = Field(description="lut4: output rows per table; affine4 and exact: input columns per group")
    bits_per_weight: float = Field(description="over every weight of the model, fp16 ones included")
    kept_fp16: list[str]
    calibration: CalibrationIdentity | None
    layers: list[QuantizedLayer]


class RescalePeak(Model):
    tensor: str = Field(description="the module that computed it, by qualified name")
    kind: Literal["input", "port", "output"] = Field(description="a product's input or output port, a module's output")
    peak: float = Field(description="its largest magnitude on the data measured, fp32")
    limit: float = Field(description="the device's: 32,768 at an ANE port, fp16's 65,504 elsewhere")
    scaled: float = Field(description="its peak once the scales are folded")


class Rescale(Model):
    """The function-preserving scales folded into the shipped weights (``convert/weights/rescale.py``): powers of two
    chosen from the peaks of the fp32 modules so that every tensor stays within its device limit over headroom."""

    device: Literal["ane", "gpu"]
    headroom: Positive
    windows: Count = Field(description="gate windows the peaks were measured on")
    residual_scale: Positive = Field(description="the residual stream times this: the rows entering the first layer "
                                     "(after the lookup; the host passes the table's rows as they are), every block's "
                                     "last linear, so the taps and the rows between parts; each norm reading it has "
                                     "its eps times the square")
    mlp_scales: dict[str, Positive] = Field(description="decoder layer -> its MLP intermediate divided by this "
                                            "(up_proj divided, down_proj multiplied); layers not listed: 1")
    tightest: list[RescalePeak] = Field(description="the tensors nearest their limits once scaled, tightest first")


class DeviceGate(Model):
    device: Literal["ane", "gpu"] = Field(description="the arithmetic of the device the layout targets: ane (the "
                                          "Neural Engine's) or gpu (Core ML on the GPU), emulated on the build's CPU")
    windows: int = Field(description="evaluation windows computed in that arithmetic")
    passed: bool
    metrics: dict[str, float]
    range: dict[str, str | int | float | bool | dict | list] = Field(
        description="the range verdict: limits by kind, tensors checked, those over their limit")


class Gate(Model):
    passed: bool
    data: dict[str, str | int] = Field(description="evaluation text identity: corpus, corpus_sha256, n, length, seed")
    thresholds: dict[str, float]
    metrics: dict[str, float]
    artifact: dict[str, str | int | float | bool | None] | None = Field(
        description="the .aimodel run on the Core AI runtime against the gated modules"
    )
    device: DeviceGate | None = Field(None, description="the shipped modules in the device's arithmetic against the "
                                      "fp32 reference (issue #40); none in bundles built before it")


class TensorDesc(Model):
    name: str
    shape: list[Count]
    dtype: str


class Function(Model):
    name: str
    inputs: list[TensorDesc]
    outputs: list[TensorDesc]
    states: list[TensorDesc]


class CompileStep(Model):
    kind: str
    status: Literal["done", "deferred", "failed"]
    reason: str = ""
    outputs: list[str] = Field([], description="relative to the bundle's compiled/ folder: a file or a folder")
    files: list[FileEntry] = Field([], description="every file of the outputs (a folder's recursively), relative to "
                                   "the bundle, hashed for `spec-convert verify`")


class Package(Model):
    format: Literal["coreai", "coreml"]
    path: str = Field(description="relative to the bundle, '/'-separated")
    part: str | None = Field(None, description="the part this package holds (a parted target's; see parts)")
    files: list[FileEntry]
    stable_hash: str = Field(description="sha256 over what is reproducible in the package (see stable_hash_scope)")
    stable_hash_scope: str
    check: dict[str, float | int | str | bool] = Field(default_factory=dict, description="read-back / run results")
    placement: list[str] | None = Field(
        None, description="the placement lint's findings: what the package's programs hold that a program the ANE "
        "runs whole does not (convert/verify/placement.py); empty: none; absent: not linted")
    compile: list[CompileStep] = []

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        return inside(path)


class Part(Model):
    """One package of a parted target (``convert/pipeline/partition.py``): what it holds, in the chain's order."""

    name: str
    embedding_rows: list[int] | None = Field(description="[first, end) vocabulary rows of the embedding it looks up "
                                             "(zero for other ids; the host adds the parts' rows up); in the ane "
                                             "layout the whole table of the host's lookup, whose rows this part takes "
                                             "as hidden_states (its package does not hold them)")
    layers: list[int] = Field(description="[first, end) decoder layers it runs; their states are its own")
    head_rows: list[int] | None = Field(description="[first, end) vocabulary rows of the lm_head it computes; a split "
                                        "head returns argmax_ids (vocabulary ids) and max_logit: the host keeps the "
                                        "first part's id on ties")
    taps: list[Count] = Field(description="tapped layers it returns, in the recipe's order")
    functions: list[Function] = Field(description="its functions: a part returns its rows as hidden_states_out, the "
                                      "next takes them as hidden_states")
    packages: list[str] = Field(description="paths of its packages, one per format")

    @field_validator("embedding_rows", "layers", "head_rows")
    @classmethod
    def _ranges(cls, rows: list[int] | None) -> list[int] | None:
        return _range(rows)


class DrafterInterface(Model):
    """What a target bundle ships for its drafter: the borrowed tensors as files, hashed."""

    lm_head_file: FileEntry = Field(
        description="lm_head.safetensors: the lm_head's weight as the target stores it (fp16; an exact pack's in its "
        "rotated basis, the graph rotating the head's input)"
    )
    embeddings_file: FileEntry = Field(
        description="embeddings.safetensors: the fp16 embedding rows as the target's lookups return them (an exact "
        "pack's after their rotation), which the host reads anchor rows from"
    )
    hidden_output: bool = Field(description="the target functions return the final-norm hidden states")


class BundleManifest(Model):
    """What every bundle's manifest starts with; ``identity`` is what its export id hashes."""

    schema_version: Literal["2"] = SCHEMA_VERSION
    kind: str
    name: str
    export_id: str = Field(description="sha256 of the identity fields (all but built_at, toolchain, compile, "
                           "records)")
    built_at: str
    toolchain: dict[str, str]
    source: Source
    records: list[FileEntry] = Field(
        [], description="files whose bytes vary from run to run (a target's gate_report.json: its timings), relative "
        "to the bundle, hashed for `spec-convert verify`, outside the export id")

    def identity(self) -> dict:
        """The fields the export id covers: everything but time, toolchain, later compile status and the records
        whose bytes vary from run to run."""
        data = self.model_dump(mode="json", exclude={"export_id", "built_at", "toolchain", "records"})
        for package in data["packages"]:
            package.pop("compile")
        return data


class Manifest(BundleManifest):
    kind: Literal["target"] = "target"
    architecture: Architecture
    host_contract: HostContract
    taps: Taps | None
    tokenizer: Tokenizer
    weights: Weights
    quantization: Quantization | None = None
    rescale: Rescale | None = Field(None, description="the range scales folded into the weights; null: not measured "
                                    "(a parted target's streamed build)")
    gate: Gate
    functions: list[Function] = Field(description="what the target computes for the host, whole or chained")
    parts: list[Part] | None = Field(None, description="a target over target.max_part_mb ships as parts, called in "
                                     "this order; null: one package per format holds it all")
    packages: list[Package]
    extra_files: list[FileEntry] = Field(description="LICENSE / NOTICE / tokenizer / config copied into the bundle")
    drafter_interface: DrafterInterface | None = None

    @model_validator(mode="after")
    def _packages_of_parts(self) -> Manifest:
        """A whole target's packages hold no part; a parted target's each hold one of its parts."""
        names = [p.name for p in self.parts] if self.parts is not None else []
        if len(set(names)) != len(names):
            raise ValueError("two parts share a name")
        for package in self.packages:
            if (package.part is None) != (self.parts is None) or (package.part is not None and package.part
                                                                   not in names):
                raise ValueError(f"package {quote(package.path, 60)}: part {quote(package.part, 60)} is not one of "
                                 f"the parts {quote(names, 100) if self.parts is not None else '(none: whole)'}")
        return self


class TargetBinding(Model):
    """The exact target build a drafter belongs to: the target manifest's records the drafter depends on, whole.
    ``spec-convert check-pair`` compares every field of every record, re-hashes the target bundle's borrowed files
    and recomputes its export id from its manifest."""

    export_id: str
    architecture: Architecture
    host_contract: HostContract = Field(description="how a runtime drives the target (its rollback, versioned)")
    tokenizer: Tokenizer
    weights: Weights = Field(description="lm_head and embedding hashes exactly as the target ships them")
    drafter_interface: DrafterInterface = Field(description="the target files the drafter reads, hashed")
    taps: Taps | None = None
    mask_token_id: int | None = None
    mask_row_sha256: str | None = Field(None, description="sha256 of the embedding row of mask_token_id, fp16")
    hidden_convention: str | None = Field(None, description="MTP: which target hidden state the head reads")


class DrafterArchitecture(Model):
    kind: Literal["dflash2", "dflash", "mtp"]
    architectures: list[str]
    layout: str = Field(description="checkpoint key layout the loader found")
    hidden_size: Size
    num_layers: Size
    num_heads: Size
    num_kv_heads: Size
    head_dim: Size
    intermediate_size: Size
    vocab_size: Size
    rope_theta: Positive
    rms_norm_eps: Positive
    parameter_count: Count
    runtime: dict[str, int | float | str | bool | None] = Field(
        description="block / draft width, context widths, ring rows, window, mask, conv and selector constants"
    )


class DrafterQuantization(Model):
    method: Literal["affine4", "lut4", "affine4-gptq", "lut4-gptq"]
    bits: int = 4
    group_size: int
    bits_per_weight: float = Field(description="over the drafter's own weights (borrowed lm_head excluded)")
    calibration: dict[str, str | int] | None = Field(
        None, description="GPTQ: the calibration prompts' identity (corpus, corpus_sha256, n, length, seed, tokens)"
    )
    layers: list[QuantizedLayer]


class DrafterManifest(BundleManifest):
    kind: Literal["drafter"] = "drafter"
    architecture: DrafterArchitecture
    target: TargetBinding
    quantization: DrafterQuantization | None = None
    acceptance: dict = Field(
        description="greedy speculative decoding with the shipped pair on held-out prompts: tokens_per_round, "
        "acceptance_by_position, the lossless counts; economics (bytes_per_call by side.function with weights and "
        "states, verify_cost and draft_cost in target decode calls, predicted_speedup); ngram (the prompt-lookup "
        "baseline on the same prompts and target: verify_calls, decode_calls, hit_rate, predicted_speedup); device "
        "(the pair in the devices' arithmetic on one held-out prompt: target_device, device, tokens_per_round beside "
        "fp32_tokens_per_round on that prompt, acceptance_by_position, lossless, the drafter's range verdict)")
    ab: dict | None = Field(None, description="quantized vs fp16 drafter, paired by text offset (quantized only)")
    rescale: Rescale | None = Field(None, description="the drafter's range scale: its residual stream times "
                                    "residual_scale (a DFlash2 drafter's includes its target's, whose embedding rows "
                                    "it starts from); null: not measured")
    host_contract: HostContract | None = Field(
        None, description="the ane layout's: what the host owns and computes for the drafter's functions (none: "
        "the package keeps its states and the caller passes ids and positions)")
    functions: list[Function]
    packages: list[Package]
    extra_files: list[FileEntry]

    @field_validator("acceptance")
    @classmethod
    def _acceptance_numbers(cls, acceptance: dict) -> dict:
        """The fields a reader formats as numbers are numbers (a string tokens_per_round is refused, not printed)."""
        for key in ("tokens_per_round", "rounds", "predicted_speedup"):
            value = acceptance.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not math.isfinite(value)):
                raise ValueError(f"{key} is {type(value).__name__}; expected a number")
        lossless = acceptance.get("lossless")
        if lossless is not None and not isinstance(lossless, bool):
            raise ValueError(f"lossless is {type(lossless).__name__}; expected true or false")
        return acceptance


def json_schema(model: type[Model] = Manifest) -> dict:
    return model.model_json_schema()


def write_schema() -> None:
    for model, path in ((Manifest, SCHEMA_PATH), (DrafterManifest, DRAFTER_SCHEMA_PATH)):
        path.write_text(json.dumps(json_schema(model), indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    write_schema()
