"""Qwen3.5: the family's constants, which configs it accepts, its args and the shapes a checkpoint must have."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert import fields
from convert.errors import InputError, quote
from convert.export.names import CONV_STATE, KEY_CACHE, PENDING_BA, PENDING_QKV, RECURRENT_STATE, VALUE_CACHE
from convert.models.qwen3.config import Qwen3Args

FAMILY = "qwen3_5"
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"
TEXT_PREFIXES = ("model.language_model.", "model.")  # Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM
VISION_PREFIX, MTP_PREFIX = "model.visual.", "mtp."
FUSED_MARKERS = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next's per-key-head-group fused projections
# transformers' Qwen3_5TextConfig defaults, used where config.json leaves a field out
DEFAULTS = dict(head_dim=256, partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, intermediate_size=12288,
                vocab_size=248320)
# Device-safe scaling (docs/hybrid.md): powers of two, so exact in fp32 and fp16 alike.
QUERY_SCALE, VALUE_SCALE = 16.0, 64.0
CHUNK = 64  # rows per chunk of the delta rule (a call's rows are processed in chunks of at most this many)
STATE_NAMES = (KEY_CACHE, VALUE_CACHE, CONV_STATE, RECURRENT_STATE, PENDING_QKV, PENDING_BA)
HOST_CONTRACT_NAME, HOST_CONTRACT_VERSION = "spec-convert/commit-next-call", 1
ANE_HOST_CONTRACT_NAME, ANE_HOST_CONTRACT_VERSION = "spec-convert/commit-next-call-host-buffers", 1  # layout ane
LAZY_FUNCTIONS = ("decode", "verify")  # rows left pending, committed by the next call's `accept`


def accepts(config: dict) -> bool:
    text = config.get("text_config", config)
    archs = set(config.get("architectures") or [])
    return bool(archs & set(ARCHITECTURES)) or str(text.get("model_type", config.get("model_type"))) in MODEL_TYPES


@dataclass(frozen=True)
class Qwen35Args:
    hidden_size: int = fields.declared()
    num_hidden_layers: int = fields.declared(maximum=fields.MAX_LAYERS)
    layer_types: tuple[str, ...]
    num_attention_heads: int = fields.declared()
    num_key_value_heads: int = fields.declared(default=lambda r: r["num_attention_heads"])
    head_dim: int = fields.declared(default=DEFAULTS["head_dim"])
    rotary_dim: int
    rope_theta: float = fields.rope_theta(DEFAULTS["rope_theta"])
    intermediate_size: int = fields.declared(default=DEFAULTS["intermediate_size"])
    vocab_size: int = fields.declared(default=DEFAULTS["vocab_size"])
    rms_norm_eps: float = fields.declared(kind=float, default=DEFAULTS["rms_norm_eps"])
    # a nested config's tying is the top-level field (what Qwen3_5ForConditionalGeneration ties by)
    tie_word_embeddings: bool = fields.declared(kind=bool, default=False, sources=("top",))
    max_position_embeddings: int = fields.declared(default=DEFAULTS["max_position_embeddings"])
    attention_bias: bool = fields.declared(kind=bool, default=False)
    linear_num_key_heads: int = fields.declared(default=DEFAULTS["linear_num_key_heads"])
    linear_num_value_heads: int = fields.declared(default=DEFAULTS["linear_num_value_heads"])
    linear_key_head_dim: int = fields.declared(default=DEFAULTS["linear_key_head_dim"])
    linear_value_head_dim: int = fields.declared(default=DEFAULTS["linear_value_head_dim"])
    linear_conv_kernel_dim: int = fields.declared(default=DEFAULTS["linear_conv_kernel_dim"])
    bos_token_id: int | None = fields.declared(kind=fields.TOKEN, default=None, sources=("", "top"))
    eos_token_id: int | None = fields.declared(kind=fields.TOKEN, default=None, sources=("", "top"))
    pad_token_id: int | None = fields.declared(kind=fields.TOKEN, default=None, sources=("", "top"))

    rope_type = "default"
    family = FAMILY
    unsafe_ops = ("silu", "softplus")  # replaced by device-safe forms; no package function may hold them

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> Qwen35Args:
        """The args from config.json (``text_config`` when nested); a field of the wrong type or a size below 1 is
        refused naming it (``convert/fields.py``); an absent field takes transformers' default (``DEFAULTS``)."""
        text = fields.section(config, where)
        if text.get("hidden_act", "silu") != "silu":
            raise InputError(f"{where}: hidden_act {quote(text['hidden_act'])}: only silu is supported")
        rope = fields.rope(text, where)
        r = fields.Reader(cls, where, {"": text, "top": config, "rope": rope},
                          missing="missing field {field!r} needed for a Qwen3.5 model")
        layers, _, heads = r.take("num_hidden_layers", "hidden_size", "num_attention_heads")
        layer_types = _layer_types(text, layers, where)
        head_dim = r["head_dim"]
        partial = fields.partial_rotary(rope, text, where, DEFAULTS["partial_rotary_factor"])
        rotary_dim = fields.rotary_dim(partial, head_dim, where)
        key_heads, value_heads = r.take("linear_num_key_heads", "linear_num_value_heads")
        if LINEAR in layer_types and value_heads % key_heads:
            raise InputError(f"{where}: linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads "
                             f"{key_heads} (value head j reads key head j // (value heads / key heads))")
        kv_heads = r["num_key_value_heads"]
        if FULL in layer_types:
            fields.check_heads(heads, kv_heads, where)
        r.take("tie_word_embeddings")  # checked before the rest, as it always was
        return r.build(layer_types=layer_types, rotary_dim=rotary_dim)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: the q | k | v rows of ``in_proj_qkv``."""
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_args(self) -> Qwen3Args:
        """A full-attention layer's shapes, for the shared attention and MLP modules."""
        return Qwen3Args(
            hidden_size=self.hidden_size, num_hidden_layers=len(self.full_layers),
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings, attention_bias=self.attention_bias,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )

    @property
    def parameter_count(self) -> int:
        return sum(torch.Size(s).numel() for s in expected_shapes(self).values())


def _layer_types(text: dict, layers: int, where: str) -> tuple[str, ...]:
    types = fields.strings(text, "layer_types", where)
    if types is None:
        interval = fields.integer(text, "full_attention_interval", where, DEFAULTS["full_attention_interval"])
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(layers))
    if len(types) != layers:
        raise InputError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers {layers}")
    for i, kind in enumerate(types):
        if kind not in (LINEAR, FULL):
            raise InputError(f"{where}: layer_types[{i}] is {quote(kind)}: a Qwen3.5 layer is {LINEAR!r} or "
                             f"{FULL!r}")
    return tuple(types)


def layer_shapes(args: Qwen35Args, i: int) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s tensors, canonical keys (``model.layers.{i}.``...), with their shapes."""
    h, p, inter = args.hidden_size, f"model.layers.{i}.", args.intermediate_size
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
              p + "mlp.down_proj.weight": (h, inter)}
    if args.layer_types[i] == LINEAR:
        a, hv = p + "linear_attn.", args.linear_num_value_heads
        shapes.update({a + "in_proj_qkv.weight": (args.conv_dim, h), a + "in_proj_z.weight": (args.value_dim, h),
                       a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                       a + "conv1d.weight": (args.conv_dim, 1, args.linear_conv_kernel_dim),
                       a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (args.linear_value_head_dim,),
                       a + "out_proj.weight": (h, args.value_dim)})
        return shapes
    a, d = p + "self_attn.", args.head_dim
    q, kv = args.num_attention_heads * d, args.num_key_value_heads * d
    shapes.update({a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                   a + "o_proj.weight": (h, q), a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    if args.attention_bias:
        shapes.update({a + "q_proj.bias": (2 * q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                       a + "o_proj.bias": (h,)})
    return shapes


def expected_shapes(args: Qwen35Args) -> dict[str, tuple[int, ...]]:
    """Every tensor of the text model, by canonical key (``model.*``, ``lm_head.weight``), with its shape."""
    shapes = {"model.embed_tokens.weight": (args.vocab_size, args.hidden_size),
              "model.norm.weight": (args.hidden_size,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, args.hidden_size)
    for i in range(args.num_hidden_layers):
        shapes.update(layer_shapes(args, i))
    return shapes


Args = Qwen35Args
PLAN_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "layer_types", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
PLAN_ALTERNATIVES = {"layer_types": ("full_attention_interval",)}
