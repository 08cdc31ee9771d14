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

from convert.models.mtp.ane import host_contract
from convert.models.mtp.checkpoint import expected_shapes, load_head, sanitize
from convert.models.mtp.config import DRAFT_STEPS, MTPArgs
from convert.models.mtp.core import MTPCore
from convert.models.mtp.export import build_modules, build_reference, function_specs
from convert.models.mtp.reference import MTPReference

__all__ = ["DRAFT_STEPS", "MTPArgs", "MTPCore", "MTPReference", "build_modules", "build_reference", "expected_shapes",
           "function_specs", "host_contract", "load_head", "sanitize"]
