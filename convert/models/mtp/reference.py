"""MTP head: the plain eager reference over whole sequences (and the batched form of chained drafting)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert.models.mtp.core import MTPHead


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
