"""Benchmark: loading the 27B DFlash2 drafter as the drafter stage does (``convert.pipeline.drafter.build_modules``'s
family call, ``dflash2.load_checkpoint`` then ``dflash2.build_modules`` in fp16), measured in this process's resident
memory (``VmRSS``, sampled every 20 ms).

The checkpoint is ``bench/release_rehearsal.py``'s seeded drafter at the published config (1.92B parameters, bf16,
3.85 GB), written into ``--dir`` by a first run with ``--write`` (its own process, so that the measured run starts
clean). The target's head is lent as a lean target lends it: a placeholder of its shape (one fp16 zero, expanded), which
the stage then replaces by the target's ``CodesLinear``.

    PYTHONPATH=. python3 -m bench.drafter_load --dir DIR --write
    PYTHONPATH=. python3 -m bench.drafter_load --dir DIR [--json out.json]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.common import Sampler, arguments, machine
from bench.release_rehearsal import write_drafter
from convert.models import dflash2


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--write", action="store_true", help="write the seeded checkpoint into --dir and exit")
    a = parser.parse_args()
    if a.write:
        print(f"{write_drafter(a.dir):,} parameters written to {a.dir}")
        return
    sampler = Sampler()
    began = time.perf_counter()
    with sampler.phase("load_checkpoint (every tensor as the drafter stage reads it)"):
        args, tensors = dflash2.load_checkpoint(a.dir)
    head = torch.zeros((), dtype=torch.float16).expand(args.vocab_size, args.hidden_size)
    with sampler.phase("build_modules in fp16 (the core, its weights, the lent head and mask row)"):
        modules = dflash2.build_modules(args, tensors, head, torch.zeros(args.hidden_size, dtype=torch.float16),
                                        torch.float16, max_positions=8192, ring_rows=2048, update_width=64,
                                        append_width=8, mask_scale=0.7, draft_width=8)
        del tensors
    seconds = time.perf_counter() - began
    sampler.stop()
    own = sum(p.numel() for n, p in modules.core.named_parameters() if not n.startswith("lm_head"))
    held = sampler.phases[-1]["end_gib"] * 2**30 - sampler.base
    peak = max(p["peak_gib"] for p in sampler.phases) * 2**30 - sampler.base
    record = {"machine": machine("cpu"), "own_parameters": own, "seconds": round(seconds, 1),
              "held_gib": round(held / 2**30, 2), "peak_gib": round(peak / 2**30, 2),
              "peak_bytes_per_own_parameter": round(peak / own, 2), "phases": sampler.phases,
              "base_gib": round(sampler.base / 2**30, 2)}
    sampler.report(f"{own / 1e9:.2f}B own parameters loaded in {seconds:.0f} s: held {record['held_gib']} GiB, peak "
                   f"{record['peak_gib']} GiB above the start ({record['peak_bytes_per_own_parameter']} bytes a "
                   "parameter)", record, a.json)


if __name__ == "__main__":
    main()
