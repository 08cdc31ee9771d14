"""Qwen3 dense: the family's constants, which configs it accepts, its args and the shapes a checkpoint must have."""

from __future__ import annotations

from dataclasses import dataclass

from convert import fields
from convert.errors import InputError, quote
from convert.export.names import (
    HIDDEN_STATES,
    HISTORY_MASK,
    KEY_CACHE,
    KEY_HISTORY,
    KEY_ROWS,
    ROPE_COS,
    ROPE_SIN,
    VALUE_CACHE,
    VALUE_HISTORY,
    VALUE_ROWS,
)

FAMILY = "qwen3"
ARCHITECTURES = ("Qwen3ForCausalLM",)
STATE_NAMES = (KEY_CACHE, VALUE_CACHE)
HOST_CONTRACT = {
    "name": "spec-convert/positional",
    "version": 1,
    "rollback": "positional",
    "inputs": {},
    "pending_rows": {},
    "rules": [
        "cache row c holds position c; each call writes its rows at its positions and a query at position p reads "
        "rows 0..p (the causal mask is computed in the graph from position_ids)",
        "after a verify, continue at the position after the last accepted token: the rejected rows lie beyond every "
        "later query's position until a later call overwrites them; nothing is copied",
        "positions must be below the context; a prompt's last prefill chunk may be right-padded (read the row of "
        "its last real token)",
    ],
}

HISTORY = {KEY_HISTORY: KEY_ROWS, VALUE_HISTORY: VALUE_ROWS}  # the ane layout's host buffers and their rows
ANE_HOST_CONTRACT = {  # the ane layout (convert/models/qwen3/ane.py): the same rollback, the history the host's
    "name": "spec-convert/positional-host-history",
    "version": 2,
    "rollback": "positional",
    "inputs": {HIDDEN_STATES: "the embedding rows of the call's ids [1, S, hidden], looked up by the host from "
                                "embeddings.safetensors (the first part's, or the whole target's)",
               ROPE_COS: "cos of the call's positions times RoPE's inverse frequencies [S, head_dim / 2]",
               ROPE_SIN: "their sin, as rope_cos",
               HISTORY_MASK: "[1, context]: 0 for the rows below the call's first position, -1e4 for the rest",
               KEY_HISTORY: "the host's key rows [layers, kv heads, context, head_dim], row c at position c",
               VALUE_HISTORY: "the host's value rows, as key_history"},
    "pending_rows": {},
    "buffers": {buffer: {"rows": rows, "axis": 2} for buffer, rows in HISTORY.items()},
    "rules": [
        "the functions take no input_ids: the host looks up the call's rows in embeddings.safetensors and passes them "
        "as hidden_states (to the first part; a part after it takes the previous part's hidden_states_out)",
        "the head returns logits [1, S, rows] and no argmax: the host takes each row's argmax (over a split head's "
        "parts in order, the lowest id among equal maxima)",
        "the package keeps no state: the host owns key_history and value_history, passes them to every call, and after "
        "each call writes the call's key_rows / value_rows (row j of each layer and head) at row position_ids[j]",
        "the functions take no position_ids: the host passes rope_cos / rope_sin (position x inverse "
        "frequencies, as transformers' default RoPE, in fp32 then the input's dtype) and history_mask",
        "a call reads the history rows below its first position and its own rows up to each query's position; rows "
        "at or past its first position are never read",
        "after a verify, continue at the position after the last accepted token: the rejected rows lie at or past the "
        "next call's first position and are overwritten before any call reads them; nothing is copied",
        "positions must be below the context; a prompt's last prefill chunk may be right-padded (read the row of "
        "its last real token)",
    ],
}


def accepts(config: dict) -> bool:
    text = config.get("text_config", config)
    return bool(set(text.get("architectures") or config.get("architectures") or []) & set(ARCHITECTURES)) or \
        text.get("model_type") == "qwen3"


NEXTN_LAYERS = fields.Declared("num_nextn_predict_layers", minimum=0, default=0)


@dataclass(frozen=True)
class DecoderArgs:
    """The sizes of a Qwen3 decoder, each declared as config.json gives it (``convert/fields.py``): a Qwen3 target's
    and an MTP head's (one Qwen3 decoder layer on a target, ``convert/models/mtp``) alike."""

    hidden_size: int = fields.declared()
    num_hidden_layers: int = fields.declared(maximum=fields.MAX_LAYERS)
    num_attention_heads: int = fields.declared()
    num_key_value_heads: int = fields.declared(default=lambda r: r["num_attention_heads"])
    head_dim: int = fields.declared(default=lambda r: r["hidden_size"] // r["num_attention_heads"])
    intermediate_size: int = fields.declared()
    vocab_size: int = fields.declared()
    rms_norm_eps: float = fields.declared(kind=float, default=1e-6)
    rope_theta: float = fields.rope_theta()
    tie_word_embeddings: bool = fields.declared(kind=bool, default=False)
    max_position_embeddings: int = fields.declared(default=32768)
    attention_bias: bool = fields.declared(kind=bool, default=False)


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs):
    bos_token_id: int | None = fields.declared(kind=fields.TOKEN, default=None)
    eos_token_id: int | None = fields.declared(kind=fields.TOKEN, default=None)
    pad_token_id: int | None = fields.declared(kind=fields.TOKEN, default=None)
    # an MTP head declared by the config (mtp_num_hidden_layers, else num_nextn_predict_layers): its tensors are
    # convert/models/mtp's, not ours
    mtp_layers: int = fields.declared("mtp_num_hidden_layers", minimum=0, zero_unset=True, init=0,
                                      default=lambda r: r.read(NEXTN_LAYERS))

    rope_type = "default"
    family = FAMILY

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> Qwen3Args:
        """Read transformers v4 (``rope_theta``) and v5 (``rope_parameters``) config styles; a field of the wrong
        type or a size below 1 is refused naming it (``convert/fields.py``)."""
        config = fields.section(config, where)
        archs = fields.strings(config, "architectures", where) or []
        if archs and not set(archs) & set(ARCHITECTURES):
            raise InputError(f"{where}: architectures {quote(archs)} is not a Qwen3 dense model "
                             f"({', '.join(ARCHITECTURES)})")
        rope = fields.rope(config, where)
        if fields.flag(config, "use_sliding_window", where):
            raise InputError(f"{where}: use_sliding_window=true is not supported (full attention only)")
        layer_types = fields.strings(config, "layer_types", where) or []
        if any(t != "full_attention" for t in layer_types):
            kinds = sorted(set(layer_types))
            raise InputError(f"{where}: layer_types {quote(kinds)}: only full_attention layers are supported")
        r = fields.Reader(cls, where, {"": config, "rope": rope},
                          missing="missing field {field!r} needed for a Qwen3 model")
        _, heads, kv_heads = r.take("hidden_size", "num_attention_heads", "num_key_value_heads")
        fields.check_heads(heads, kv_heads, where)
        return r.build()

    @property
    def parameter_count(self) -> int:
        h, d, q, kv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = h * d * (2 * q + 2 * kv) + 2 * d
        if self.attention_bias:
            attn += d * (q + 2 * kv) + h
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_hidden_layers * layer + heads * self.vocab_size * h + h


def layer_shapes(prefix: str, hidden: int, head_dim: int, heads: int, kv_heads: int, intermediate: int,
                 bias: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensors of one Qwen3 decoder layer (q/k norms, SwiGLU MLP) under ``prefix``, with their shapes; the
    drafters' layers are the same (DFlash2 adds its conv kernels, an MTP head is one such layer)."""
    h, d, q, kv, inter = hidden, head_dim, heads * head_dim, kv_heads * head_dim, intermediate
    shapes = {
        prefix + "self_attn.q_proj.weight": (q, h),
        prefix + "self_attn.k_proj.weight": (kv, h),
        prefix + "self_attn.v_proj.weight": (kv, h),
        prefix + "self_attn.o_proj.weight": (h, q),
        prefix + "self_attn.q_norm.weight": (d,),
        prefix + "self_attn.k_norm.weight": (d,),
        prefix + "mlp.gate_proj.weight": (inter, h),
        prefix + "mlp.up_proj.weight": (inter, h),
        prefix + "mlp.down_proj.weight": (h, inter),
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
    }
    if bias:
        shapes.update({prefix + "self_attn.q_proj.bias": (q,), prefix + "self_attn.k_proj.bias": (kv,),
                       prefix + "self_attn.v_proj.bias": (kv,), prefix + "self_attn.o_proj.bias": (h,)})
    return shapes


def expected_shapes(args: Qwen3Args) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3 checkpoint must hold, by transformers key, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, args.hidden_size),
                                          "model.norm.weight": (args.hidden_size,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, args.hidden_size)
    for i in range(args.num_hidden_layers):
        shapes.update(layer_shapes(f"model.layers.{i}.", args.hidden_size, args.head_dim, args.num_attention_heads,
                                   args.num_key_value_heads, args.intermediate_size, args.attention_bias))
    return shapes


Args = Qwen3Args
PLAN_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size")  # what a contract pins to plan the functions without the checkpoint
PLAN_ALTERNATIVES: dict[str, tuple[str, ...]] = {}
