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

from convert.models.qwen3.checkpoint import sanitize
from convert.models.qwen3.config import (
    FAMILY,
    PLAN_ALTERNATIVES,
    PLAN_FIELDS,
    Args,
    Qwen3Args,
    accepts,
)
from convert.models.qwen3.core import KEEP_FP16, MLP_REBALANCE, cached_blocks, calibration_runner, linear_groups
from convert.models.qwen3.export import (
    FunctionModule,
    architecture_record,
    build_core,
    function_specs,
    host_contract,
    plan_lines,
    reference_layers,
)

__all__ = [
    "FAMILY", "KEEP_FP16", "MLP_REBALANCE", "PLAN_ALTERNATIVES", "PLAN_FIELDS", "Args", "FunctionModule",
    "Qwen3Args", "accepts",
    "architecture_record", "build_core", "cached_blocks", "calibration_runner", "function_specs", "host_contract",
    "linear_groups", "plan_lines", "reference_layers", "sanitize",
]
