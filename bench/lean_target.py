"""Benchmark: a target held as its packed codes (``CodesLinear``) at the Ternary Bonsai 2 27B width, as the drafter
stage of a parted build holds it (``PartLoader.load(lean=True)``).

Builds the quantized matrices of ``--layers`` decoder layers of ``--layer-types`` (default LLLF: three Gated DeltaNet
layers and one gated attention layer) and the 248320-row embedding and head at ``bench/scale.py``'s geometry, exact2
(seeded ternary codes, an fp16 scale per 128 columns, zero point 1, a signed Hadamard rotation of block 1024, as the
pack ships them), each a ``CodesLinear``; while a thread samples this process's resident memory (``VmRSS``) every 20 ms,
it measures: the memory they hold per weight; the fp32 compute copy (``copy.deepcopy`` then ``.to(float32)``, as
``export.functions.compute_copy`` makes it: the codes are shared); the anchor rows (``embedding_rows``: the table's
rows after its rotation, fp16, computed once); and one call's time and peak through every matrix in fp32 at decode
width (1 token) and at verify width (8 tokens), the head included, and an embedding lookup. A target call's time at
64 layers is extrapolated from the layers' (the matrices are the call's work; the rest of a layer is small at these
widths).

    PYTHONPATH=. python3 -m bench.lean_target [--layers 4] [--layer-types LLLF] [--json out.json]
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from bench.common import Sampler, arguments, machine
from bench.part_memory import KINDS
from bench.scale import GEOMETRY
from convert.export.quantized import CodesLinear, embedding_rows
from quant.types import QuantizedWeight, Rotation

GROUP, BLOCK = 128, 1024


def layer_shapes(kind: str) -> dict[str, tuple[int, int]]:
    """The rotated (quantized) matrices of one layer, [out, in]."""
    g = GEOMETRY
    hidden, inter = g["hidden_size"], g["intermediate_size"]
    mlp = {"mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    if kind == "linear_attention":
        keys = g["linear_num_key_heads"] * g["linear_key_head_dim"]
        values = g["linear_num_value_heads"] * g["linear_value_head_dim"]
        return {"linear_attn.in_proj_qkv": (2 * keys + values, hidden), "linear_attn.in_proj_z": (values, hidden),
                "linear_attn.out_proj": (hidden, values), **mlp}
    heads, kv, dim = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
    return {"self_attn.q_proj": (2 * heads * dim, hidden), "self_attn.k_proj": (kv * dim, hidden),
            "self_attn.v_proj": (kv * dim, hidden), "self_attn.o_proj": (hidden, heads * dim), **mlp}


def ternary(name: str, shape: tuple[int, int], generator: torch.Generator) -> QuantizedWeight:
    """Seeded exact2 codes 0..2 around zero point 1, scales 0.006..0.014, a +-1 rotation over the input width (rows
    made a block of 16384 at a time: the bench's own temporaries stay small)."""
    rows, columns = shape
    codes = torch.empty(shape, dtype=torch.uint8)
    for lo in range(0, rows, 16384):
        hi = min(lo + 16384, rows)
        codes[lo:hi] = torch.randint(0, 3, (hi - lo, columns), generator=generator, dtype=torch.uint8)
    scale = (0.006 + 0.008 * torch.rand(rows, columns // GROUP, generator=generator)).half()
    signs = torch.where(torch.rand(columns, generator=generator) < 0.5, -1.0, 1.0)
    return QuantizedWeight("exact2", codes, GROUP, scale=scale,
                           zero_point=torch.ones(rows, columns // GROUP, dtype=torch.uint8),
                           rotation=Rotation(signs, BLOCK))


def codes_layers(kinds: list[str], generator: torch.Generator) -> nn.ModuleList:
    """The quantized matrices of a decoder layer of each of ``kinds``, each a ``CodesLinear`` of ``ternary`` codes."""
    layers = nn.ModuleList()
    for i, kind in enumerate(kinds):
        layer = nn.ModuleDict()
        for name, shape in layer_shapes(kind).items():
            layer[name.replace(".", "_")] = CodesLinear(f"layers.{i}.{name}", ternary(name, shape, generator))
        layers.append(layer)
    return layers


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layer-types", default="LLLF", help="L (Gated DeltaNet) / F (attention), cycled")
    a = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    g = GEOMETRY
    vocab, hidden = g["vocab_size"], g["hidden_size"]
    kinds = [KINDS[a.layer_types[i % len(a.layer_types)]] for i in range(a.layers)]
    sampler = Sampler()
    target = nn.Module()
    with sampler.phase("build the CodesLinears (each matrix's codes made, packed, the unpacked codes dropped)"):
        target.embed_tokens = CodesLinear("embed_tokens", ternary("embed_tokens", (vocab, hidden), generator),
                                          embedding=True)
        target.layers = codes_layers(kinds, generator)
        target.lm_head = CodesLinear("lm_head", ternary("lm_head", (vocab, hidden), generator))
    held = sampler.phases[-1]["end_gib"] * 2**30 - sampler.base
    matrices = [m for m in target.modules() if isinstance(m, CodesLinear)]
    weights = sum(m.shape[0] * m.shape[1] for m in matrices)
    layer_weights = sum(m.shape[0] * m.shape[1] for layer in target.layers for m in layer.values())
    with sampler.phase("fp32 compute copy (deepcopy, then .to(float32): the codes shared)"):
        target32 = copy.deepcopy(target).to(torch.float32)
    shared = all(a.words is b.words for a, b in zip(matrices, (m for m in target32.modules()
                                                                if isinstance(m, CodesLinear)), strict=True))
    with sampler.phase("anchor rows: the embedding's rows after their rotation, fp16 (computed once)"):
        rows = embedding_rows(target.embed_tokens)
    timings = {}
    for width in (1, 8):
        x = torch.randn(1, width, hidden)
        with sampler.phase(f"the layers' matrices at width {width}, fp32"):
            began = time.perf_counter()
            with torch.no_grad():
                for layer in target32.layers:
                    for module in layer.values():
                        module(torch.randn(1, width, module.shape[1]))
            timings[f"layers_width_{width}_s"] = time.perf_counter() - began
        with sampler.phase(f"the head at width {width}, fp32"):
            began = time.perf_counter()
            with torch.no_grad():
                logits = target32.lm_head(x)
            timings[f"head_width_{width}_s"] = time.perf_counter() - began
        del logits
    with sampler.phase("an embedding lookup of 64 ids, fp32"):
        began = time.perf_counter()
        with torch.no_grad():
            target32.embed_tokens(torch.randint(0, vocab, (1, 64)))
        timings["lookup_64_s"] = time.perf_counter() - began
    sampler.stop()
    per_layer = {w: timings[f"layers_width_{w}_s"] / a.layers for w in (1, 8)}
    call_64 = {w: 64 * per_layer[w] + timings[f"head_width_{w}_s"] for w in (1, 8)}
    record = {
        "machine": machine("cpu"), "threads": torch.get_num_threads(), "layer_types": [k[0].upper() for k in kinds],
        "weights": weights, "layer_weights": layer_weights, "held_bytes_per_weight": round(held / weights, 4),
        "held_gib": round(held / 2**30, 2), "compute_copy_shares_codes": shared,
        "anchor_rows_gib": round(rows.nbytes / 2**30, 2),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "seconds_per_layer": {str(w): round(s, 3) for w, s in per_layer.items()},
        "estimated_call_s_at_64_layers": {str(w): round(s, 1) for w, s in call_64.items()},
        "phases": sampler.phases, "base_gib": round(sampler.base / 2**30, 2),
    }
    sampler.report(f"{weights / 1e9:.2f}G weights held as codes: {record['held_bytes_per_weight']} bytes a weight "
                   f"({record['held_gib']} GiB); compute copy shares them: {shared}; a target call at 64 layers: about "
                   f"{call_64[1]:.0f} s at width 1, {call_64[8]:.0f} s at width 8 ({torch.get_num_threads()} threads)",
                   record, a.json)

if __name__ == "__main__":
    main()
