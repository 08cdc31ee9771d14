"""MTP head: the head's modules (shared with the reference) and the export core."""

from __future__ import annotations

import torch
from torch import nn

from convert.errors import InputError
from convert.export.functions import set_parameter
from convert.export.names import DRAFT_IDS, HIDDEN_OUT, LOGITS
from convert.models.mtp.checkpoint import HeadWeights
from convert.models.mtp.config import MTPArgs
from convert.models.qwen3.core import DecoderLayer, RMSNorm, register_positions
from convert.models.qwen3_5.core import GatedAttention, ZeroCentredRMSNorm, zero_centre_norms


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

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the core computes in: its norms' (a weight-sharing compute copy's linears keep fp16 weights,
        ``export.functions.compute_copy``)."""
        return self.norm.weight.dtype

    def load_weights(self, head: HeadWeights, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Set every parameter from ``head``'s tensors and the borrowed tables, each cast to its parameter's dtype (the
        tensor itself when already in it). A core made with its parameters on meta (``export.build_modules``) gets
        them here: made in fp32 first, at 27B the two borrowed 248320-row tables alone took 10 GB."""
        tensors = {**head.tensors, "embed_tokens.weight": embed_tokens}
        if not self.args.tie_word_embeddings:
            tensors["lm_head.weight"] = lm_head
        for name, tensor in tensors.items():
            set_parameter(self, name, tensor.detach().to(self.get_parameter(name).dtype))
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        unset = [name for name, p in self.named_parameters() if p.is_meta]
        if unset:
            raise InputError(f"MTP head: no tensor for parameter {unset[0]!r}")

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own tensors under their Qwen3.5 checkpoint keys (``mtp.*``), borrowed tables left out."""
        return {"mtp." + k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens", "lm_head"))}

    def fused_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc(cat[pre_fc_norm_embedding(embed(ids)), pre_fc_norm_hidden(hidden)]): concat order [embedding, hidden]."""
        embedded = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        return self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden.to(embedded.dtype))], dim=-1))


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

    def forward(self, input_ids, hidden, position_ids, key_cache, value_cache, *, width: int | None = None):
        """``width``: the function's, which the ane core needs (``NamedFunction`` passes it); the positions give it
        here."""
        x = self.fused_input(input_ids[0].long(), hidden[0])  # [S, H]
        hidden_out = self.norm(self.decoder(x, position_ids, key_cache, value_cache))
        logits = self.lm_head(hidden_out)[None]
        return {DRAFT_IDS: logits.argmax(-1).to(torch.int32), HIDDEN_OUT: hidden_out[None], LOGITS: logits}

    def decoder(self, x, position_ids, key_cache, value_cache):
        """The head's decoder layers over rows x [S, H] at ``position_ids`` [1, S] int32, writing their cache rows."""
        dtype = self.compute_dtype
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
