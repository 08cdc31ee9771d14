"""DFlash2: the plain torch reference (and the training forward), fp32 and eager."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from convert.models.dflash2.core import DFlash2Weights
from convert.models.qwen3.core import rotate


@dataclass
class ReferenceDraft:
    draft_ids: torch.Tensor  # [B-1] int64
    logits: torch.Tensor  # [B-1, vocab]
    hidden: torch.Tensor  # [B-1, H], after the drafter's norm
    scores: torch.Tensor | None  # [B-1, k] selector scores (None for DFlash v1)
    candidates: torch.Tensor | None  # [B-1, k]


class DFlash2Reference(DFlash2Weights):
    """Eager, readable reference (no ring, no static shapes): ``draft`` for one block, ``forward_blocks`` to train."""

    def draft(self, features, anchor_embedding, mask_embedding, lm_head_weight, anchor_id: int, p0: int,
              positions=None, mask_scale: float = 1.0) -> ReferenceDraft:
        """One block at positions p0..p0+B-1 after context ``features`` [N, T*H] (rows at ``positions``, default
        0..N-1; rows at or past p0 are ignored). ``anchor_embedding`` and ``mask_embedding`` [H] are the target's
        embedding rows of the anchor and of ``mask_token_id``; ``lm_head_weight`` [vocab, H] is the target's head."""
        args = self.args
        dtype, device = self.fc.weight.dtype, features.device
        positions = torch.arange(len(features)) if positions is None else torch.as_tensor(positions)
        positions = positions.to(device)
        keep = positions < p0
        fused = self.fuse(features[keep].to(dtype))
        ctx_positions = positions[keep]
        mask_row = (mask_embedding.float() * mask_scale).to(dtype).reshape(1, -1)
        block = torch.cat([anchor_embedding.to(dtype).reshape(1, -1), mask_row.expand(args.block_size - 1, -1)])
        block_positions = torch.arange(p0, p0 + args.block_size, device=device)
        h = block
        for layer, window in zip(self.layers, args.layer_windows, strict=True):
            def attend(attn, x, window=window):
                return self._attend(attn, x, fused, ctx_positions, block_positions, window)

            h = layer(h, attend)
        hidden = self.norm(h[1:])
        logits = hidden @ lm_head_weight.to(dtype).T
        if not args.has_selector:
            return ReferenceDraft(logits.argmax(-1), logits, hidden, None, None)
        ids, scores, candidates = self.candidate_selector.walk(
            hidden, logits, torch.tensor([anchor_id], device=device), args.block_size - 1
        )
        return ReferenceDraft(ids, logits, hidden, scores, candidates)

    def _attend(self, attn, x, fused, ctx_positions, block_positions, window):
        """Block queries over [context rows, block rows]; non-causal; |q - k| < window where the layer slides."""
        cos_b, sin_b = self.rope_angles(block_positions)
        cos_c, sin_c = self.rope_angles(ctx_positions)
        dtype = x.dtype
        q = rotate(attn.queries(x).transpose(0, 1), cos_b.to(dtype), sin_b.to(dtype))  # [heads, B, D]
        k_ctx, v_ctx = attn.keys_values(fused)
        k_blk, v_blk = attn.keys_values(x)
        k_ctx = rotate(k_ctx.transpose(0, 1), cos_c.to(dtype), sin_c.to(dtype))
        k_blk = rotate(k_blk.transpose(0, 1), cos_b.to(dtype), sin_b.to(dtype))
        keys = torch.cat([k_ctx, k_blk], dim=1)  # [kv_heads, N + B, D]
        values = torch.cat([v_ctx.transpose(0, 1), v_blk.transpose(0, 1)], dim=1)
        group = attn.heads // attn.kv_heads
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        key_positions = torch.cat([ctx_positions, block_positions])
        visible = torch.ones(len(block_positions), len(key_positions), dtype=torch.bool, device=x.device)
        if window is not None:
            visible &= (block_positions[:, None] - key_positions[None, :]).abs() < window
        scores = (q @ keys.transpose(1, 2)) * attn.head_dim**-0.5
        scores = scores.float().masked_fill(~visible, float("-inf"))
        out = torch.softmax(scores, dim=-1).to(dtype) @ values  # [heads, B, D]
        return attn.o_proj(out.transpose(0, 1).reshape(len(block_positions), -1))

    def forward_blocks(self, features, block_embeddings, anchor_positions) -> torch.Tensor:
        """Training forward: several blocks per sequence at once, the same math as ``draft``.

        ``features`` [b, N, T*H] (row j at position j), ``block_embeddings`` [b, m, B, H] (row 0 the anchor's
        embedding, the rest the mask row), ``anchor_positions`` [b, m] (block at a..a+B-1 sees context rows j < a).
        Returns the final-normed hidden states [b, m, B, H] (row 0 included; the loss reads rows 1..B-1).
        """
        args = self.args
        b, m, block, _ = block_embeddings.shape
        n = features.shape[1]
        fused = self.fuse(features)
        ctx_positions = torch.arange(n, device=features.device)
        block_positions = anchor_positions[..., None] + torch.arange(block, device=features.device)  # [b, m, B]
        cos_c, sin_c = self.rope_angles(ctx_positions)
        cos_b, sin_b = self.rope_angles(block_positions.reshape(b, m * block))
        queries = block_positions.reshape(b, m * block)
        block_of_query = torch.arange(m, device=features.device).repeat_interleave(block)
        ctx_visible = ctx_positions[None, None, :] < anchor_positions.repeat_interleave(block, dim=1)[..., None]
        blk_visible = (block_of_query[:, None] == block_of_query[None, :]).expand(b, -1, -1)
        masks = {}
        for window in dict.fromkeys(args.layer_windows):
            ctx, blk = ctx_visible, blk_visible
            if window is not None:
                ctx = ctx & (queries[..., None] - ctx_positions[None, None, :] < window)
                blk = blk & ((queries[..., None] - queries[:, None, :]).abs() < window)
            masks[window] = torch.cat([ctx, blk], dim=-1)[:, None]  # [b, 1, mB, N + mB]

        def attend(attn, x, window):
            dtype = x.dtype
            x = x.reshape(b, m * block, -1)
            q = rotate(attn.queries(x).transpose(1, 2), cos_b[:, None].to(dtype), sin_b[:, None].to(dtype))
            k_ctx, v_ctx = attn.keys_values(fused)
            k_blk, v_blk = attn.keys_values(x)
            k_ctx = rotate(k_ctx.transpose(1, 2), cos_c.to(dtype), sin_c.to(dtype))
            k_blk = rotate(k_blk.transpose(1, 2), cos_b[:, None].to(dtype), sin_b[:, None].to(dtype))
            keys = torch.cat([k_ctx, k_blk], dim=2).to(q.dtype)
            values = torch.cat([v_ctx.transpose(1, 2), v_blk.transpose(1, 2)], dim=2).to(q.dtype)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[window], enable_gqa=True)
            return attn.o_proj(out.transpose(1, 2).reshape(b, m, block, -1))

        h = block_embeddings
        for layer, window in zip(self.layers, args.layer_windows, strict=True):
            h = layer(h, lambda attn, x, window=window: attend(attn, x, window))
        return self.norm(h)
