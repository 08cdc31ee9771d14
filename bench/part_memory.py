"""Benchmark: the host memory of packaging one part at the Qwen3.8-27B width, phase by phase.

The plan sizes parts by what packaging one costs per weight (``convert/pipeline/partition.py``:
``PACKAGING_BYTES_PER_LAYER_WEIGHT``, ``PACKAGING_BYTES_PER_TABLE_WEIGHT``). This measures where those bytes go: it
builds the export modules of one part at ``bench/scale.py``'s geometry (hidden 5120, intermediate 17408) with
``--layers`` decoder layers of ``--layer-types`` (default one Gated DeltaNet layer) or, with ``--table``, an embedding
or head part of ``--rows`` vocabulary rows; seeded weights (std 0.02) quantized round-to-nearest (``--method``
affine4 or lut4: the same codes-and-tables structure as their GPTQ forms); then packages it in one ``--format`` in
this process, as the build's part process does, while a thread samples this process's resident memory (``VmRSS``)
every 20 ms. Each phase's peak is reported in bytes per weight of the part above the memory before the modules were
built and above the memory once they are built (what stays then is the part's fp16 weights, codes and tables; the
bench's own seeded weights and their quantization peak while they are built). The phases: building the modules,
then per function the backend's steps (Core ML: the fp32 tracing copy, the trace, the conversion, the save; Core AI:
the export), then Core ML's multifunction merge and its package check (the constants read back) or Core AI's
conversion of all functions (its check, a replay on the runtime, is not measured here).

    PYTHONPATH=. python3 -m bench.part_memory [--format coreml] [--layers 1] [--layer-types L] [--method affine4]
                                              [--table embed|head --rows 62080] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.scale import GEOMETRY, _machine

KINDS = {"L": "linear_attention", "F": "full_attention"}


class Sampler:
    """Samples this process's VmRSS; ``phase(name)`` records the peak while the block runs."""

    def __init__(self, period: float = 0.02):
        self.period, self.current, self.peak = period, 0, 0
        self.phases: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.base = self._rss()
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.current = self._rss()
            self.peak = max(self.peak, self.current)
            time.sleep(self.period)

    @contextmanager
    def phase(self, name: str):
        self.peak = start = self._rss()
        began = time.perf_counter()
        try:
            yield
        finally:
            self.peak = max(self.peak, self._rss())
            self.phases.append({"phase": name, "seconds": round(time.perf_counter() - began, 1),
                                "start_gib": round(start / 2**30, 2), "peak_gib": round(self.peak / 2**30, 2),
                                "end_gib": round(self._rss() / 2**30, 2)})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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
    core = qwen3_5.build_core(args, target).to(torch.float16).eval()
    quantized = {}
    for name, module in core.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        with torch.no_grad():
            value = torch.randn(weight.shape, generator=generator) * (0.02 if weight.dim() == 2 else 0.1)
            weight.copy_(value + (1.0 if weight.dim() == 1 else 0.0))
        wanted = name in ("embed_tokens", "lm_head") if table else name.startswith("layers.")
        if weight.dim() == 2 and wanted and "in_proj_a" not in name and "in_proj_b" not in name:
            fit = quantize_affine if method == "affine4" else quantize_lut
            quantized[name] = fit(weight.float(), target.quantization.resolved_group_size)
        del value
    apply_quantized(core, quantized)
    del quantized
    if table == "head":  # the other table is not the part's: free it (the part process never loads it)
        core.embed_tokens = torch.nn.Embedding(1, args.hidden_size, dtype=torch.float16)
    elif table == "embed":
        core.lm_head = torch.nn.Linear(args.hidden_size, 1, bias=False, dtype=torch.float16)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["coreml", "coreai"], default="coreml")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--layer-types", default="L", help="one letter a layer, repeated: L (Gated DeltaNet), F")
    parser.add_argument("--table", choices=["embed", "head"], help="an embedding or head part instead of layers")
    parser.add_argument("--rows", type=int, default=62080, help="the table part's vocabulary rows")
    parser.add_argument("--method", choices=["affine4", "lut4"], default="affine4")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    pattern = (options.layer_types * options.layers)[: options.layers]
    layer_types = [KINDS[c] for c in pattern]

    from convert import backends
    from convert.backends import coreai, coreml

    sampler = Sampler()
    with sampler.phase("build the part's modules (fp16 weights, codes, tables)"):
        piece, weights = part_modules(layer_types, options.table, options.rows, options.method)
    if options.format == "coreml":
        _wrap(coreml, "_tracing_copy", sampler, lambda module, spec: f"{spec.name}: fp32 tracing copy")
        _wrap(torch.jit, "trace", sampler, lambda module, *a: "trace")
        _wrap(coreml.ct, "convert", sampler, lambda *a: "ct.convert")
        _wrap(coreml.ct.models.MLModel, "save", sampler, lambda *a: "save one function")
        _wrap(coreml.ct.utils, "save_multifunction", sampler, lambda *a: "merge the functions")
    else:
        _wrap(coreai, "_export", sampler, lambda module, spec: f"{spec.name}: torch.export")
        _wrap(coreai.coreai_torch.TorchConverter, "to_coreai", sampler, lambda *a: "convert every function")
    out = Path(f"/tmp/part-memory-{options.format}")
    backend = backends.load(options.format)
    path = out.with_suffix(backends.SUFFIXES[options.format])
    backend.package(piece.functions, path)
    if options.format == "coreml":  # the Core AI check replays recorded calls on the runtime: not measured here
        from convert.verify import checks

        with sampler.phase("check: read the constants back"):
            checks.check_package("coreml", path, piece, None, True)
    sampler.stop()
    base = sampler.base
    built = sampler.phases[0]["end_gib"] * 2**30
    rows = [{**p, "above_base_bytes_per_weight": round((p["peak_gib"] * 2**30 - base) / weights, 2),
             "above_modules_bytes_per_weight": round((p["peak_gib"] * 2**30 - built) / weights, 2)}
            for p in sampler.phases]
    result = {"machine": _machine("cpu"), "format": options.format, "method": options.method,
              "part": options.table or pattern, "rows": options.rows if options.table else None, "weights": weights,
              "base_gib": round(base / 2**30, 2), "phases": rows}
    print(json.dumps(result, indent=1))
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
