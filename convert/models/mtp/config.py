"""MTP head: the constants, the head's args from the target's config and the shapes of its tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert import fields
from convert.errors import InputError, quote
from convert.models.qwen3.config import Qwen3Args, layer_shapes

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
