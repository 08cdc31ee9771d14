"""Benchmark: the build's torch stages on a GPU against the CPU at the 27B width (issue #43, ``build --device``).

Writes the release rehearsal's seeded Ternary Bonsai 2 27B pack (``bench.release_rehearsal.write_pack``: the published
layout, hidden 5120, intermediate 17408, vocabulary 248320) with its first ``--layers`` layers (default 4: three Gated
DeltaNet, one gated attention), and its view, which unfolds each matrix as it is read (the build's path for a pack
larger than memory). Then, on each torch device of ``--devices`` in turn:

- the pack unfold of every matrix of the first layer (``prism.unfold``: fp64 chunks, fp32 out), timed, and its bits
  against the first device's;
- the gate's streamed fp32 reference (``convert.verify.reference.streamed_reference``, as the build's gate runs it)
  over ``--windows`` windows of ``--length`` seeded ids and a continuation of ``--greedy`` ids each: seconds, the
  GPU's peak memory, and against the first device: the largest logit and tap difference (relative to the largest
  magnitude), top-1 agreement and whether the greedy ids are the same.

``--layers 64`` is the whole pack (7.8 GB); with ``--windows 16 --length 256 --greedy 16`` it is the recipe's gate.

    PYTHONPATH=. python3 -m bench.torch_device --workdir DIR [--devices cpu cuda] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from bench.common import arguments, write_json


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _unfold_layer(pack, device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    from convert.inputs import prism
    from convert.torch_device import synchronize

    modules = [m for m in pack.modules.values() if m.path.startswith("model.layers.0.")]
    start = time.perf_counter()
    out = {m.key: prism.unfold(m, device=device) for m in modules}
    synchronize(device)
    return time.perf_counter() - start, {k: v.cpu() for k, v in out.items()}


def _compare(first, other) -> dict:
    pairs = list(zip(first, other, strict=True))
    logit_gap = max(float((a.logits - b.logits).abs().max() / a.logits.abs().max()) for a, b in pairs)
    tap_gap = max(float((a.taps[t] - b.taps[t]).abs().max() / a.taps[t].abs().max()) for a, b in pairs for t in a.taps)
    top1 = torch.cat([a.logits.argmax(-1) == b.logits.argmax(-1) for a, b in pairs]).double().mean()
    return {"logits_max_relative_difference": logit_gap, "taps_max_relative_difference": tap_gap,
            "top1_agreement": float(top1), "greedy_equal": all(a.greedy == b.greedy for a, b in pairs)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--greedy", type=int, default=4)
    options = parser.parse_args()

    from bench.release_rehearsal import write_pack
    from convert.inputs import prism
    from convert.torch_device import describe, resolve, synchronize
    from convert.verify.reference import streamed_reference

    work = options.workdir.resolve()
    result: dict = {"machine": f"{platform.machine()}, torch {torch.__version__}", "layers": options.layers,
                    "windows": options.windows, "length": options.length, "greedy": options.greedy, "devices": {}}
    start = time.perf_counter()
    write_pack(work / "pack", layers=options.layers)
    result["write_seconds"] = round(time.perf_counter() - start, 1)
    pack = prism.read_pack(work / "pack")
    view = prism.write_view(pack, work / "view")
    generator = torch.Generator().manual_seed(0)
    vocab = 248320
    windows = torch.randint(3, vocab, (options.windows, options.length), generator=generator).tolist()
    continuations = torch.randint(3, vocab, (options.windows, options.greedy), generator=generator).tolist()
    taps = sorted({0, options.layers - 1})
    first_refs = first_unfolded = None
    for name in options.devices:
        device = resolve(name)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        unfold_seconds, unfolded = _unfold_layer(pack, device)
        start = time.perf_counter()
        refs = streamed_reference(view, windows, taps, continuations, device)
        synchronize(device)
        entry = {"device": describe(device), "unfold_layer0_seconds": round(unfold_seconds, 2),
                 "reference_seconds": round(time.perf_counter() - start, 1), "gpu_peak_gib": _peak_gib(device)}
        if first_refs is None:
            first_refs, first_unfolded = refs, unfolded
        else:
            entry["unfold_bit_equal"] = all(torch.equal(first_unfolded[k], v) for k, v in unfolded.items())
            entry["against_first"] = _compare(first_refs, refs)
        result["devices"][name] = entry
        print(name, entry, flush=True)
    write_json(options.json, result)


if __name__ == "__main__":
    main()
