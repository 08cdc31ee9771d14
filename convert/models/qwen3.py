"""Qwen3 dense target: config args, checkpoint key mapping and the export core.

The core is written for static-shape export, not for training: explicit ``input_ids`` and
``position_ids`` (int32), KV caches passed in as state tensors [layers, kv_heads, context, head_dim]
and written at the host's positions with ``index_put_`` (an index tensor for every cache dimension:
the one scatter form that both coremltools and torch.export + coreai-torch convert), a causal mask
computed in the graph from the positions (cache row c holds position c, so a query at position p sees
rows 0..p: rows the host rolled back are simply never visible again and are overwritten by the next
write), and RoPE read from cos/sin tables by position (exact in fp32, and free of the fp16 precision loss that computing
``position * inv_freq`` in fp16 would bring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from convert import fields
from convert.errors import InputError, quote
from convert.export import functions as export
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.layout import Layout
from convert.models.part import (
    Part,
    build_embedding,
    build_head,
    function_widths,
    part_input,
    part_outputs,
    part_tensors,
)

FAMILY = "qwen3"
ARCHITECTURES = ("Qwen3ForCausalLM",)
STATE_NAMES = ("key_cache", "value_cache")
KEEP_FP16 = ()  # every 2-D weight of a dense layer is a large linear
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


def accepts(config: dict) -> bool:
    text = config.get("text_config", config)
    return bool(set(text.get("architectures") or config.get("architectures") or []) & set(ARCHITECTURES)) or \
        text.get("model_type") == "qwen3"


@dataclass(frozen=True)
class Qwen3Args:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    mtp_layers: int = 0  # an MTP head declared by the config: its tensors are convert/models/mtp.py's, not ours

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
        rope = fields.mapping(config, "rope_parameters", where)
        scaling = fields.mapping(config, "rope_scaling", where)
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise InputError(f"{where}: rope type {quote(rope_type)} is not supported yet (only 'default')")
        if fields.flag(config, "use_sliding_window", where):
            raise InputError(f"{where}: use_sliding_window=true is not supported (full attention only)")
        layer_types = fields.strings(config, "layer_types", where) or []
        if any(t != "full_attention" for t in layer_types):
            kinds = sorted(set(layer_types))
            raise InputError(f"{where}: layer_types {quote(kinds)}: only full_attention layers are supported")
        need = " needed for a Qwen3 model"
        hidden = fields.integer(config, "hidden_size", where, needed=need)
        heads = fields.integer(config, "num_attention_heads", where, needed=need)
        kv_heads = fields.integer(config, "num_key_value_heads", where, heads)
        if heads % kv_heads:
            raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        theta = fields.number(config, "rope_theta", where, 10000.0)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=fields.integer(config, "num_hidden_layers", where, maximum=fields.MAX_LAYERS,
                                             needed=need),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=fields.integer(config, "head_dim", where, hidden // heads),
            intermediate_size=fields.integer(config, "intermediate_size", where, needed=need),
            vocab_size=fields.integer(config, "vocab_size", where, needed=need),
            rms_norm_eps=fields.number(config, "rms_norm_eps", where, 1e-6),
            rope_theta=fields.number(rope, "rope_theta", where, theta, field="rope_parameters.rope_theta"),
            tie_word_embeddings=fields.flag(config, "tie_word_embeddings", where),
            max_position_embeddings=fields.integer(config, "max_position_embeddings", where, 32768),
            attention_bias=fields.flag(config, "attention_bias", where),
            bos_token_id=fields.token_id(config.get("bos_token_id"), "bos_token_id", where),
            eos_token_id=fields.token_id(config.get("eos_token_id"), "eos_token_id", where),
            pad_token_id=fields.token_id(config.get("pad_token_id"), "pad_token_id", where),
            mtp_layers=fields.integer(config, "mtp_num_hidden_layers", where, 0, minimum=0)
            or fields.integer(config, "num_nextn_predict_layers", where, 0, minimum=0),
        )

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


def sanitize(shapes_in_checkpoint: dict[str, tuple[int, ...]], args: Qwen3Args, where: str = "checkpoint") -> Layout:
    """Refuse a checkpoint whose keys or shapes are not exactly a Qwen3 model's, naming the tensor.

    A tied checkpoint may still carry ``lm_head.weight`` (some writers save it); it is ignored then, as are
    the tensors of an MTP head the config declares (``mtp.*`` or ``model.layers.{num_hidden_layers + i}.*``).
    """
    expected = expected_shapes(args)
    present = dict(shapes_in_checkpoint)
    ignored = ()
    if args.mtp_layers:
        head = ("mtp.", *(f"model.layers.{args.num_hidden_layers + i}." for i in range(args.mtp_layers)))
        present = {k: v for k, v in present.items() if not k.startswith(head)}
        ignored = (("MTP head", len(shapes_in_checkpoint) - len(present)),)
    if args.tie_word_embeddings:
        present.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in present:
            raise InputError(f"checkpoint: tensor {key!r} is missing (expected shape {list(shape)})")
        if tuple(present[key]) != shape:
            raise InputError(f"checkpoint: tensor {key!r} has shape {list(present[key])}, expected {list(shape)}")
    unknown = sorted(set(present) - set(expected))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise InputError(f"checkpoint: unexpected tensor {unknown[0]!r}{more} for a Qwen3 dense model")
    return Layout(ignored=ignored)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        h, d = args.hidden_size, args.head_dim
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        bias = args.attention_bias
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)
        self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def forward(self, x, cos, sin, heads_rows, mask_bias, key_cache, value_cache):
        """``heads_rows`` = (kv head, cache row) index tensors [Hkv, S] addressing this call's cache rows.

        No Python int is read from a tensor shape (``-1`` in views instead): coremltools rejects the
        ``aten::Int`` nodes that tracing makes of them.
        """
        q, k, v, gate = self.project(x, cos, sin)
        heads, rows = heads_rows
        write_index = (torch.full_like(rows, self.layer_index), heads, rows)
        key_cache.index_put_(write_index, k.to(key_cache.dtype))
        value_cache.index_put_(write_index, v.to(value_cache.dtype))
        keys = key_cache[self.layer_index].to(x.dtype)
        values = value_cache[self.layer_index].to(x.dtype)
        group = self.heads // self.kv_heads
        q = q.reshape(self.kv_heads, -1, self.head_dim)  # GQA: a KV head serves `group` query heads
        scores = scaled_scores(q, keys, self.head_dim) + mask_bias.repeat(group, 1)
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = (probs @ values).view(self.heads, -1, self.head_dim).transpose(0, 1)
        out = out.reshape(-1, self.heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def project(self, x, cos, sin):
        """q [heads, S, d] and k, v [kv heads, S, d], normed and rotated; and the output gate (None: Qwen3 has none)."""
        q = self.q_norm(self.q_proj(x).view(-1, self.heads, self.head_dim)).transpose(0, 1)
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim).transpose(0, 1)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, None


def scaled_scores(q: torch.Tensor, keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``q k^T / sqrt(head_dim)`` with the scale on the queries before the product: in fp16 the unscaled product of
    normed queries and keys overflows (65504) once ``head_dim x gain_q x gain_k`` nears it, e.g. a head of 128 with
    q_norm and k_norm gains of 23 on a token that attends to itself (``tests/test_fp16.py``)."""
    return (q * head_dim**-0.5) @ keys.transpose(-1, -2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half layout; cos/sin are [S, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``; ``activation`` is SiLU (a hybrid target passes its device-safe form)."""

    def __init__(self, args: Qwen3Args, activation=nn.functional.silu):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.activation = activation

    def forward(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, layer_index: int, first: int = 0):
        """Layer ``layer_index`` of a core whose layers start at ``first`` (a part's): its cache row is counted from
        there."""
        super().__init__()
        self.self_attn = Attention(args, layer_index - first)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, heads_rows, mask_bias, key_cache, value_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, heads_rows, mask_bias, key_cache, value_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Core(nn.Module):
    """The shared computation behind every target function, or behind one part's (``convert/pipeline/partition.py``).

    ``forward`` returns every output a function may expose: ``argmax_ids`` [1,S] int32, ``logits``
    [1,S,V], ``hidden`` [1,S,H] (the final-norm output: an MTP head's input) and, when taps are set,
    ``taps`` [1,S,len(taps)*hidden] (output of layer i, 0-based, in the given order); a part without the head
    returns its last layer's rows as ``hidden_states`` instead. Each FunctionModule picks the outputs its spec names.
    """

    def __init__(self, args: Qwen3Args, context: int, taps: tuple[int, ...] = (), part: Part | None = None):
        super().__init__()
        self.part = part or Part.whole(args)
        self.args, self.context, self.taps = args, context, self.part.own_taps(taps)
        build_embedding(self, args)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.part.layers[0]) for i in self.part.layer_indices)
        build_head(self, args, RMSNorm)
        if self.layers:
            register_positions(self, args.head_dim, args.rope_theta, context, args.num_key_value_heads)

    def load_weights(self, tensors: dict[str, torch.Tensor], layout: Layout | None = None) -> None:
        """Fill from transformers keys (already checked by ``sanitize``)."""
        load_checkpoint_tensors(self, tensors, layout or Layout())

    def forward(self, input_ids=None, position_ids=None, key_cache=None, value_cache=None, hidden_states=None, *,
                width: int = 0):
        x = part_input(self, input_ids, hidden_states)
        tapped = []
        if self.layers:
            attention = position_inputs(self, position_ids, x.dtype)
            for i, layer in zip(self.part.layer_indices, self.layers, strict=True):
                x = layer(x, *attention, key_cache, value_cache)
                if i in self.taps:
                    tapped.append((self.taps.index(i), x))
        return part_outputs(self, x, tapped)

    def cache_shape(self) -> tuple[int, int, int, int]:
        a = self.args
        return (len(self.layers), a.num_key_value_heads, self.context, a.head_dim)


def register_positions(module: nn.Module, rotary_dim: int, theta: float, rows: int, kv_heads: int) -> None:
    """The constants an export core reads positions through: RoPE cos/sin tables [rows, rotary_dim/2] in fp32
    (``inv_freq`` as transformers' ``compute_default_rope_parameters``), the cache row numbers and the KV head index
    (constants rather than aranges in forward: coremltools warns on every int64 arange it meets)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    angles = torch.arange(rows, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    module.register_buffer("rope_cos", angles.cos(), persistent=False)
    module.register_buffer("rope_sin", angles.sin(), persistent=False)
    module.register_buffer("cache_rows", torch.arange(rows, dtype=torch.int32), persistent=False)
    module.register_buffer("kv_head_index", torch.arange(kv_heads)[:, None], persistent=False)


def position_inputs(core: nn.Module, position_ids, dtype: torch.dtype) -> tuple:
    """What the attention layers of a call read, from its positions: cos, sin, the (KV head, cache row) write
    indices [Hkv, S] and the causal mask bias [S, context] (row c holds position c), in ``dtype``."""
    positions = position_ids[0].long()
    cos, sin = core.rope_cos[positions].to(dtype), core.rope_sin[positions].to(dtype)
    visible = core.cache_rows[None, :] <= position_ids[0][:, None]
    mask_bias = torch.where(visible, 0.0, -1e4).to(dtype)
    rows = positions[None, :].expand(core.args.num_key_value_heads, -1)
    return cos, sin, (core.kv_head_index.expand_as(rows), rows), mask_bias


def causal_attention(core: nn.Module, length: int) -> tuple:
    """``attention_inputs``' attention part for one sequence at positions 0..length-1 (GPTQ calibration)."""
    dtype, device = core.embed_tokens.weight.dtype, core.embed_tokens.weight.device
    positions = torch.arange(length, device=device)
    mask_bias = torch.where(positions[None, :] <= positions[:, None], 0.0, -1e4).to(dtype)
    rows = positions[None, :].expand(core.args.num_key_value_heads, -1)
    cos, sin = core.rope_cos[:length].to(dtype), core.rope_sin[:length].to(dtype)
    return cos, sin, (core.kv_head_index.expand_as(rows), rows), mask_bias


def load_checkpoint_tensors(core: nn.Module, tensors: dict[str, torch.Tensor], layout: Layout) -> None:
    """Fill a target core's parameters (named as the causal LM's keys without ``model.``) from checkpoint tensors
    stored under ``layout``'s keys; a tied lm_head is the embedding's tensor already."""
    by_canonical = {layout.canonical(k): v for k, v in tensors.items()}
    own = {"model." + k if not k.startswith("lm_head") else k: v for k, v in core.state_dict().items()}
    with torch.no_grad():
        for key, param in own.items():
            if key == "lm_head.weight" and core.args.tie_word_embeddings:
                continue
            param.copy_(by_canonical[key].to(param.dtype))


class CausalRunner:
    """Runs one decoder layer of ``core`` over a sequence of ``length`` tokens at positions 0..length-1 (GPTQ
    calibration, ``quant/calibrate.py``).

    The same inputs ``Qwen3Core.forward`` builds, for a zeroed cache holding exactly this sequence (each call
    writes every cache row before reading, so the cache is reused across samples without clearing).
    """

    def __init__(self, core: Qwen3Core, length: int):
        if length > core.context:
            raise ValueError(f"calibration length {length} exceeds the core's context {core.context}")
        args, dtype, device = core.args, core.embed_tokens.weight.dtype, core.embed_tokens.weight.device
        self.attention = causal_attention(core, length)
        cache = (args.num_hidden_layers, args.num_key_value_heads, length, args.head_dim)
        self.key_cache = torch.zeros(cache, dtype=dtype, device=device)
        self.value_cache = torch.zeros(cache, dtype=dtype, device=device)

    def __call__(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """``x`` [n, length, hidden] -> the layer's outputs, sample by sample."""
        return torch.stack([layer(s, *self.attention, self.key_cache, self.value_cache) for s in x])


# ------------------------------------------------------------------------------------------ registry hooks

Args = Qwen3Args
PLAN_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size")  # what a contract pins to plan the functions without the checkpoint
PLAN_ALTERNATIVES: dict[str, tuple[str, ...]] = {}
FunctionModule = export.NamedFunction
LINEAR_GROUPS = (  # GPTQ's "true sequential" order: o_proj's Hessian sees the quantized q/k/v, and so on
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def build_core(args: Qwen3Args, target, part: Part | None = None) -> Qwen3Core:
    return Qwen3Core(args, target.context, tuple(target.taps or ()), part)


def function_specs(args: Qwen3Args, target, dtype: torch.dtype = torch.float16,
                   part: Part | None = None) -> list[FunctionSpec]:
    """prefill / decode / verify: same inputs (``input_ids``, ``position_ids``), states and outputs, each at its
    own static width S; a part's take and return what it needs (``convert/pipeline/partition.py``)."""
    part = part or Part.whole(args)
    fdtype = DTYPE_NAMES[dtype]
    cache = (len(part.layer_indices), args.num_key_value_heads, target.context, args.head_dim)
    states = tuple(TensorSpec(name, cache, fdtype) for name in STATE_NAMES) if part.layer_indices else ()
    specs = []
    for name, width in function_widths(target):
        inputs, outputs = part_tensors(args, target, part, width, fdtype)
        specs.append(FunctionSpec(name, inputs, outputs, states))
    return specs


def host_contract(args: Qwen3Args, target) -> dict:
    return HOST_CONTRACT


def architecture_record(args: Qwen3Args, target) -> dict:
    return {
        "family": FAMILY, "hidden_size": args.hidden_size, "num_layers": args.num_hidden_layers,
        "num_heads": args.num_attention_heads, "num_kv_heads": args.num_key_value_heads, "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings, "rope_type": args.rope_type, "rope_theta": args.rope_theta,
        "rms_norm_eps": args.rms_norm_eps, "context": target.context,
    }


def plan_lines(args: Qwen3Args, target) -> list[str]:
    return [f"  qwen3: {args.num_hidden_layers} layers, hidden {args.hidden_size}, heads {args.num_attention_heads}/"
            f"{args.num_key_value_heads} (head_dim {args.head_dim}), vocab {args.vocab_size}, "
            f"{'tied' if args.tie_word_embeddings else 'untied'} lm_head, context {target.context}"]


def calibration_runner(core: Qwen3Core, length: int) -> CausalRunner:
    return CausalRunner(core, length)


def linear_groups(core: Qwen3Core, layer: DecoderLayer) -> tuple[tuple[str, ...], ...]:
    return LINEAR_GROUPS


def cached_blocks(core: Qwen3Core, layer: DecoderLayer) -> tuple[tuple[str, str], ...]:
    """The layer's blocks whose output is their last linear's, each with that linear: ``Attention.forward`` returns
    ``o_proj(...)``, ``MLP.forward`` ``down_proj(...)``."""
    return ("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")


def reference_layers(model) -> nn.ModuleList:
    return model.model.layers
