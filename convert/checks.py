"""Package checks run before publishing: the package must be what the torch modules are.

- Both formats: the functions read back from the saved package (names, inputs, outputs, states,
  shapes, dtypes) equal the plan.
- Core AI: the ``.aimodel`` runs on the Core AI runtime (Linux: its CPU reference, slow in fp16) on a
  short greedy sequence (prefill, decode steps, a verify block after a rollback) with the state
  carried between calls, in lockstep with the fp16 torch modules fed the same tokens. Every argmax
  must agree, except a near tie: a position where the torch logits of the two ids differ by less
  than ``NEAR_TIE_LOGITS``. Taps and logits, when the package returns them, must agree within
  ``FP16_OUTPUT_BOUND`` (relative to the largest magnitude).
- Core ML (no runtime off macOS): every 2-D weight of the modules appears bit for bit among the
  constants of every function of the ``.mlpackage`` (a compressed one as coremltools decompresses it).
- Quantized linears (``convert/compress.py``), both formats: in every function, each ``QuantizedWeight``
  is stored compressed with its codes and tables bit for bit, and the format's own decompression of them
  equals ``QuantizedWeight.dequantize()`` bit for bit. The Core AI run above then shows the runtime
  computes with them.
- Drafters: the same, with the Core AI run replaced by a replay of calls recorded from a speculative run of
  the torch modules, and "every function" by "some function" (``context_update`` needs no lm_head).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from convert import backends, compress
from convert.backends.base import FunctionSpec, PackageError
from convert.target import TargetModules
from quant.types import QuantizedWeight

# Measured on the fixture (bench/coreai_runtime.py, docs/benchmarks.md): the fp16 .aimodel's logits differ from
# the fp16 torch modules' by at most 0.10 (6.9e-3 of the largest |logit|). A flip between two ids whose torch
# logits are closer than 2.5x that error is a near tie; anything wider is a real difference.
NEAR_TIE_LOGITS = 0.25
FP16_OUTPUT_BOUND = 2e-2
DECODE_STEPS = 4


def check_specs(found: dict[str, FunctionSpec], expected: list[FunctionSpec], where: str) -> None:
    names = sorted(found)
    if names != sorted(s.name for s in expected):
        raise PackageError(f"{where}: functions {names}, expected {sorted(s.name for s in expected)}")
    for spec in expected:
        got = found[spec.name]
        for kind in ("inputs", "outputs", "states"):
            want = {t.name: (tuple(t.shape), t.dtype) for t in getattr(spec, kind)}
            have = {t.name: (tuple(t.shape), t.dtype) for t in getattr(got, kind)}
            if want != have:
                raise PackageError(f"{where}: function {spec.name} {kind} are {have}, the plan says {want}")


def check_package(name: str, path, modules, calls: list | None = None) -> dict:
    """Specs read back, constants read back (quantized ones bit for bit) and, for Core AI, a run on the runtime.

    A target (``calls`` None) runs a greedy sequence in lockstep with its modules (``run_coreai``) and stores every
    weight in every function. A drafter replays ``calls`` recorded from a speculative run (``replay_coreai``); its
    functions use different weights, so each weight must be stored in some function.
    """
    specs = [spec for _, spec in modules.functions.values()]
    every_function = calls is None
    weights = compress.quantized_weights(modules.core)
    quantized = quantized_constants(name, path, weights, every_function) if weights else {}
    if name == "coreai":
        with backends.load("coreai").open_session(path) as session:  # one ODIX lowering for both checks
            check_specs(session.specs(), specs, path.name)
            run = run_coreai(session, modules) if calls is None else replay_coreai(session, calls)
            return {**run, **quantized}
    check_specs(backends.load(name).read_back(path), specs, path.name)
    return {**coreml_constants(path, modules, every_function), **quantized}


def quantized_constants(name: str, path, weights: dict[str, QuantizedWeight], every_function: bool = True) -> dict:
    """Each quantized weight stored as quantized, bit for bit, in every function of the ``name`` package.

    Weights are found by content (codes and tables), so a weight stored under another name or shared by two
    layers still counts; one that is missing is reported with the closest stored weight and how it differs.
    A drafter's functions use different weights (``context_update`` needs no lm_head): with
    ``every_function=False`` each weight must be stored in some function, and every compressed weight any
    function stores must be one of ``weights`` exactly.
    """
    shipped = backends.load(name).compressed_weights(path)
    if not every_function:
        return _quantized_somewhere(path, weights, shipped)
    for function, found in shipped.items():
        stored = {compress.fingerprint(s.weight): s for s in found}
        for weight_name, expected in weights.items():
            match = stored.get(compress.fingerprint(expected))
            problem = _closest(expected, found) if match is None else compress.difference(expected, match)
            if problem:
                raise PackageError(f"{path.name}: function {function}: quantized weight {weight_name} is not stored "
                                   f"as quantized: {problem}")
    return {"quantized_weights_compared": len(weights) * len(shipped), "quantized_bit_exact": True}


def _quantized_somewhere(path, weights: dict[str, QuantizedWeight], shipped: dict) -> dict:
    expected = {compress.fingerprint(w): n for n, w in weights.items()}
    seen, compared = set(), 0
    for function, found in shipped.items():
        for stored in found:
            name = expected.get(compress.fingerprint(stored.weight))
            problem = None if name is None else compress.difference(weights[name], stored)
            if name is None or problem:
                detail = problem or f"{stored.where}: no quantized weight has these codes and tables"
                raise PackageError(f"{path.name}: function {function}: a stored {stored.weight.method} weight of shape "
                                   f"{list(stored.weight.shape)} is none of the quantized weights ({detail})")
            seen.add(name)
            compared += 1
    missing = sorted(set(weights) - seen)
    if missing:
        raise PackageError(f"{path.name}: quantized weight {missing[0]} is stored in no function")
    return {"quantized_weights_compared": compared, "quantized_bit_exact": True}


def _closest(expected: QuantizedWeight, found: list[compress.ShippedWeight]) -> str:
    """What tells ``expected`` from the stored weight of its method and shape with the fewest differing codes."""
    alike = [s for s in found if (s.weight.method, s.weight.shape) == (expected.method, expected.shape)]
    if not alike:
        return f"no {expected.method} weight of shape {list(expected.shape)} among the {len(found)} compressed ones"
    closest = min(alike, key=lambda s: int((s.weight.codes != expected.codes).sum()))
    return f"closest {compress.difference(expected, closest)}"


def probe_tokens(vocab: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (count,), generator=g).tolist()


def run_coreai(session, modules: TargetModules, prompt: list[int] | None = None) -> dict:
    """Greedy on the runtime in lockstep with the torch modules; returns counts and worst deltas."""
    widths = modules.widths
    vocab = modules.core.args.vocab_size
    prompt = prompt or probe_tokens(vocab, widths["prefill"] // 2 + 3)
    modules.reset()
    stats = {"runtime_calls": 0, "argmax_compared": 0, "argmax_near_ties": 0, "max_output_delta": 0.0}

    def call(function: str, tokens: list[int], p0: int, real: int) -> int:
        """Run one function on both; compare the first ``real`` rows; return the runtime's last-row argmax."""
        width = widths[function]
        ids = np.array([tokens + [0] * (width - len(tokens))], dtype=np.int32)
        pos = np.array([list(range(p0, p0 + width))], dtype=np.int32)
        got = session.call(function, {"input_ids": ids, "position_ids": pos})
        ref = modules.call(function, ids, pos)
        stats["runtime_calls"] += 1
        _compare(function, p0, got, ref, real, stats)
        return int(got["argmax_ids"][0, real - 1])

    nxt = call("prefill", prompt, 0, len(prompt))
    generated = [nxt]
    p = len(prompt)
    for _ in range(DECODE_STEPS):
        nxt = call("decode", [nxt], p, 1)
        generated.append(nxt)
        p += 1
    rewind = p - 2  # reject the last two tokens: positional rollback, nothing copied
    block = (generated[-3:-2] + prompt)[: widths["verify"]]
    call("verify", block, rewind, len(block))
    stats["greedy_ids"] = " ".join(map(str, generated))
    return stats


def _compare(function, p0, got, ref, real: int, stats: dict) -> None:
    ref_ids = ref["argmax_ids"][0, :real].numpy()
    got_ids = np.asarray(got["argmax_ids"])[0, :real]
    stats["argmax_compared"] += real
    if (ref_ids != got_ids).any():
        logits = ref["logits"][0].float()
        for row in np.nonzero(ref_ids != got_ids)[0]:
            gap = abs(float(logits[row, ref_ids[row]] - logits[row, got_ids[row]]))
            if gap >= NEAR_TIE_LOGITS:
                raise PackageError(
                    f"{function} at position {p0 + row}: the .aimodel predicts {got_ids[row]}, the torch module "
                    f"{ref_ids[row]} (logit gap {gap:.3f} >= near-tie margin {NEAR_TIE_LOGITS})"
                )
            stats["argmax_near_ties"] += 1
    for name in ("taps", "hidden", "logits"):
        if name in got and name in ref:
            a = np.asarray(got[name], dtype=np.float32)[0, :real]
            b = ref[name][0, :real].float().numpy()
            delta = float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))
            stats["max_output_delta"] = max(stats["max_output_delta"], delta)
            if delta > FP16_OUTPUT_BOUND:
                raise PackageError(f"{function}: output {name} differs from the torch module by {delta:.3g} "
                                   f"(relative), above the fp16 bound {FP16_OUTPUT_BOUND}")


def coreml_constants(path, modules, every_function: bool = True) -> dict:
    """Every 2-D weight of the modules, bit for bit, in every function of the package (``every_function=False``,
    a drafter's: in some function, as its functions use different weights)."""
    coreml = backends.load("coreml")
    weights = {name: p for name, p in modules.core.named_parameters() if p.dim() == 2}
    wanted = {_digest(p.detach().numpy()): name for name, p in weights.items()}
    stored_anywhere = set()
    for function in modules.functions:
        shipped = {_digest(a) for a in coreml.function_constants(path, function).values()}
        stored_anywhere |= shipped
        missing = [name for digest, name in wanted.items() if digest not in shipped]
        if missing and every_function:
            raise PackageError(f"{path.name}: function {function}: weight {missing[0]} is not stored bit for bit "
                               f"({len(missing)} of {len(wanted)} weights differ)")
    missing = [name for digest, name in wanted.items() if digest not in stored_anywhere]
    if missing:
        raise PackageError(f"{path.name}: weight {missing[0]} is stored bit for bit in no function "
                           f"({len(missing)} of {len(wanted)} weights)")
    return {"weights_compared": len(wanted) * (len(modules.functions) if every_function else 1),
            "weights_bit_exact": True}


def _digest(array: np.ndarray) -> str:
    a = np.ascontiguousarray(array)
    return hashlib.sha256(f"{a.dtype}:{a.shape}:".encode() + a.tobytes()).hexdigest()


def replay_coreai(session, calls: list) -> dict:
    """Replay recorded torch calls (same inputs, states carried) on the runtime and compare every output.

    Ids must be equal, except from a near tie on: a row whose top two torch scores (the selector's when the
    core has one, else the logits) are closer than ``NEAR_TIE_LOGITS``; later rows of that call are not
    compared (the greedy walk continues from another id). Float outputs agree within ``FP16_OUTPUT_BOUND``.
    """
    stats = {"runtime_calls": 0, "ids_compared": 0, "id_near_ties": 0, "max_output_delta": 0.0}
    for function, inputs, expected in calls:
        if function == "reset":
            session.reset()
            continue
        got = session.call(function, inputs)
        stats["runtime_calls"] += 1
        for output, value in got.items():
            value, want = np.asarray(value), np.asarray(expected[output])
            if value.dtype.kind in "iu":
                _compare_ids(function, output, value[0], want[0], expected, stats)
            else:
                delta = float(np.abs(value.astype(np.float32) - want).max() / max(1.0, float(np.abs(want).max())))
                stats["max_output_delta"] = max(stats["max_output_delta"], delta)
                if delta > FP16_OUTPUT_BOUND:
                    raise PackageError(f"{function}: output {output} differs from the torch module by {delta:.3g} "
                                       f"(relative), above the fp16 bound {FP16_OUTPUT_BOUND}")
    return stats


def _compare_ids(function: str, output: str, got: np.ndarray, want: np.ndarray, expected: dict, stats: dict) -> None:
    scores = expected.get("selector_scores", expected.get("logits"))
    for row in range(len(want)):
        stats["ids_compared"] += 1
        if got[row] == want[row]:
            continue
        gap = np.inf
        if scores is not None:
            top = np.sort(np.asarray(scores)[0, row].astype(np.float64))[-2:]
            gap = float(top[1] - top[0])
        if gap >= NEAR_TIE_LOGITS:
            raise PackageError(f"{function}: {output} row {row}: the package gives {got[row]}, the torch module "
                               f"{want[row]} (top-2 score gap {gap:.3f} >= near-tie margin {NEAR_TIE_LOGITS})")
        stats["id_near_ties"] += 1
        return
