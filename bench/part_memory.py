"""Benchmark: the host memory of packaging one part at the Qwen3.8-27B width, phase by phase.

The plan sizes parts by what packaging one costs per weight (``convert/pipeline/partition.py``:
``PACKAGING_BYTES_PER_LAYER_WEIGHT``, ``PACKAGING_BYTES_PER_TABLE_WEIGHT``). This measures where those bytes go: it
builds the export modules of one part at ``bench/scale.py``'s geometry (hidden 5120, intermediate 17408) with
``--layers`` decoder layers of ``--layer-types`` (default one Gated DeltaNet layer) or, with ``--table``, an embedding
or head part of ``--rows`` vocabulary rows; seeded weights (std 0.02) quantized round-to-nearest (``--method``
affine4 or lut4: the same codes-and-tables structure as their GPTQ forms); then packages it in one ``--format`` in
this process, as the build's part process does, while a thread samples this process's resident memory (``VmRSS``)
every 20 ms. Each phase's peak is reported in bytes per weight of the part above the memory before the modules were
built and above the memory of the modules as they are packaged (codes, tables and what is not quantized, once the
quantized linears' fp16 dense weights are released as the part process releases them after recording its calls;
with ``--keep-dense``, the dense weights too; the bench's own seeded weights and their quantization peak while they
are built). The phases: building the modules, releasing the dense weights, then per function the backend's steps
(Core ML: the fp32 tracing copy, the trace, the conversion, the save; Core AI: the export), then Core ML's
multifunction merge and its package check (the constants read back) or Core AI's conversion of all functions and its
check (the quantized constants read back, then the package loaded on the Core AI runtime, every function lowered, and
decode called once: the runtime's fp16 is emulated on Linux, and a 64-token prefill of one layer at this width took
21 minutes there).

    PYTHONPATH=. python3 -m bench.part_memory [--format coreml] [--layers 1] [--layer-types L] [--method affine4]
                                              [--table embed|head --rows 62080] [--keep-dense] [--json out.json]
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import torch

from bench.common import Sampler, arguments, machine, write_json
from bench.scale import GEOMETRY

KINDS = {"L": "linear_attention", "F": "full_attention"}


def _wrap(owner, attribute: str, sampler: Sampler, name) -> None:
    """Run ``owner.attribute`` inside a sampler phase named ``name(*args)``."""
    original = getattr(owner, attribute)

    def wrapped(*args, **kwargs):
        with sampler.phase(name(*args)):
            return original(*args, **kwargs)

    setattr(owner, attribute, wrapped)


def part_modules(layer_types: list[str], table: str | None, rows: int, method: str, seed: int = 0):
    """The export modules of the part, its weights' count."""
    from convert.export.quantized import apply_quantized
    from convert.inputs.recipe import Recipe
    from convert.models import qwen3_5
    from convert.models.part import Part
    from convert.weights.quantize import concat_rows
    from convert.weights.shipped import part_modules as split
    from convert.weights.target import modules_over
    from quant.affine import quantize_affine
    from quant.lut import quantize_lut

    vocab = rows if table else 1024
    config = {"model_type": "qwen3_5_text", **GEOMETRY, "vocab_size": vocab, "num_hidden_layers": len(layer_types),
              "layer_types": layer_types, "full_attention_interval": 4}
    args = qwen3_5.Args.from_config(config)
    recipe = Recipe.model_validate({"name": "part-memory", "target": {
        "source": "path:.", "graphs": {"prefill": 64, "decode": 1, "verify": 8}, "context": 8192,
        "quantization": {"method": method}}, "backends": ["coreml"]})
    target = recipe.target
    generator = torch.Generator().manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16 if table else default)  # two fp32 tables of 248320 rows would be 10 GB
    try:
        core = qwen3_5.build_core(args, target).to(torch.float16).eval()
    finally:
        torch.set_default_dtype(default)
    if table == "head":  # the other table is not the part's: one row of it (the part process never loads it)
        core.embed_tokens = torch.nn.Embedding(1, args.hidden_size, dtype=torch.float16)
    elif table == "embed":
        core.lm_head = torch.nn.Linear(args.hidden_size, 1, bias=False, dtype=torch.float16)
    fit = quantize_affine if method == "affine4" else quantize_lut
    group = target.quantization.resolved_group_size
    quantized = {}
    for name, module in core.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        wanted = name == {"head": "lm_head", "embed": "embed_tokens"}[table] if table else name.startswith("layers.")
        quantize = weight.dim() == 2 and wanted and "in_proj_a" not in name and "in_proj_b" not in name
        blocks = []
        step = 16384  # rows a block (a multiple of lut4's groups): a table's fp32 draws stay 0.3 GB at a time
        for lo in range(0, weight.shape[0], step):
            with torch.no_grad():
                value = torch.randn(weight[lo:lo + step].shape, generator=generator) * (0.02 if weight.dim() == 2
                                                                                          else 0.1)
                weight[lo:lo + step].copy_(value + (1.0 if weight.dim() == 1 else 0.0))
            if quantize:  # round-to-nearest is row-block by row-block (groups of columns, or of 16 rows)
                blocks.append(fit(weight[lo:lo + step].float(), group))
            del value
        if blocks:
            quantized[name] = concat_rows(blocks)
    apply_quantized(core, quantized)
    del quantized
    for p in core.parameters():
        p.requires_grad_(False)
    modules = modules_over(core, args, target, torch.float16)
    if table == "embed":
        part = Part("embed", vocab, embedding=(0, vocab))
    elif table == "head":
        part = Part("head", vocab, head=(0, vocab))
    else:
        part = Part(f"layers-0-{len(layer_types) - 1}", vocab, layers=(0, len(layer_types)))
    (piece,) = split(modules, target, [part])
    weights = sum(p.numel() for name, p in core.named_parameters() if name.startswith(
        {"head": "lm_head", "embed": "embed_tokens", None: "layers."}[table]))
    return piece, weights


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--format", choices=["coreml", "coreai"], default="coreml")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--layer-types", default="L", help="one letter a layer, repeated: L (Gated DeltaNet), F")
    parser.add_argument("--table", choices=["embed", "head"], help="an embedding or head part instead of layers")
    parser.add_argument("--rows", type=int, default=62080, help="the table part's vocabulary rows")
    parser.add_argument("--method", choices=["affine4", "lut4"], default="affine4")
    parser.add_argument("--keep-dense", action="store_true", help="package with the fp16 dense weights held")
    options = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    pattern = (options.layer_types * options.layers)[: options.layers]
    layer_types = [KINDS[c] for c in pattern]

    from convert import backends
    from convert.backends import coreai, coreml
    from convert.export.quantized import release_dense_weights

    sampler = Sampler()
    with sampler.phase("build the part's modules (fp16 weights, codes, tables)"):
        piece, weights = part_modules(layer_types, options.table, options.rows, options.method)
    if not options.keep_dense:  # as the part process does once the part's calls are recorded
        with sampler.phase("release the quantized linears' dense weights"):
            release_dense_weights(piece.core)
            gc.collect()
    if options.format == "coreml":
        _wrap(coreml, "_tracing_copy", sampler, lambda module, spec: f"{spec.name}: fp32 tracing copy")
        _wrap(torch.jit, "trace", sampler, lambda module, *a: "trace")
        _wrap(coreml.ct, "convert", sampler, lambda *a: "ct.convert")
        _wrap(coreml.ct.models.MLModel, "save", sampler, lambda *a: "save one function")
        _wrap(coreml.ct.utils, "save_multifunction", sampler, lambda *a: "merge the functions")
    else:
        _wrap(coreai, "_export", sampler, lambda module, spec: f"{spec.name}: torch.export")
        _wrap(coreai.coreai_torch.TorchConverter, "to_coreai", sampler, lambda *a: "convert every function")
    out = Path(tempfile.gettempdir()) / f"part-memory-{options.format}"
    backend = backends.load(options.format)
    path = out.with_suffix(backends.SUFFIXES[options.format])
    backend.package(piece.functions, path)
    if options.format == "coreml":
        from convert.verify import checks

        with sampler.phase("check: read the constants back"):
            checks.check_package("coreml", path, piece, None, True)
    else:  # the check replays recorded calls on the runtime: here the package loaded and decode called once
        from convert.export import quantized
        from convert.export.spec import TORCH_DTYPES
        from convert.verify import checks

        with sampler.phase("check: the quantized constants read back"):
            checks.quantized_constants("coreai", path, quantized.quantized_weights(piece.core))
            gc.collect()
        with sampler.phase("check: the package loaded on the Core AI runtime, decode called once"):
            with coreai.open_session(path) as session:
                spec = piece.functions["decode"][1]
                session.call("decode", {t.name: torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype]).numpy()
                                        for t in spec.inputs})
    sampler.stop()
    base = sampler.base
    built = sampler.phases[1 if not options.keep_dense else 0]["end_gib"] * 2**30  # the modules as packaged
    rows = [{**p, "above_base_bytes_per_weight": round((p["peak_gib"] * 2**30 - base) / weights, 2),
             "above_modules_bytes_per_weight": round((p["peak_gib"] * 2**30 - built) / weights, 2)}
            for p in sampler.phases]
    result = {"machine": machine("cpu"), "format": options.format, "method": options.method,
              "part": options.table or pattern, "rows": options.rows if options.table else None, "weights": weights,
              "base_gib": round(base / 2**30, 2), "phases": rows}
    print(json.dumps(result, indent=1))
    write_json(options.json, result)


if __name__ == "__main__":
    main()
