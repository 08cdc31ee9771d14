"""Package checks run before publishing: the package must be what the torch modules are.

- Both formats: the functions read back from the saved package (names, inputs, outputs, states,
  shapes, dtypes) equal the plan.
- Core AI: the ``.aimodel`` runs on the Core AI runtime (Linux: its CPU reference, slow in fp16) on a
  short greedy sequence (prefill, decode steps, a verify block after a rollback) with the state
  carried between calls, in lockstep with the fp16 torch modules fed the same tokens. Every argmax
  must agree, except a near tie: a position where the torch logits of the two ids differ by less
  than ``NEAR_TIE_LOGITS``. Taps and logits, when the package returns them, must agree within
  ``FP16_OUTPUT_BOUND`` (relative to the largest magnitude).
- Core ML (no runtime off macOS): every 2-D weight of the modules that is not quantized appears bit for bit among
  the constants of every function of the ``.mlpackage`` (the quantized ones: below).
- Quantized linears (``convert/export/quantized.py``), both formats: in every function, each ``QuantizedWeight``
  is stored compressed with its codes and tables bit for bit, and the format's own decompression of them
  equals ``QuantizedWeight.dequantize()`` bit for bit. The Core AI run above then shows the runtime
  computes with them.
- Drafters: the same, with the Core AI run replaced by a replay of calls recorded from a speculative run of
  the torch modules, and "every function" by "some function" (``context_update`` needs no lm_head).
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from convert import backends, progress
from convert.backends.stored import ShippedWeight, difference, digest, fingerprint
from convert.errors import PackageError
from convert.export.functions import FunctionModule
from convert.export.names import ARGMAX_IDS, HIDDEN, LOGITS, SELECTOR_SCORES, TAPS
from convert.export.quantized import dense_weight_names, quantized_weights
from convert.export.spec import FunctionSpec, TensorSpec
from convert.fp16 import true_fp16
from convert.inputs.thresholds import NEAR_TIE_LOGITS
from convert.models.part import HIDDEN_OUT, Part, host_tables
from convert.runtime.chain import link_inputs, module_chain
from convert.runtime.host import COMMIT, ModuleFunctions, TargetDriver, owned_as_modules
from convert.verify import placement
from convert.weights.target import TargetModules
from quant.types import QuantizedWeight

FP16_OUTPUT_BOUND = 2e-2
FP16_STATE_BOUND = 2e-2  # the states after the run, relative to their largest magnitude (docs/benchmarks.md)
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


def check_package(name: str, path, modules, calls: list | None = None, every_function: bool | None = None) -> dict:
    """Specs read back, constants read back (quantized ones bit for bit) and, for Core AI, a run on the runtime.

    A whole target (``calls`` None) runs a greedy sequence in lockstep with its modules (``run_coreai``) and stores
    every weight in every function. A target's part replays ``calls`` recorded from the chained torch parts
    (``replay_coreai``), every weight in every function. A drafter replays ``calls`` recorded from a speculative run;
    its functions use different weights, so each weight must be stored in some function (``every_function`` False,
    the default with ``calls``).
    """
    every_function = calls is None if every_function is None else every_function
    weights = packaged(quantized_weights(modules.core), modules.core)
    backend = backends.load(name)
    check = _run_package if backend.RUNS_HERE else _read_package
    return check(name, backend, path, modules, weights, calls, every_function)


def _run_package(name: str, backend, path, modules, weights: dict, calls: list | None, every_function: bool) -> dict:
    """``check_package`` of a format whose runtime runs here: its constants read back, then its functions run."""
    specs = [spec for _, spec in modules.functions.values()]
    quantized = quantized_constants(name, path, weights, every_function) if weights else {}
    types = backend.operation_types(path)
    forms = device_safe_forms(name, path, modules, types)
    with backend.open_session(path) as session:  # one ODIX lowering for both checks
        check_specs(session.specs(), specs, path.name)
        driven = owned_as_modules(session, session.specs(), modules)
        run = run_coreai(driven, modules) if calls is None else replay_coreai(driven, calls)
        return {**run, **quantized, **forms, **_placement(name, specs, types, modules.contract)}


def _read_package(name: str, backend, path, modules, weights: dict, calls: list | None, every_function: bool) -> dict:
    """``check_package`` of a format whose runtime does not run here: every constant read back and compared, in one
    read of the package, a function's program at a time."""
    specs = [spec for _, spec in modules.functions.values()]
    comparison = QuantizedComparison(path, weights, every_function) if weights else None
    found = backend.contents(path, comparison.function if comparison else None)
    quantized = comparison.result() if comparison else {}
    forms = device_safe_forms(name, path, modules, found.operation_types)
    check_specs(found.specs, specs, path.name)
    return {**coreml_constants(path, modules, every_function, found.weight_digests), **quantized, **forms,
            **_placement(name, specs, found.operation_types, modules.contract)}


def packaged(named: dict, core) -> dict:
    """``named`` (weights or modules of ``core`` by name) but those only the host reads (``part.host_tables``)."""
    host = host_tables(core)
    return {name: value for name, value in named.items()
            if not any(name == table or name.startswith(table + ".") for table in host)}


def _placement(name: str, specs: list[FunctionSpec], types: dict[str, set[str]], contract: dict) -> dict:
    """The placement lint's findings (``convert/verify/placement.py``), under ``placement`` (a list: the manifest
    keeps it beside the check's numbers, ``record.package_entry``)."""
    findings = placement.lint(name, {s.name: s for s in specs}, types, placement.positional_buffers(contract))
    return {placement.PLACEMENT: findings}


def device_safe_forms(name: str, path, modules, types: dict[str, set[str]] | None = None) -> dict:
    """No function of the package holds an op the architecture replaced by a device-safe form (a hybrid target's
    native silu and softplus: docs/hybrid.md), so no converter pass fused the safe form back into it. ``types``: the
    package's op types by function, when already read."""
    unsafe = set(getattr(modules.core.args, "unsafe_ops", ()))
    if not unsafe:
        return {}
    types = backends.load(name).operation_types(path) if types is None else types
    for function, held in types.items():
        found = sorted(t for t in held if t in unsafe)
        if found:
            raise PackageError(f"{path.name}: function {function} holds {found[0]} ops: a conversion pass fused a "
                               f"device-safe form back into the op it avoids ({', '.join(sorted(unsafe))})")
    return {"unsafe_ops_absent": ",".join(sorted(unsafe))}


def quantized_constants(name: str, path, weights: dict[str, QuantizedWeight], every_function: bool = True,
                        shipped: dict[str, list[ShippedWeight]] | None = None) -> dict:
    """Each quantized weight stored as quantized, bit for bit, in every function of the ``name`` package
    (``QuantizedComparison``). ``shipped``: the package's compressed weights, when already read."""
    shipped = backends.load(name).compressed_weights(path) if shipped is None else shipped
    comparison = QuantizedComparison(path, weights, every_function)
    for function, found in shipped.items():
        comparison.function(function, found)
    return comparison.result()


class QuantizedComparison:
    """Each quantized weight stored as quantized, bit for bit, in every function of a package, one function's
    compressed weights at a time (``function``), then ``result``.

    Weights are found by content (codes and tables), so a weight stored under another name or shared by two
    layers still counts; one that is missing is reported with the closest stored weight and how it differs.
    Functions share stored weights: a weight and its stored form are compared once. A drafter's functions use
    different weights (``context_update`` needs no lm_head): with ``every_function=False`` each weight must be
    stored in some function, and every compressed weight any function stores must be one of ``weights`` exactly.
    """

    def __init__(self, path, weights: dict[str, QuantizedWeight], every_function: bool = True):
        self.path, self.weights, self.every_function = path, weights, every_function
        self.fingerprints = {weight_name: fingerprint(w) for weight_name, w in weights.items()}
        self.by_fingerprint = {key: weight_name for weight_name, key in self.fingerprints.items()}
        self.compared: dict[tuple[str, str], str | None] = {}
        self.functions, self.seen, self.stored_count = 0, set(), 0

    def function(self, function: str, found: list[ShippedWeight]) -> None:
        self.functions += 1
        if not self.every_function:
            return self._somewhere(function, found)
        stored = {s.fingerprint: s for s in found}
        for weight_name, expected in self.weights.items():
            match = stored.get(self.fingerprints[weight_name])
            problem = _closest(expected, found) if match is None else self._difference(weight_name, match)
            if problem:
                raise PackageError(f"{self.path.name}: function {function}: quantized weight {weight_name} is not "
                                   f"stored as quantized: {problem}")

    def _difference(self, weight_name: str, match: ShippedWeight) -> str | None:
        key = (weight_name, match.fingerprint)
        if key not in self.compared:
            self.compared[key] = difference(self.weights[weight_name], match)
        return self.compared[key]

    def _somewhere(self, function: str, found: list[ShippedWeight]) -> None:
        for stored in found:
            name = self.by_fingerprint.get(stored.fingerprint)
            problem = None if name is None else self._difference(name, stored)
            if name is None or problem:
                detail = problem or f"{stored.where}: no quantized weight has these codes and tables"
                raise PackageError(f"{self.path.name}: function {function}: a stored {stored.weight.method} weight of "
                                   f"shape {list(stored.weight.shape)} is none of the quantized weights ({detail})")
            self.seen.add(name)
            self.stored_count += 1

    def result(self) -> dict:
        if self.every_function:
            return {"quantized_weights_compared": len(self.weights) * self.functions, "quantized_bit_exact": True}
        missing = sorted(set(self.weights) - self.seen)
        if missing:
            raise PackageError(f"{self.path.name}: quantized weight {missing[0]} is stored in no function")
        return {"quantized_weights_compared": self.stored_count, "quantized_bit_exact": True}


def _closest(expected: QuantizedWeight, found: list[ShippedWeight]) -> str:
    """What tells ``expected`` from the stored weight of its method and shape with the fewest differing codes."""
    alike = [s for s in found if (s.weight.method, s.weight.shape) == (expected.method, expected.shape)]
    if not alike:
        return f"no {expected.method} weight of shape {list(expected.shape)} among the {len(found)} compressed ones"
    closest = min(alike, key=lambda s: int(torch.count_nonzero(s.weight.codes != expected.codes)))
    return f"closest {difference(expected, closest)}"


def probe_tokens(vocab: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (count,), generator=g).tolist()


class _SumProbe(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"total": x @ torch.ones(x.shape[-1], 1, dtype=x.dtype)}


@cache
def runtime_rounds_partial_sums() -> bool:
    """Whether this CPU's Core AI runtime rounds every partial sum of an fp16 product to fp16 (``fp16.true_fp16``),
    asked of the runtime once a process: 2048 and eight ones sum to 2048 so (fp16's spacing at 2048 is 2), to 2056
    with an fp32 accumulator. The CPU's flags do not tell: the runtime computes true fp16, bit for bit, on an Intel
    Xeon with AVX512-FP16 and on an AMD EPYC with AVX-512 but without AVX512-FP16 (coreai-core 1.0.0b3, measured:
    ``tests/test_fp16.py``, docs/fp16.md)."""
    x = torch.tensor([[2048.0] + [1.0] * 8], dtype=torch.float16)
    spec = FunctionSpec("total", (TensorSpec("x", tuple(x.shape), "float16"),),
                        (TensorSpec("total", (1, 1), "float16"),))
    coreai = backends.load("coreai")
    with tempfile.TemporaryDirectory(prefix="spec-convert-probe-") as tmp:
        path = Path(tmp) / "probe.aimodel"
        coreai.package({"total": (FunctionModule(_SumProbe(), spec, {}), spec)}, path)
        with coreai.open_session(path) as session:
            total = float(np.asarray(session.call("total", {"x": x.numpy()})["total"]).reshape(-1)[0])
    return total == 2048.0


def like_the_runtime(rounds: bool | None = None):
    """The arithmetic of this CPU's Core AI runtime, for the torch side of a package check: true fp16 where the
    runtime rounds every partial sum (``rounds``; None: ask it, ``runtime_rounds_partial_sums``), torch's own kernels
    elsewhere. The check then compares a package with the modules computing as the runtime does."""
    return true_fp16(runtime_rounds_partial_sums() if rounds is None else rounds)


def run_coreai(session, modules: TargetModules, prompt: list[int] | None = None) -> dict:
    """Greedy on the runtime in lockstep with the torch modules (``lockstep``), the modules computing as this CPU's
    runtime does (``like_the_runtime``)."""
    with like_the_runtime():
        return lockstep(session, ModuleFunctions(modules), modules.widths, modules.contract,
                        modules.core.args.vocab_size, prompt)


def lockstep(runtime, reference, widths: dict[str, int], contract: dict, vocab: int,
             prompt: list[int] | None = None) -> dict:
    """The check's calls (``check_calls``) on ``runtime`` in lockstep with ``reference`` (both ``Functions`` with
    ``states()``: a Core AI session and the torch modules, or the chains of a target's parts), through the target's
    host contract; returns counts and worst deltas (outputs, and the states at the end)."""
    runtime, reference = TargetDriver(runtime, widths, contract), TargetDriver(reference, widths, contract)
    runtime.reset()
    reference.reset()
    stats = {"runtime_calls": 0, "argmax_compared": 0, "argmax_near_ties": 0, "max_output_delta": 0.0}

    def call(function: str, tokens: list[int], p0: int) -> list[int]:
        """Run one call on both and compare its rows; return the runtime's argmax ids."""
        got, ref = runtime.run(function, tokens, p0), reference.run(function, tokens, p0)
        stats["runtime_calls"] += 1
        _compare(function, p0, got, ref, stats)
        return [int(t) for t in got[ARGMAX_IDS]]

    stats["greedy_ids"] = " ".join(map(str, check_calls(call, widths, contract, vocab, prompt)))
    stats["max_state_delta"] = _compare_states(runtime.functions.states(), reference.functions.states())
    return stats


def check_calls(call, widths: dict[str, int], contract: dict, vocab: int, prompt: list[int] | None = None,
                short: bool = False) -> list[int]:
    """The calls a check makes, each through ``call(function, tokens, p0) -> argmax ids``; returns the ids generated.

    A prefill, ``DECODE_STEPS`` decodes, then a rollback: on a positional contract a verify two tokens back; on a
    commit-next-call one a verify of a draft that is wrong past its first half, a partial accept of that half and the
    next verify and decode from the kept rows (the commit path on the device's arithmetic). ``short``: the calls of
    ``short_schedule``, for parts too big for the longer run.
    """
    if short:
        return [i for function, tokens, p0 in short_schedule(widths, vocab) for i in call(function, tokens, p0)]
    prompt = prompt or check_prompt(widths, vocab)
    generated = [call("prefill", prompt, 0)[-1]]
    p = len(prompt)
    for _ in range(DECODE_STEPS):
        generated.append(call("decode", [generated[-1]], p)[0])
        p += 1
    k = widths["verify"]
    if contract["rollback"] != COMMIT:
        rewind = p - 2  # reject the last two tokens: positional rollback, nothing copied
        block = (generated[-3:-2] + prompt)[:k]
        call("verify", block, rewind)
    else:
        kept = max(1, k // 2)
        block = [generated[-1]] + prompt[: k - 1]
        ids = call("verify", block, p)
        ids = call("verify", [ids[kept - 1]] + prompt[k : 2 * k - 1], p + kept)
        call("decode", [ids[0]], p + kept + 1)
    return generated


def check_prompt(widths: dict[str, int], vocab: int) -> list[int]:
    """The prompt a check's greedy run starts from when none is given: seeded tokens, half a prefill and three."""
    return probe_tokens(vocab, widths["prefill"] // 2 + 3)


def short_schedule(widths: dict[str, int], vocab: int) -> list[tuple[str, list[int], int]]:
    """A decode, a kept decode and a verify from an empty session (10 rows at verify 8) on seeded tokens, as
    (function, tokens, first position): no call depends on an output, so a target larger than memory records it one
    part at a time."""
    tokens = probe_tokens(vocab, 2 + widths["verify"])
    return [("decode", tokens[:1], 0), ("decode", tokens[1:2], 1), ("verify", tokens[2:], 2)]


def _compare_states(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The worst state difference, relative to each state's largest magnitude; above the fp16 bound is an error."""
    worst = 0.0
    for name, want in ref.items():
        want = np.asarray(want, dtype=np.float32)
        scale = max(1.0, float(np.abs(want).max()))
        delta = float(np.abs(np.asarray(got[name], dtype=np.float32) - want).max() / scale)
        if delta > FP16_STATE_BOUND:
            raise PackageError(f"state {name} differs from the torch module's by {delta:.3g} (relative), above the "
                               f"fp16 bound {FP16_STATE_BOUND}")
        worst = max(worst, delta)
    return worst


def _compare(function, p0, got, ref, stats: dict) -> None:
    """Every row of one call: argmax ids equal but for near ties, returned floats within the fp16 bound."""
    ref_ids, got_ids = ref[ARGMAX_IDS], got[ARGMAX_IDS]
    stats["argmax_compared"] += len(ref_ids)
    if (ref_ids != got_ids).any():
        logits = ref[LOGITS]
        for row in np.nonzero(ref_ids != got_ids)[0]:
            gap = abs(float(logits[row, ref_ids[row]] - logits[row, got_ids[row]]))
            if gap >= NEAR_TIE_LOGITS:
                raise PackageError(
                    f"{function} at position {p0 + row}: the .aimodel predicts {got_ids[row]}, the torch module "
                    f"{ref_ids[row]} (logit gap {gap:.3f} >= near-tie margin {NEAR_TIE_LOGITS})"
                )
            stats["argmax_near_ties"] += 1
    for name in (TAPS, HIDDEN, LOGITS):
        if name in got and name in ref:
            a, b = np.asarray(got[name], dtype=np.float32), ref[name]
            delta = float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))
            stats["max_output_delta"] = max(stats["max_output_delta"], delta)
            if delta > FP16_OUTPUT_BOUND:
                raise PackageError(f"{function}: output {name} differs from the torch module by {delta:.3g} "
                                   f"(relative), above the fp16 bound {FP16_OUTPUT_BOUND}")


def coreml_constants(path, modules, every_function: bool = True, digests: dict[str, set[str]] | None = None) -> dict:
    """Every 2-D weight of the modules but the quantized linears' (compared by ``quantized_constants``), bit for bit,
    in every function of the package (``every_function=False``, a drafter's: in some function, as its functions use
    different weights). ``digests``: the package's weight digests by function (``coreml.Contents``), when already
    read."""
    digests = backends.load("coreml").contents(path).weight_digests if digests is None else digests
    dense = dense_weight_names(modules.core)  # quantized: compared as such (quantized_constants)
    weights = packaged({name: p for name, p in modules.core.named_parameters(remove_duplicate=False)
                        if p.dim() == 2 and name not in dense}, modules.core)
    wanted = {digest(p.detach().numpy()): name for name, p in weights.items()}
    stored_anywhere = set()
    for function in modules.functions:
        shipped = digests[function]
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


def replay_coreai(session, calls: list) -> dict:
    """Replay recorded torch calls (same inputs, states carried) on the runtime and compare every output.

    Ids must be equal, except from a near tie on: a row whose top two torch scores (the selector's when the
    core has one, else the logits), or a selector's k-th and (k+1)-th logits, are closer than ``NEAR_TIE_LOGITS``
    (``decision_gap``); later rows of that call are not
    compared (the greedy walk continues from another id). Float outputs agree within ``FP16_OUTPUT_BOUND``.
    """
    stats = {"runtime_calls": 0, "ids_compared": 0, "id_near_ties": 0, "max_output_delta": 0.0}
    advance = progress.units(sum(function != "reset" for function, *_ in calls), "runtime calls")
    for function, inputs, expected in calls:
        if function == "reset":
            session.reset()
            continue
        got = session.call(function, inputs)
        stats["runtime_calls"] += 1
        advance()
        for output, value in got.items():
            value, want = np.asarray(value), np.asarray(expected[output])
            if value.dtype.kind in "iu":
                _compare_ids(function, output, value[0], want[0], expected, stats)
            elif output not in HOST_WALKED:
                delta = float(np.abs(value.astype(np.float32) - want).max() / max(1.0, float(np.abs(want).max())))
                stats["max_output_delta"] = max(stats["max_output_delta"], delta)
                if delta > FP16_OUTPUT_BOUND:
                    raise PackageError(f"{function}: output {output} differs from the torch module by {delta:.3g} "
                                       f"(relative), above the fp16 bound {FP16_OUTPUT_BOUND}")
    return stats


def _compare_ids(function: str, output: str, got: np.ndarray, want: np.ndarray, expected: dict, stats: dict) -> None:
    for row in range(len(want)):
        stats["ids_compared"] += 1
        if got[row] == want[row]:
            continue
        gap, what = decision_gap(expected, row)
        if gap >= NEAR_TIE_LOGITS:
            raise PackageError(f"{function}: {output} row {row}: the package gives {got[row]}, the torch module "
                               f"{want[row]} ({what} {gap:.3f} >= near-tie margin {NEAR_TIE_LOGITS})")
        stats["id_near_ties"] += 1
        return


# the ane host's selector walk: its scores come from the package's logits and projection (compared), per candidate
# in the order of their logits, which two near-equal logits swap without changing the walk's ids (compared)
HOST_WALKED = (SELECTOR_SCORES,)


def decision_gap(expected: dict, row: int) -> tuple[float, str]:
    """How far a row's id is from another arithmetic's choice, in the torch scores: the gap of the top two scores
    (the selector's when the core has one, else the logits), and for a selector also the gap at the edge of its
    top-k candidates (the k-th and (k+1)-th logits): across a tie there, another arithmetic walks over other
    candidates, and the pairwise term can then favour an id by far more than the tie (measured on a native-fp16
    runtime: an edge gap of 0.002 in the logits became a selector gap of 0.725)."""
    scores, logits = expected.get(SELECTOR_SCORES), expected.get(LOGITS)
    decided = scores if scores is not None else logits
    if decided is None:
        return np.inf, "top-2 score gap"
    top = np.sort(np.asarray(decided)[0, row].astype(np.float64))[::-1]
    gaps = [(float(top[0] - top[1]), "top-2 score gap")]
    if scores is not None and logits is not None:
        k = np.asarray(scores).shape[-1]
        edge = np.sort(np.asarray(logits)[0, row].astype(np.float64))[::-1]
        if len(edge) > k:
            gaps.append((float(edge[k - 1] - edge[k]), "top-k edge gap"))
    return min(gaps)


class Recorder:
    """``Functions`` that records every call (function, inputs, all outputs) and reset, for a part's check to
    replay on its package (``checks.replay_coreai``)."""

    def __init__(self, functions):
        self.functions, self.calls = functions, []

    def reset(self) -> None:
        self.functions.reset()
        self.calls.append(("reset", {}, {}))

    def states(self) -> dict[str, np.ndarray]:
        return self.functions.states()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.functions.call(function, inputs)
        self.calls.append((function, dict(inputs), out))
        return out


def recorded_calls(parts: list[Part], pieces: list, taps, contract: dict, vocab: int, short: bool) -> list[list]:
    """Each part's calls in the check's session (``checks.check_calls``) run through the chained torch parts: what
    each part's package check replays on its own, computed as this CPU's runtime computes (``like_the_runtime``)."""
    chain = module_chain(parts, pieces, taps, Recorder)
    widths = {name: spec.width for name, (_, spec) in pieces[0].functions.items()}
    driver = TargetDriver(chain, widths, contract)
    driver.reset()
    with like_the_runtime():
        check_calls(lambda f, tokens, p0: [int(t) for t in driver.run(f, tokens, p0)[ARGMAX_IDS]], widths,
                    contract, vocab, short=short)
    return [recorder.calls for _, _, recorder in chain.links]


def part_calls(piece, schedule: list[tuple[str, dict]], rows: list,
               rounds: bool | None = None) -> tuple[list, list]:
    """One part's calls of a fixed ``schedule`` ((function, whole-target inputs): ``checks.short_schedule`` through
    the host contract) on its torch modules from a fresh session, each given the previous part's ``rows`` for that
    call: ``recorded_calls`` of that schedule, one part in memory at a time. Returns the recorded calls and the rows
    for the next part (computed as in ``recorded_calls``; ``rounds``: ``like_the_runtime``'s, where this machine has no
    runtime to ask)."""
    recorder = Recorder(ModuleFunctions(piece))
    recorder.reset()
    returned = []
    for (function, inputs), given in zip(schedule, rows, strict=True):
        with like_the_runtime(rounds):
            out = recorder.call(function, link_inputs(piece.functions[function][1], inputs, given))
        returned.append(out.get(HIDDEN_OUT, given))  # a head part passes on the rows it was given, as ``Chain`` does
    return recorder.calls, returned
