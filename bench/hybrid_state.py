"""What storing a hybrid target's recurrent state in fp16 costs, against fp32 (transformers keeps it in fp32).

The hybrid fixture's export modules with the shipped fp16 weights compute in fp32 twice over the same held-out
windows, driven the way a runtime drives them: a prefill of the first ``--prefill-tokens`` tokens, then one decode
per token to the end of the window (a decode writes the state every token: the most roundings a state can see).
Once with every state fp32, once with ``recurrent_state`` stored in fp16 (rounded at every write, as a package
with an fp16 state does; the other states hold fp16 values anyway). Both are compared with transformers' fp32
forward over the window: KL, top-1, the largest logit difference between the two variants, and the state bytes
at the Qwen3.8-27B shape.

    .venv/bin/python -m bench.hybrid_state [--samples 16] [--length 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from convert.export.functions import compute_copy
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import read_args
from convert.runtime.host import module_driver
from convert.verify.gates import EvalData, load_reference
from convert.weights.target import build_modules

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3_5"


def with_fp16_recurrent_state(modules):
    """``modules`` (fp32 compute) with ``recurrent_state`` stored in fp16 in every function."""
    state = torch.zeros_like(modules.states()["recurrent_state"], dtype=torch.float16)
    for module, _ in modules.functions.values():
        module._buffers["recurrent_state"] = state
    return modules


@torch.no_grad()
def window_logits(modules, window: list[int], prefill: int) -> torch.Tensor:
    driver = module_driver(modules)
    driver.reset()
    rows = [torch.from_numpy(driver.run("prefill", window[:prefill], 0)["logits"])]
    for p in range(prefill, len(window)):
        rows.append(torch.from_numpy(driver.run("decode", [window[p]], p)["logits"]))
    return torch.cat(rows)


def kl(ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    ref_logp, cand_logp = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    return (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    from transformers import PreTrainedTokenizerFast

    args = read_args(read_json(FIXTURE / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=64, verify=8), context=options.length + 8)
    shipped = build_modules(args, target, load_tensors(FIXTURE), torch.float16)
    variants = {"fp32 state": compute_copy(shipped, torch.float32),
                "fp16 recurrent_state": with_fp16_recurrent_state(compute_copy(shipped, torch.float32))}
    reference = load_reference(FIXTURE)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(FIXTURE / "tokenizer.json"))
    data = EvalData.fixture(tokenizer, n=options.samples, length=options.length)
    start = time.perf_counter()
    stats = {name: {"kl": [], "top1": []} for name in variants}
    worst_between = 0.0
    for window in data.tokens.tolist():
        with torch.no_grad():
            ref = reference(input_ids=torch.tensor([window])).logits[0].float()
        logits = {name: window_logits(m, window, options.prefill_tokens) for name, m in variants.items()}
        for name, cand in logits.items():
            stats[name]["kl"].append(kl(ref, cand))
            stats[name]["top1"].append(ref.argmax(-1) == cand.argmax(-1))
        worst_between = max(worst_between, float((logits["fp32 state"] - logits["fp16 recurrent_state"]).abs().max()))
    print(f"hybrid fixture {FIXTURE.name}, {data.identity.n} x {data.identity.length} held-out tokens "
          f"({data.identity.corpus}), prefill {options.prefill_tokens} then one decode per token; "
          f"{platform.processor() or platform.machine()}, {options.threads} threads, "
          f"{time.perf_counter() - start:.0f} s")
    print("| recurrent state | mean KL vs transformers fp32 | max KL | top-1 |")
    print("| --- | ---: | ---: | ---: |")
    for name, s in stats.items():
        k = torch.cat(s["kl"])
        top1 = float(torch.cat(s["top1"]).double().mean())
        print(f"| {name} | {float(k.mean()):.3g} | {float(k.max()):.3g} | {top1:.4f} |")
    print(f"largest |logit difference| between the two: {worst_between:.3g}")
    a = read_args({"architectures": ["Qwen3_5ForConditionalGeneration"],
                   "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                                   "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                                   "linear_num_key_heads": 16, "linear_num_value_heads": 48}})
    n = len(a.linear_layers) * a.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim
    print(f"Qwen3.8-27B recurrent state: {2 * n / 2**20:.0f} MiB fp16, {4 * n / 2**20:.0f} MiB fp32 "
          "(read and written by every call)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
