"""The placement lint: what each exported program holds against what a program the Neural Engine runs whole holds.

The reference is anemll-forge's target chunk, which places fully on the ANE (``mps.fullyPlacedOnANE``, its own
audit): its builder (``coreai/qwen38_coreai_build.py`` @e3741346, ``Entry._forward``, read through the public
corpus: github.com/Anemll/anemll-forge) writes 1x1 and grouped convolutions, batched matmuls,
softmax, elementwise arithmetic and activations, reductions (max, mean, sum), shape ops and the compressed-weight
constexprs, all in fp16, over inputs the host owns. Forge found what leaves the ANE: a state write lowers to a
scatter and runs on the GPU, a gather and integer arithmetic are not in its graphs (the host looks up embeddings
and passes positions as cos / sin tables and masks), ``repeat`` becomes ``tile``, which the ANE compiler refuses on
large masks, and an axis past 65,536 (its ``[history | block]`` scores) fails the compile of the whole package.

A finding is one line naming the function, what it holds and why it matters. This is a lint over the program as
converted here, not a placement measurement: only a device's compiler decides placement (forge's audit reads the
compiled cache on a Mac), and ``spec-convert compile`` there is where it is measured.
"""

from __future__ import annotations

from convert.export.ane import ANE_DIM_LIMIT
from convert.export.spec import FunctionSpec

PLACEMENT = "placement"  # the package check's key, and the manifest package's field, of the findings
REFERENCE = "anemll-forge coreai/qwen38_coreai_build.py @e3741346 (Entry._forward)"

# forge's ops by each format's names: Core AI's coreai dialect (prefix and ``decomposable.`` dropped), Core ML's MIL
_COMMON = {"softmax", "abs", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "relu", "reduce_max", "reduce_mean",
           "reduce_sum", "reshape", "transpose", "concat", "split"}
VOCABULARY = {
    "coreai": frozenset(_COMMON | {
        "conv2d", "broadcasting_batch_matmul", "broadcasting_add", "broadcasting_sub", "broadcasting_mul",
        "broadcasting_divide", "broadcasting_maximum", "broadcasting_minimum", "broadcasting_pow", "slice",
        "broadcast_in_dims", "constant", "output", "lut_to_dense", "blockwise_shift_scale"}),
    "coreml": frozenset(_COMMON | {
        "conv", "matmul", "add", "sub", "mul", "real_div", "inverse", "clip", "maximum", "minimum", "pow",
        "slice_by_index",
        "slice_by_size", "expand_dims", "squeeze", "const", "constexpr_lut_to_dense",
        "constexpr_blockwise_shift_scale"}),
}
_WHY = {  # what an op outside the vocabulary usually is here, by a word of its name
    "scatter": "a state or buffer write (forge: index_copy_ lowers to scatter_nd, which runs on the GPU)",
    "state": "a state read or write (forge keeps no states: the host owns every buffer)",
    "linear": "a linear layer (forge makes every projection a 1x1 convolution on (1, C, 1, T) activations)",
    "gather": "a lookup (forge's host looks up embeddings and passes positions as cos / sin tables)",
    "handle": "a state read or write (forge keeps no states: the host owns every buffer)",
    "token": "a state's ordering token (forge keeps no states)",
    "tile": "a repeat (forge: tile is refused by the ANE compiler on large masks; broadcast instead)",
    "cast": "a dtype conversion (forge's graphs are fp16 throughout, with no integer arithmetic)",
    "argmax": "an argmax (forge returns logits and takes the argmax on the host)",
    "greater": "an integer comparison (forge passes masks as fp16 inputs)",
    "less": "an integer comparison (forge passes masks as fp16 inputs)",
    "select": "a select on a computed mask (forge passes masks as fp16 inputs)",
    "where": "a select on a computed mask (forge passes masks as fp16 inputs)",
    "not": "a logical op (forge passes masks as fp16 inputs)",
    "silu": "a native SiLU (forge writes it with tanh: the ANE's silu is about 1e-3 off near 0)",
}


def positional_buffers(contract: dict) -> tuple[str, ...]:
    """The host buffers written at the call's positions (an attention history: its rows and the call's are one
    attention axis, which ``lint`` checks); a hybrid's state buffers are not."""
    return tuple(name for name, rule in contract.get("buffers", {}).items()
                 if rule.get("write", "positions") == "positions")


def lint(fmt: str, specs: dict[str, FunctionSpec], op_types: dict[str, set[str]],
         host_buffers: tuple[str, ...] = ()) -> list[str]:
    """Findings for a ``fmt`` package with these functions' ``specs`` and ``op_types`` (the format's op names, by
    function); ``host_buffers``: the inputs the host owns (their rows and the call's are one attention axis)."""
    vocabulary = VOCABULARY[fmt]
    findings = []
    for name, spec in specs.items():
        if spec.states:
            findings.append(f"{name}: keeps {len(spec.states)} states ({', '.join(s.name for s in spec.states)}): "
                            "written in the graph, they leave the ANE (forge keeps every buffer on the host)")
        for op in sorted(op_types.get(name, set()) - vocabulary):
            words = op.split("_")
            why = next((text for word, text in _WHY.items() if word in words), "not an op of forge's program")
            findings.append(f"{name}: op {op}: {why}")
        for tensor in (*spec.inputs, *spec.outputs, *spec.states):
            if tensor.dtype == "float32":
                findings.append(f"{name}: {tensor.name} is float32 (forge's programs are fp16 throughout)")
            if max(tensor.shape, default=0) > ANE_DIM_LIMIT:
                findings.append(f"{name}: {tensor.name} {list(tensor.shape)} has a dim over the ANE's "
                                f"{ANE_DIM_LIMIT:,}")
        for tensor in spec.inputs:
            if tensor.name in host_buffers and len(tensor.shape) > 2:
                axis = tensor.shape[2] + spec.width
                if axis > ANE_DIM_LIMIT:
                    findings.append(f"{name}: {tensor.name}'s rows and the call's ({axis:,}) are one attention axis "
                                    f"over the ANE's {ANE_DIM_LIMIT:,} (forge caps its history at 65,472 rows)")
    return findings


def layout_of(functions) -> str:
    """The layout a package's functions were exported for: the stateful layout's keep their caches as states, the ane
    layout's keep none (the host owns every buffer)."""
    return "stateful" if any(f.states for f in functions) else "ane"


def meaning(layout: str, findings: int) -> str:
    """What a package's count of findings means for its layout, in words (``build`` and ``inspect`` say it)."""
    if layout == "stateful":
        return ("expected for the stateful layout (the GPU runs its programs; the lint measures against the ANE)"
                if findings else "in the stateful layout, whose programs the GPU runs")
    return ("these matter in the ane layout, which means the Neural Engine to run each program whole (--strict refuses "
            "them)" if findings else "each program holds only what the Neural Engine runs")
