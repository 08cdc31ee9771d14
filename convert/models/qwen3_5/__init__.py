"""Qwen3.5 family targets (Qwen3.5 / 3.6 / 3.8, and the unpacked Ternary Bonsai 2): hybrid Gated DeltaNet + gated
attention, with a rollback that is exact for any accepted prefix.

Semantics are transformers' (models/qwen3_5/modeling_qwen3_5.py, the reference of every test and gate):

* Layers follow ``layer_types`` (or ``full_attention_interval``, default 4: every 4th layer full attention), any mix
  and order. Decoder norms are zero-centred, ``x_normed * (1 + w)``.
* Full attention (``Qwen3_5Attention``): gated (``q_proj`` gives [query | gate] per head; the output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``), q_norm / k_norm zero-centred, partial RoPE on the first
  ``int(head_dim * partial_rotary_factor)`` dims. Qwen3.5's multimodal RoPE (``mrope_section``) equals plain RoPE on
  text positions (its three position rows are equal), so the functions take 1-D positions.
* Gated DeltaNet (``Qwen3_5GatedDeltaNet``): ``in_proj_qkv`` -> depthwise causal conv (kernel K) -> SiLU -> q | k | v;
  value head j reads key head j // (value heads / key heads); q and k l2-normalised (eps 1e-6), q scaled by
  ``key_head_dim ** -0.5``; ``beta = sigmoid(in_proj_b x)``, ``g = -exp(A_log) * softplus(in_proj_a x + dt_bias)``
  (fp32); per token ``S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q``; then
  ``out_proj(w * rmsnorm(o) * silu(z))`` with the gated norm's weight used as is (not 1 + w).

The export core computes the delta rule (in fp32; in the ane layout, ``ane.py``, in the activations' dtype: fp16 on
the device) in chunks (the WY form transformers' ``torch_chunk_gated_delta_rule``
uses, with the unit-triangular inverse as a product of ``log2(chunk)`` factors instead of a row-by-row solve), and
in the device-safe forms of ``docs/hybrid.md``: softplus as ``relu(x) + log1p(exp(-|x|))``, SiLU as
``x / (1 + exp(-x))``, q and v scaled by powers of two (so the state update has no subnormal products in fp16; exact
in any binary format, the outputs are scaled back).

Rollback (the host contract, ``host_contract``): ``decode`` and ``verify`` never commit their own rows to the
Gated DeltaNet states. They leave them pending (the pre-conv ``in_proj_qkv`` rows and the raw ``in_proj_b`` /
``in_proj_a`` rows, in ``pending_qkv`` / ``pending_ba``); every call first commits the first ``accept`` pending rows
(``accept`` is an input, 0..rows of the previous call), by running them through the conv and the delta rule with
the rows past ``accept`` made identities (g = 0, beta = 0: ``e^0 S + k (0)^T = S``), then runs its own rows from
there.
``prefill`` commits its own first ``valid`` rows itself (a prompt's tokens are never rejected; a padded last chunk
passes its real row count) and leaves nothing pending. Attention layers keep positional KV rows as the dense target
does. The state after any accept is therefore exactly the state of running only the accepted tokens.
"""

from convert.export.ane import silu
from convert.models.qwen3.core import MLP_REBALANCE
from convert.models.qwen3_5.checkpoint import sanitize
from convert.models.qwen3_5.config import (
    ANE_HOST_CONTRACT_NAME,
    FAMILY,
    HOST_CONTRACT_NAME,
    HOST_CONTRACT_VERSION,
    PLAN_ALTERNATIVES,
    PLAN_FIELDS,
    QUERY_SCALE,
    STATE_NAMES,
    VALUE_SCALE,
    Args,
    Qwen35Args,
    accepts,
    expected_shapes,
)
from convert.models.qwen3_5.core import KEEP_FP16, cached_blocks, calibration_runner, linear_groups
from convert.models.qwen3_5.export import (
    FunctionModule,
    architecture_record,
    build_core,
    function_specs,
    host_contract,
    plan_lines,
    reference_layers,
)
from convert.models.qwen3_5.gated_delta import (
    ChunkMasks,
    causal_conv,
    delta_rule,
    softplus,
    unit_lower_inverse,
)

__all__ = [
    "ANE_HOST_CONTRACT_NAME", "FAMILY", "HOST_CONTRACT_NAME", "HOST_CONTRACT_VERSION", "KEEP_FP16",
    "MLP_REBALANCE",    "PLAN_ALTERNATIVES", "PLAN_FIELDS",
    "QUERY_SCALE", "STATE_NAMES", "VALUE_SCALE", "Args", "ChunkMasks", "FunctionModule", "Qwen35Args", "accepts",
    "architecture_record", "build_core", "cached_blocks", "calibration_runner", "causal_conv", "delta_rule",
    "expected_shapes", "function_specs", "host_contract", "linear_groups", "plan_lines", "reference_layers", "sanitize",
    "silu", "softplus", "unit_lower_inverse",
]
