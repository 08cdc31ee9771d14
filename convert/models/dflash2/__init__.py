"""DFlash2 (and DFlash) block drafter: config args, checkpoint key mapping, a plain torch reference and the export core.

A drafter reads the target's tapped hidden states ("context") and drafts ``block_size - 1`` tokens after an anchor
in one forward pass of a few layers over the block [anchor, mask x (B-1)]. The forward follows
anemll-forge's plain-torch DFlash2 reference (github.com/Anemll/anemll-forge), which was checked against
z-lab's ``DFlash2DraftModel``:

* context: ``fused = hidden_norm(fc(concat(taps)))``; per draft layer K = rope(k_norm(k_proj(fused))) and
  V = v_proj(fused) at the rows' absolute positions.
* block: per layer ``x = input_layernorm(h)``; the dynamic grouped conv mixes ``x`` (side 0) before attention and the
  attention output (side 1) after it, with coefficients ``base_kernel[side, j] + kernel_projection(x)`` (per group of
  ``conv_group_size`` channels) and zeros before the block start; same around the MLP. Attention: queries from the
  block (q_norm, then NeoX rotate-half RoPE), keys/values = context rows + block rows, NON-causal inside the block,
  visible when ``|q_pos - k_pos| < sliding_window`` on sliding layers.
* output: the drafter's ``norm`` on rows 1..B-1, the TARGET's ``lm_head``, top-k candidates, then the selector walk:
  ``pred = anchor``; per row ``s = unary + successor_codebook[cand] @ (predecessor_codebook[pred] *
  hidden_projection(h))``; ``pred = cand[argmax s]``.

The unary term is the candidates' own ``lm_head`` logits, i.e. the values ``torch.topk`` returns with the
candidates. Sources (public code, 2026): anemll-forge ``scripts/dflash2_drafter_ref.py`` (``unary, cand =
torch.topk(logits, self.top_k)``; its ``validate`` checks it against z-lab's model), Qualcomm's DFlash-2 port
(``unary, candidates = torch.topk(logits, self.top_k, ...)``, "mirrors upstream select at temperature 0"),
sglang PR 35371 (``edge(p->c) = <A[p] * project(h), B[c]> + unary[c]`` over "the target head's top-K") and
speculators PR 1006 ("reranks unary top-K candidates"). Raw logits or log-probabilities give the same greedy walk:
they differ by one constant per row.

``DFlashDraftModel`` (DFlash v1) is the same model without the conv (identity) and without the selector (draft ids =
argmax of the logits). Per sglang, the conv and the selector are each switched on by their config fields, so a
``DFlashDraftModel`` config that declares them gets them; ``DFlash2DraftModel`` must declare both.

Taps (``target_layer_ids``) are kept exactly as written; their convention is z-lab's: 0-based "output of layer i",
i.e. transformers ``hidden_states[i + 1]`` (``TAP_CONVENTION``). They are never recomputed from a formula.

Export (static shapes, one ``DFlash2Core`` shared by three functions, see ``function_specs``): the context functions
write K/V of context rows into a ring of R rows (``ring_keys``/``ring_values`` [layers, kv_heads, R, head_dim]), slot
= position mod R, and ``ring_laps`` [1, R] = position // R + 1 (0 = empty), so a slot's key position is
``(laps - 1) * R + slot``. The draft reads the ring: a slot is visible when filled, its position is below p0 (rows
left from before a rollback stay hidden) and within the layer's sliding window. The ring holds the last R positions
written: after a rollback by d rows, the oldest d positions of the window are gone unless R >= window + d (with
R = window = 2048, the oldest few of 2048 context rows; exact when R > window + draft width).

The draft does not change the ring, but it declares the ring as its states (one package, shared states), and both
backends take a state to be a buffer the function writes in place (a buffer that is only read would be frozen into a
constant by torch.export); so the draft writes one row of each state back unchanged (``_touch``).
"""

from convert.models.dflash2.ane import host_contract
from convert.models.dflash2.checkpoint import checkpoint_files, load_checkpoint, sanitize
from convert.models.dflash2.config import DFlash2Args
from convert.models.dflash2.export import build_modules, function_specs
from convert.models.dflash2.reference import DFlash2Reference

__all__ = ["DFlash2Args", "DFlash2Reference", "build_modules", "checkpoint_files", "function_specs", "host_contract",
           "load_checkpoint",
           "sanitize"]
