"""MTP head: the constants, the head's args from the target's config and the shapes of its tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert import fields
from convert.errors import InputError
from convert.export.names import KEY_CACHE, VALUE_CACHE
from convert.models.qwen3.config import DecoderArgs, Qwen3Args, layer_shapes

QWEN35, DEEPSEEK = "qwen3.5", "deepseek"
ZERO_CENTRED_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
# The same family's transformers defaults (configuration_qwen3_next.py, configuration_qwen3_5.py): attention always
# gated (q_proj of 2 x heads x head_dim rows), partial_rotary_factor 0.25 and head_dim 256 when the field is absent.
QWEN_NEXT_FAMILY = ZERO_CENTRED_MODEL_TYPES
FAMILY_PARTIAL_ROTARY, FAMILY_HEAD_DIM = 0.25, 256
DRAFT_STEPS = 3  # drafts per cycle: accept gives the first, draft_step the others; accept has S = DRAFT_STEPS + 1
STATE_NAMES = (KEY_CACHE, VALUE_CACHE)
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
class MTPArgs(DecoderArgs):
    """The head's args: a Qwen3 decoder's sizes (``num_hidden_layers`` the target's: DeepSeek's head sits at
    model.layers.{num_hidden_layers}) read from the target's config, ``text_config`` when present."""

    head_dim: int = fields.declared(default=lambda r: FAMILY_HEAD_DIM if r["family"] else
                                    r["hidden_size"] // r["num_attention_heads"])
    tie_word_embeddings: bool = fields.declared(kind=bool, default=False, sources=("", "top"))
    mtp_layers: int
    zero_centred_norm: bool
    model_type: str
    # q_proj gives [query | gate] per head; attention output * sigmoid(gate) before o_proj
    attn_output_gate: bool = fields.declared(kind=bool, sources=("", "top"), default=lambda r: r["family"])
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
        family = model_type in QWEN_NEXT_FAMILY  # transformers' defaults: gated, partial rotary 0.25, head_dim 256
        rope = fields.rope(text, where, " for an MTP head")
        partial = fields.partial_rotary(rope, text, where, FAMILY_PARTIAL_ROTARY if family else 1.0)
        r = fields.Reader(cls, where, {"": text, "top": top, "rope": rope},
                          missing="missing field {field!r} needed for an MTP head", family=family)
        _, heads = r.take("hidden_size", "num_attention_heads")
        rotary_dim = fields.rotary_dim(partial, r["head_dim"], where, "an MTP head ")
        fields.check_heads(heads, r["num_key_value_heads"], where)
        return r.build(mtp_layers=count, zero_centred_norm=model_type in ZERO_CENTRED_MODEL_TYPES,
                       model_type=model_type, rotary_dim=rotary_dim)

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
