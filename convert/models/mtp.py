"""MTP head (multi-token prediction): config args, checkpoint layouts, an eager reference and the export core.

An MTP head is one extra decoder block that drafts the token after next from the target's hidden state:

    h_out  = norm(layer(fc(cat[pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(hidden t)])))
    logits = target lm_head(h_out)

``hidden t`` is the target's final-norm output at position t (what its lm_head reads: docs/drafters.md,
"Hidden convention"); for a chained step it is the head's own previous ``h_out``. ``embed`` and ``lm_head``
are the target's, borrowed: the head ships neither.

Checkpoint layouts (detected from the keys; the head may sit in the target's full checkpoint, whose own
tensors are then ignored here, or in a checkpoint holding only the head):

* Qwen3.5 / Qwen3-Next: ``mtp.fc.weight`` [H, 2H], ``mtp.pre_fc_norm_embedding.weight``,
  ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight`` and the block under ``mtp.layers.0.``; the head
  count is ``mtp_num_hidden_layers`` (under ``text_config`` when there is one).
* DeepSeek: under ``model.layers.N.`` with N = the target's ``num_hidden_layers``: ``eh_proj`` (= fc),
  ``enorm`` (= pre_fc_norm_embedding), ``hnorm`` (= pre_fc_norm_hidden), ``shared_head.norm`` (= norm) and
  the block itself; the head count is ``num_nextn_predict_layers``. DeepSeek writers also store copies of
  the target's tables as ``model.layers.N.embed_tokens.weight`` and ``model.layers.N.shared_head.head.weight``:
  when present they must equal the target's embedding and lm_head bit for bit (``build_modules`` checks it and
  refuses naming the tensor), since the head was trained against them and the package uses the target's.

Both layouts are read into one canonical naming: the Qwen3.5 keys without ``mtp.`` (``fc.weight``,
``layers.0.self_attn.q_proj.weight`` ...), which is also the parameter naming of the modules here.

The block must be dense: GQA attention with q_norm/k_norm, a SwiGLU MLP. Two attention features of the
Qwen3-Next / Qwen3.5 full-attention layer are supported, exactly as transformers computes them
(transformers/models/qwen3_next/modeling_qwen3_next.py and qwen3_5/modeling_qwen3_5.py: ``*Attention.forward``,
``apply_rotary_pos_emb``, ``*RotaryEmbedding.compute_default_rope_parameters``):

* gated attention (``attn_output_gate``; transformers' Qwen3-Next / Qwen3.5 attention always has it, so it
  defaults to true for those model types and to false otherwise): ``q_proj`` has 2 x heads x head_dim rows,
  viewed per head as [query | gate] (2 x head_dim) and chunked in two; the attention output (heads x head_dim,
  before ``o_proj``) is multiplied by ``sigmoid(gate)``. The q_proj shape must agree with the config: a
  mismatch either way is refused naming the tensor and the expected shape.
* partial RoPE (``partial_rotary_factor``, in ``rope_parameters`` or at the top level; 0.25 for those model
  types when absent, as their transformers configs default it, 1 otherwise): the first
  ``rotary_dim = int(head_dim * factor)`` dims of each q/k head (after q_norm/k_norm) are rotated in the
  rotate-half layout with ``inv_freq = theta ** -(arange(0, rotary_dim, 2) / rotary_dim)``, the rest pass through.
  Qwen3.5's multimodal RoPE (``mrope_section``) equals this for text positions (its three position rows are
  equal); the head takes 1-D positions.

Refused with the key or field named: MLA attention (``kv_a_proj_with_mqa``, ``q_a_proj``, ``kv_b_proj``),
MoE MLPs (``mlp.experts.*``, ``mlp.gate.weight``, ``mlp.shared_expert*``), more than one head layer, RoPE
scaling, a rotary dim that is not a positive even number.

RMSNorm style: zero-centred, ``x_normed * (1 + w)``, exactly when the config's model_type (of
``text_config`` when present) is one of ``ZERO_CENTRED_MODEL_TYPES`` (the Qwen3-Next and Qwen3.5 families,
whose transformers RMSNorm is ``(1 + weight)``); plain ``x_normed * w`` otherwise (Qwen3, DeepSeek). It
applies to every norm of the head: the two pre-fc norms, the block's norms including q_norm/k_norm, the
final norm.

Positions: a head row whose input token sits at position p = t + 1 has RoPE position p and writes cache row
p. Cache row 0 is never a head row (the first row's token is at position 1), so the mask hides it: a query
at p sees rows 1..p. RoPE is relative, so using t + 1 for every row instead of t (vLLM's choice) gives the
same attention. Rollback is positional, as for the target: rows past the query are never visible and the
next ``accept`` overwrites the rows ``draft_step`` wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from convert import fields
from convert.errors import InputError, quote
from convert.export.functions import ExportModules, FunctionModule
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.inputs.sources import tensor_shapes, weight_files
from convert.models.qwen3.config import Qwen3Args, layer_shapes
from convert.models.qwen3.core import DecoderLayer, RMSNorm, register_positions
from convert.models.qwen3_5.core import GatedAttention, ZeroCentredRMSNorm, zero_centre_norms

QWEN35, DEEPSEEK = "qwen3.5", "deepseek"
ZERO_CENTRED_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
# The same family's transformers defaults (configuration_qwen3_next.py, configuration_qwen3_5.py): attention always
# gated (q_proj of 2 x heads x head_dim rows), partial_rotary_factor 0.25 and head_dim 256 when the field is absent.
QWEN_NEXT_FAMILY = ZERO_CENTRED_MODEL_TYPES
FAMILY_PARTIAL_ROTARY, FAMILY_HEAD_DIM = 0.25, 256
DRAFT_STEPS = 3  # drafts per cycle: accept gives the first, draft_step the others; accept has S = DRAFT_STEPS + 1
STATE_NAMES = ("key_cache", "value_cache")
HEAD_COUNT_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
DEEPSEEK_ALIASES = {  # DeepSeek key (under model.layers.N.) -> canonical key
    "eh_proj.weight": "fc.weight",
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "shared_head.norm.weight": "norm.weight",
}
DEEPSEEK_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
MLA_MARKERS = ("kv_a_proj_with_mqa", "q_a_proj", "kv_b_proj")
MOE_MARKERS = ("mlp.experts.", "mlp.gate.weight", "mlp.shared_expert", "e_score_correction_bias")


@dataclass(frozen=True)
class MTPArgs:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    num_hidden_layers: int  # the target's: DeepSeek's head sits at model.layers.{num_hidden_layers}
    mtp_layers: int
    zero_centred_norm: bool
    model_type: str
    attn_output_gate: bool  # q_proj gives [query | gate] per head; attention output * sigmoid(gate) before o_proj
    rotary_dim: int  # int(head_dim * partial_rotary_factor): the rotated leading dims of a q/k head

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> MTPArgs:
        """The head's shapes from the target's config (``text_config`` when present) plus its head count."""
        top, text = config, fields.section(config, where)
        count_field, count = next(
            ((f, fields.integer(c, f, where, minimum=0)) for c in (text, top) for f in HEAD_COUNT_FIELDS
             if c.get(f) is not None), (None, 0)
        )
        if not count:
            raise InputError(
                f"{where}: declares no MTP head: set mtp_num_hidden_layers (Qwen3.5 style, under text_config) "
                "or num_nextn_predict_layers (Qwen3-Next / DeepSeek style) to 1"
            )
        if count != 1:
            raise InputError(f"{where}: {count_field}={count}: only a single MTP head layer is supported for now")
        model_type = str(text.get("model_type") or top.get("model_type") or "")
        zero_centred = model_type in ZERO_CENTRED_MODEL_TYPES
        family = model_type in QWEN_NEXT_FAMILY
        rope = fields.mapping(text, "rope_parameters", where)
        scaling = fields.mapping(text, "rope_scaling", where)
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise InputError(f"{where}: rope type {quote(rope_type)} is not supported for an MTP head (only "
                             "'default')")
        # transformers' PreTrainedConfig.convert_rope_params_to_dict: rope_parameters first, then the top-level
        # field, then the config class's default (0.25 for the Qwen3-Next / Qwen3.5 configs, else none: 1.0)
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
        partial = fields.check_number(partial if partial is not None else FAMILY_PARTIAL_ROTARY if family else 1.0,
                                      "partial_rotary_factor", where, positive=False)
        gate = text.get("attn_output_gate", top.get("attn_output_gate"))
        need = " needed for an MTP head"
        hidden = fields.integer(text, "hidden_size", where, needed=need)
        heads = fields.integer(text, "num_attention_heads", where, needed=need)
        head_dim = fields.integer(text, "head_dim", where, FAMILY_HEAD_DIM if family else hidden // heads)
        # compute_default_rope_parameters: dim = int(head_dim * partial_rotary_factor)
        rotary_dim = int(head_dim * partial) if 0 < partial <= 1 else 0
        if not (0 < partial <= 1 and rotary_dim > 0 and rotary_dim % 2 == 0):
            raise InputError(
                f"{where}: partial_rotary_factor={partial} gives {rotary_dim} rotary dims of head_dim {head_dim}: "
                "an MTP head needs a positive even number, at most head_dim"
            )
        kv_heads = fields.integer(text, "num_key_value_heads", where, heads)
        if heads % kv_heads:
            raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings"))
        theta = fields.number(text, "rope_theta", where, 10000.0)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=fields.integer(text, "intermediate_size", where, needed=need),
            vocab_size=fields.integer(text, "vocab_size", where, needed=need),
            rms_norm_eps=fields.number(text, "rms_norm_eps", where, 1e-6),
            rope_theta=fields.number(rope, "rope_theta", where, theta, field="rope_parameters.rope_theta"),
            tie_word_embeddings=fields.check_flag(False if tie is None else tie, "tie_word_embeddings", where),
            attention_bias=fields.flag(text, "attention_bias", where),
            max_position_embeddings=fields.integer(text, "max_position_embeddings", where, 32768),
            num_hidden_layers=fields.integer(text, "num_hidden_layers", where, maximum=fields.MAX_LAYERS,
                                             needed=need),
            mtp_layers=count,
            zero_centred_norm=zero_centred,
            model_type=model_type,
            attn_output_gate=fields.check_flag(family if gate is None else gate, "attn_output_gate", where),
            rotary_dim=rotary_dim,
        )

    @property
    def q_rows(self) -> int:
        """q_proj's output rows: heads x head_dim, twice that with the attention output gate."""
        return (2 if self.attn_output_gate else 1) * self.num_attention_heads * self.head_dim

    @property
    def block_args(self) -> Qwen3Args:
        """The head's decoder block as a one-layer Qwen3 (for the shared Attention / MLP / DecoderLayer)."""
        return Qwen3Args(
            hidden_size=self.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    @property
    def parameter_count(self) -> int:
        """The head's own parameters (the borrowed embedding and lm_head not counted)."""
        return sum(torch.Size(s).numel() for s in canonical_shapes(self).values())


def canonical_shapes(args: MTPArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head under its canonical name (the Qwen3.5 key without ``mtp.``)."""
    h = args.hidden_size
    shapes = {
        "fc.weight": (h, 2 * h),
        "pre_fc_norm_embedding.weight": (h,),
        "pre_fc_norm_hidden.weight": (h,),
        "norm.weight": (h,),
    }
    shapes.update(layer_shapes("layers.0.", h, args.head_dim, args.num_attention_heads, args.num_key_value_heads,
                               args.intermediate_size, args.attention_bias))
    shapes["layers.0.self_attn.q_proj.weight"] = (args.q_rows, h)  # the gated q_proj: [query | gate] per head
    if args.attention_bias:
        shapes["layers.0.self_attn.q_proj.bias"] = (args.q_rows,)
    return shapes


def head_prefix(args: MTPArgs, layout: str) -> str:
    return "mtp." if layout == QWEN35 else f"model.layers.{args.num_hidden_layers}."


def checkpoint_key(canonical: str, args: MTPArgs, layout: str) -> str:
    """The key a canonical tensor has in a checkpoint of ``layout``."""
    if layout == QWEN35:
        return "mtp." + canonical
    alias = {v: k for k, v in DEEPSEEK_ALIASES.items()}.get(canonical)
    return head_prefix(args, layout) + (alias or canonical.removeprefix("layers.0."))


def expected_shapes(args: MTPArgs, layout: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the head must have, by checkpoint key, with its shape."""
    return {checkpoint_key(k, args, layout): v for k, v in canonical_shapes(args).items()}


def optional_shapes(args: MTPArgs, layout: str) -> dict[str, tuple[int, ...]]:
    """Tensors a head may carry besides its own: DeepSeek's copies of the target's embedding and lm_head."""
    if layout != DEEPSEEK:
        return {}
    shape = (args.vocab_size, args.hidden_size)
    return {head_prefix(args, layout) + k: shape for k in DEEPSEEK_COPIES}


def detect_layout(shapes: dict[str, tuple[int, ...]], args: MTPArgs, where: str = "checkpoint") -> str:
    qwen35 = any(k.startswith("mtp.") for k in shapes)
    deepseek = any(k.startswith(head_prefix(args, DEEPSEEK)) for k in shapes)
    if qwen35 and deepseek:
        raise InputError(
            f"{where}: holds both mtp.* and {head_prefix(args, DEEPSEEK)}* tensors; keep one MTP head layout"
        )
    if not (qwen35 or deepseek):
        raise InputError(
            f"{where}: no MTP head tensors: expected mtp.* (Qwen3.5 style) or {head_prefix(args, DEEPSEEK)}* "
            f"(DeepSeek style, N = num_hidden_layers = {args.num_hidden_layers})"
        )
    return QWEN35 if qwen35 else DEEPSEEK


def sanitize(shapes_in_checkpoint: dict[str, tuple[int, ...]], args: MTPArgs, where: str = "checkpoint") -> str:
    """Refuse a head whose keys or shapes are not exactly a dense MTP head's, naming the tensor; return the layout.

    Only the head's tensors (under its prefix) are checked; the target's own tensors in the same checkpoint are
    ignored here (the target's sanitize checks them).
    """
    layout = detect_layout(shapes_in_checkpoint, args, where)
    prefix = head_prefix(args, layout)
    present = {k: tuple(v) for k, v in shapes_in_checkpoint.items() if k.startswith(prefix)}
    for key in sorted(present):
        if any(m in key for m in MLA_MARKERS):
            raise InputError(
                f"{where}: tensor {key!r}: MLA attention in the MTP head is not supported (dense GQA only)"
            )
        if any(m in key for m in MOE_MARKERS):
            raise InputError(
                f"{where}: tensor {key!r}: a mixture-of-experts MLP in the MTP head is not supported "
                "(dense SwiGLU MLP only)"
            )
    expected = expected_shapes(args, layout)
    q_key = checkpoint_key("layers.0.self_attn.q_proj.weight", args, layout)
    plain_rows = args.num_attention_heads * args.head_dim
    other = (plain_rows if args.attn_output_gate else 2 * plain_rows, args.hidden_size)
    if present.get(q_key) == other:
        found = "heads x head_dim rows: no" if args.attn_output_gate else "2 x heads x head_dim rows: an"
        wants = "asks for" if args.attn_output_gate else "has no"
        raise InputError(
            f"{where}: tensor {q_key!r} has shape {list(other)} ({found} attention output gate), but the config "
            f"{wants} gated attention (attn_output_gate={str(args.attn_output_gate).lower()}; absent, it is true "
            f"for the Qwen3-Next / Qwen3.5 model types, false otherwise); expected {list(expected[q_key])}"
        )
    for key, shape in expected.items():
        if key not in present:
            raise InputError(f"{where}: tensor {key!r} is missing (expected shape {list(shape)})")
        if present[key] != shape:
            raise InputError(f"{where}: tensor {key!r} has shape {list(present[key])}, expected {list(shape)}")
    optional = optional_shapes(args, layout)
    for key, shape in optional.items():
        if key in present and present[key] != shape:
            raise InputError(f"{where}: tensor {key!r} has shape {list(present[key])}, expected {list(shape)}")
    unknown = sorted(set(present) - set(expected) - set(optional))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise InputError(
            f"{where}: unexpected tensor {unknown[0]!r}{more} in the MTP head (a dense one-layer head has "
            f"{len(expected)} tensors under {prefix!r})"
        )
    return layout


@dataclass
class HeadWeights:
    """A checked head: its layout, its tensors by canonical name and DeepSeek's copies (by target key)."""

    layout: str
    tensors: dict[str, torch.Tensor]
    copies: dict[str, torch.Tensor]  # "model.embed_tokens.weight" / "lm_head.weight" -> the head's copy


def head_weights(tensors: dict[str, torch.Tensor], args: MTPArgs, where: str = "checkpoint") -> HeadWeights:
    """Check and rename a head from checkpoint tensors (the target's own tensors may be among them)."""
    layout = sanitize({k: tuple(v.shape) for k, v in tensors.items()}, args, where)
    return _rename(layout, tensors, args)


def load_head(directory: Path, args: MTPArgs) -> HeadWeights:
    """Read only the head's tensors of a safetensors checkpoint (the target's, if present, are not read)."""
    where = f"checkpoint {directory}"
    layout = sanitize(tensor_shapes(directory), args, where)
    prefix = head_prefix(args, layout)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    tensors[name] = f.get_tensor(name)
    return _rename(layout, tensors, args)


def _rename(layout: str, tensors: dict[str, torch.Tensor], args: MTPArgs) -> HeadWeights:
    own = {c: tensors[checkpoint_key(c, args, layout)] for c in canonical_shapes(args)}
    prefix = head_prefix(args, layout)
    copies = {
        t: tensors[prefix + k] for k, t in DEEPSEEK_COPIES.items() if layout == DEEPSEEK and prefix + k in tensors
    }
    return HeadWeights(layout=layout, tensors=own, copies=copies)


def borrowed_tables(
    args: MTPArgs, head: HeadWeights, target_tensors: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding table and lm_head (the embedding again when tied), checked against the head.

    A copy the head carries (DeepSeek layout) must equal the target's tensor exactly, or the head would run
    against tables it was not trained with: refused naming the tensor.
    """
    shape = (args.vocab_size, args.hidden_size)
    keys = {"model.embed_tokens.weight": "model.embed_tokens.weight"}
    keys["lm_head.weight"] = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    tables = {}
    for role, key in keys.items():
        if key not in target_tensors:
            raise InputError(f"target checkpoint: tensor {key!r} is missing (expected shape {list(shape)})")
        if tuple(target_tensors[key].shape) != shape:
            raise InputError(
                f"target checkpoint: tensor {key!r} has shape {list(target_tensors[key].shape)}, the MTP head needs "
                f"{list(shape)}"
            )
        tables[role] = target_tensors[key]
    for role, copy in head.copies.items():
        if not torch.equal(copy.to(tables[role].dtype), tables[role]):
            name = next(k for k, t in DEEPSEEK_COPIES.items() if t == role)
            raise InputError(
                f"MTP head tensor {head_prefix(args, head.layout) + name!r} differs from the target's {role!r}: the "
                "head was trained against other tables than this target's; use the matching target"
            )
    return tables["model.embed_tokens.weight"], tables["lm_head.weight"]


class MTPHead(nn.Module):
    """The head's parameters (canonical names) plus the borrowed target embedding and lm_head.

    Shared by the export core and the eager reference, so both load, and a trained reference saves, the same
    names: ``"mtp." + name`` is the Qwen3.5 checkpoint key of every parameter but the two borrowed tables.
    """

    def __init__(self, args: MTPArgs):
        super().__init__()
        self.args = args
        h = args.hidden_size
        norm = ZeroCentredRMSNorm if args.zero_centred_norm else RMSNorm
        self.embed_tokens = nn.Embedding(args.vocab_size, h)
        self.lm_head = nn.Linear(h, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.pre_fc_norm_embedding = norm(h, args.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(h, args.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(args.block_args, 0)])
        for layer in self.layers:
            layer.self_attn = GatedAttention(args.block_args, 0, args.attn_output_gate, args.rotary_dim)
        self.norm = norm(h, args.rms_norm_eps)
        if args.zero_centred_norm:
            zero_centre_norms(self.layers)

    def load_weights(self, head: HeadWeights, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        own = dict(self.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in head.tensors.items():
                own[name].copy_(tensor.to(own[name].dtype))
            self.embed_tokens.weight.copy_(embed_tokens.to(self.embed_tokens.weight.dtype))
            if not self.args.tie_word_embeddings:
                self.lm_head.weight.copy_(lm_head.to(self.lm_head.weight.dtype))

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own tensors under their Qwen3.5 checkpoint keys (``mtp.*``), borrowed tables left out."""
        return {"mtp." + k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens", "lm_head"))}

    def fused_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc(cat[pre_fc_norm_embedding(embed(ids)), pre_fc_norm_hidden(hidden)]): concat order [embedding, hidden]."""
        embedded = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        return self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden.to(embedded.dtype))], dim=-1))


@dataclass
class MTPOutput:
    hidden_out: torch.Tensor  # [B, T, H]: the head's final-norm output, fed to lm_head and to the next step
    logits: torch.Tensor  # [B, T, V]


class MTPReference(MTPHead):
    """Plain eager head over whole sequences, no cache: the readable definition the export is checked against.

    ``forward`` runs rows causally (row i sees rows 0..i of its own sequence; RoPE from ``position_ids``, by
    default 1..T: the position of each row's input token). ``chain`` is the batched training form of chained
    drafting: step 1 is ``forward``; step k > 1 at row t takes ``step_ids[k-1][t]`` and step k-1's ``hidden_out``
    at row t, sits at position p_t + k - 1 and sees step 1's rows 0..t plus its own row t of every step 2..k:
    exactly the cache rows a ``draft_step`` sees after an ``accept`` (rows up to p_t from the accept, then one
    row per draft step).
    """

    def forward(self, input_ids, hidden, position_ids=None) -> MTPOutput:
        return self.chain([input_ids], hidden, position_ids)[0]

    def chain(self, step_ids: list[torch.Tensor], hidden: torch.Tensor, position_ids=None) -> list[MTPOutput]:
        if position_ids is None:
            position_ids = torch.arange(1, step_ids[0].shape[1] + 1, device=hidden.device).expand_as(step_ids[0])
        outputs: list[MTPOutput] = []
        earlier: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        for k, ids in enumerate(step_ids):
            x = self.fused_input(ids, hidden)
            cos, sin = self.rope(position_ids + k)
            for layer, kv in zip(self.layers, earlier, strict=True):
                x = self.decoder_layer(layer, x, cos, sin, kv)
            hidden_out = self.norm(x)
            outputs.append(MTPOutput(hidden_out=hidden_out, logits=self.lm_head(hidden_out)))
            hidden = hidden_out
        return outputs

    def decoder(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The head's decoder layers alone over whole sequences x [B, T, H] (causal), at ``position_ids`` [B, T]."""
        cos, sin = self.rope(position_ids)
        for layer in self.layers:
            x = self.decoder_layer(layer, x, cos, sin, [])
        return x

    def decoder_layer(self, layer, x, cos, sin, earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = x + self.attention(layer.self_attn, layer.input_layernorm(x), cos, sin, earlier)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, rotary_dim] in fp32, as transformers' Qwen3-Next rotary embedding (default RoPE over
        the rotary dims: ``compute_default_rope_parameters`` and ``forward``, the angles repeated twice)."""
        r = self.args.rotary_dim
        inv_freq = 1.0 / (self.args.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
        angles = position_ids.float()[..., None] * inv_freq.to(position_ids.device)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos()[:, None], angles.sin()[:, None]

    @staticmethod
    def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' ``apply_rotary_pos_emb``: rotate the first cos.shape[-1] dims, pass the rest through."""
        r = cos.shape[-1]
        x_rot, x_pass = x[..., :r], x[..., r:]
        rotated_half = torch.cat([-x_rot[..., r // 2 :], x_rot[..., : r // 2]], dim=-1)
        return torch.cat([x_rot * cos.to(x.dtype) + rotated_half * sin.to(x.dtype), x_pass], dim=-1)

    def attention(self, attn, x, cos, sin, earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """GQA attention over this step's rows and the earlier steps' (``earlier`` gets this step's K, V).

        With the output gate, q_proj's rows per head are [query | gate] and the attention output is multiplied
        by sigmoid(gate) before o_proj (transformers' ``Qwen3NextAttention.forward``).
        """
        batch, rows, _ = x.shape
        heads, kv_heads, d = attn.heads, attn.kv_heads, attn.head_dim
        if self.args.attn_output_gate:
            q, gate = torch.chunk(attn.q_proj(x).view(batch, rows, heads, 2 * d), 2, dim=-1)
            gate = gate.reshape(batch, rows, heads * d)
        else:
            q, gate = attn.q_proj(x).view(batch, rows, heads, d), None
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(batch, rows, kv_heads, d)).transpose(1, 2)
        v = attn.v_proj(x).view(batch, rows, kv_heads, d).transpose(1, 2)
        q, k = self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)
        earlier.append((k, v))
        causal = torch.ones(rows, rows, dtype=torch.bool, device=x.device).tril()
        own_row = torch.eye(rows, dtype=torch.bool, device=x.device)
        visible = torch.cat([causal] + [own_row] * (len(earlier) - 1), dim=1)  # [T, T * steps]
        keys = torch.cat([k for k, _ in earlier], dim=2).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([v for _, v in earlier], dim=2).repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ keys.transpose(-1, -2)).float() * d**-0.5
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q.dtype)
        out = (probs @ values).transpose(1, 2).reshape(batch, rows, heads * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return attn.o_proj(out)


class MTPCore(MTPHead):
    """The export core behind ``accept`` and ``draft_step``: static shapes, the head's KV cache as states.

    ``forward(input_ids [1,S] int32, hidden [1,S,H], position_ids [1,S] int32, key_cache, value_cache)``
    returns ``draft_ids`` [1,S] int32 (argmax of the target's lm_head over the head's output), ``hidden_out``
    [1,S,H] and ``logits`` [1,S,V]; each FunctionModule picks what its spec names. The caches are
    [1, kv_heads, context, head_dim], row p holding position p (row 0 unused, hidden by the mask).
    """

    def __init__(self, args: MTPArgs, context: int):
        super().__init__(args)
        self.context = context
        # cos/sin over the rotary dims only (inv_freq as transformers' compute_default_rope_parameters), fp32
        register_positions(self, args.rotary_dim, args.rope_theta, context, args.num_key_value_heads)

    def forward(self, input_ids, hidden, position_ids, key_cache, value_cache):
        x = self.fused_input(input_ids[0].long(), hidden[0])  # [S, H]
        hidden_out = self.norm(self.decoder(x, position_ids, key_cache, value_cache))
        logits = self.lm_head(hidden_out)[None]
        return {"draft_ids": logits.argmax(-1).to(torch.int32), "hidden_out": hidden_out[None], "logits": logits}

    def decoder(self, x, position_ids, key_cache, value_cache):
        """The head's decoder layers over rows x [S, H] at ``position_ids`` [1, S] int32, writing their cache rows."""
        dtype = self.fc.weight.dtype
        positions = position_ids[0].long()
        cos, sin = self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)
        rows = self.cache_rows[None, :]
        visible = (rows <= position_ids[0][:, None]) & (rows >= 1)  # [S, context]; row 0 is never a head row
        mask_bias = torch.where(visible, 0.0, -1e4).to(dtype)
        cache_rows = positions[None, :].expand(self.args.num_key_value_heads, -1)  # [Hkv, S]
        heads_rows = (self.kv_head_index.expand_as(cache_rows), cache_rows)
        for layer in self.layers:
            x = layer(x, cos, sin, heads_rows, mask_bias, key_cache, value_cache)
        return x

    def cache_shape(self) -> tuple[int, int, int, int]:
        return (self.args.mtp_layers, self.args.num_key_value_heads, self.context, self.args.head_dim)


def function_specs(
    args: MTPArgs,
    draft_steps: int = DRAFT_STEPS,
    context: int = 2048,
    dtype: torch.dtype = torch.float16,
    logits: bool = False,
) -> list[FunctionSpec]:
    """``accept`` (S = draft_steps + 1) and ``draft_step`` (S = 1): same inputs, outputs and states."""
    if draft_steps < 1:
        raise InputError(f"draft steps must be at least 1, got {draft_steps}")
    fdtype = DTYPE_NAMES[dtype]
    cache = (args.mtp_layers, args.num_key_value_heads, context, args.head_dim)
    states = tuple(TensorSpec(name, cache, fdtype) for name in STATE_NAMES)
    specs = []
    for name, width in (("accept", draft_steps + 1), ("draft_step", 1)):
        inputs = (
            TensorSpec("input_ids", (1, width), "int32"),
            TensorSpec("hidden", (1, width, args.hidden_size), fdtype),
            TensorSpec("position_ids", (1, width), "int32"),
        )
        outputs = [
            TensorSpec("draft_ids", (1, width), "int32"),
            TensorSpec("hidden_out", (1, width, args.hidden_size), fdtype),
        ]
        if logits:
            outputs.append(TensorSpec("logits", (1, width, args.vocab_size), fdtype))
        specs.append(FunctionSpec(name=name, inputs=inputs, outputs=tuple(outputs), states=states))
    return specs


@dataclass
class MTPModules(ExportModules):
    core: MTPCore

    def call(self, name: str, input_ids, hidden, position_ids) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states; returns every core output, logits included."""
        module, spec = self.functions[name]
        dtype = self.core.fc.weight.dtype
        ids = torch.as_tensor(input_ids, dtype=torch.int32).reshape(1, -1)
        hid = torch.as_tensor(hidden).to(dtype).reshape(1, -1, self.core.args.hidden_size)
        pos = torch.as_tensor(position_ids, dtype=torch.int32).reshape(1, -1)
        if ids.shape != spec.inputs[0].shape or hid.shape != spec.inputs[1].shape or pos.shape != ids.shape:
            raise ValueError(
                f"{name} takes input_ids/position_ids {list(spec.inputs[0].shape)} and hidden "
                f"{list(spec.inputs[1].shape)}, got {list(ids.shape)}, {list(pos.shape)}, {list(hid.shape)}"
            )
        with torch.no_grad():
            return module.core(ids, hid, pos, *(getattr(module, s.name) for s in spec.states))


def build_modules(
    args: MTPArgs,
    head: HeadWeights,
    target_tensors: dict[str, torch.Tensor],
    context: int,
    draft_steps: int = DRAFT_STEPS,
    dtype: torch.dtype = torch.float16,
    logits: bool = False,
) -> MTPModules:
    """Export modules in ``dtype`` over one core (the head's weights and the borrowed target tables, once) and one
    pair of KV states; ``target_tensors`` needs the target's ``model.embed_tokens.weight`` and ``lm_head.weight``."""
    embed_tokens, lm_head = borrowed_tables(args, head, target_tensors)
    core = MTPCore(args, context)
    core.load_weights(head, embed_tokens, lm_head)
    core = core.to(dtype).eval()
    for p in core.parameters():
        p.requires_grad_(False)
    specs = function_specs(args, draft_steps, context, dtype, logits)
    states = {s.name: torch.zeros(s.shape, dtype=dtype) for s in specs[0].states}
    functions = {s.name: (FunctionModule(core, s, states), s) for s in specs}
    return MTPModules(core=core, functions=functions)


def build_reference(
    args: MTPArgs, head: HeadWeights, target_tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> MTPReference:
    """The eager reference filled with the same weights as ``build_modules``."""
    embed_tokens, lm_head = borrowed_tables(args, head, target_tensors)
    reference = MTPReference(args)
    reference.load_weights(head, embed_tokens, lm_head)
    return reference.to(dtype).eval()
