"""Build the drafter bundle of a recipe with both roles, after its target (``convert.pipeline.build.build``).

Stages: modules with the target's shipped tables -> (quantize) -> acceptance on held-out prompts with the
lossless check (and for a quantized drafter the paired A/B against the fp16 one) -> package per backend ->
check (read back; the ``.aimodel`` replays a recorded speculative run on the Core AI runtime) -> compile ->
manifest bound to the target build. A lossy run or a significant A/B loss fails closed (exit 1).

The torch phases compute on the build's torch device (``build --device``: ``Plan.torch_device``): the fp32 compute
copies of the target and the drafter (the range scale, the calibration and its Hessians, GPTQ, plain greedy, the
acceptance and its economics, the n-gram baseline, the A/B) and the fp16 ones of the device pass are made there, and
the host side of every call stays numpy (``ModuleFunctions``). The shipped modules, which are packaged, stay on the
CPU: each GPTQ'd linear's codes come back there. The package check's recorded calls are made on the CPU by the modules
as packaged, in this CPU's runtime arithmetic (``packaged_calls``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from convert import cache as build_cache
from convert.errors import GateError
from convert.export.functions import compute_copy
from convert.export.hadamard import as_products
from convert.export.quantized import CodesLinear, dense_products, packaged_from_codes
from convert.inputs.sources import file_records, license_files
from convert.pipeline import drafter, drafter_accept, drafter_calibration, drafter_memory
from convert.pipeline.bundle import MANIFEST
from convert.pipeline.packaging import package_formats, weights_digest
from convert.pipeline.record import built_at, function_record, package_entry, toolchain_versions
from convert.progress import console, stage
from convert.runtime.economics import format_economics, ngram_speedup
from convert.runtime.host import ModuleFunctions
from convert.runtime.speculative import paired_ab
from convert.torch_device import cache_key, free_bytes
from convert.verify import gates
from convert.weights.quantize import calibration_text
from convert.weights.shipped import at_context
from convert.weights.target import TargetModules
from manifests import identity
from manifests.schema import DrafterManifest, Manifest

CHECK_PROMPT_TOKENS = 24  # the replayed run on the Core AI runtime: a short prompt ...
CHECK_GENERATED = 12  # ... and a few rounds
PHASE_TOOLCHAIN = ("torch", "transformers", "tokenizers", "numpy")
QUANTIZED_STAGE = "drafter-quantize"  # the build cache's stage of a drafter's GPTQ'd linears


class PhaseKeys:
    """The prompt journals (``drafter.PromptJournal``) of the drafter stage's phases in the build ``cache``: each keyed
    by everything its prompts' results are computed from: the target's source files and recipe section (which make
    its shipped weights), the drafter's source files and recipe section, the toolchain, the build's code, the torch
    device off the CPU (``torch_device.cache_key``: a GPU's fp32 sums in another order can decide a near tie, or the
    last bits of a GPTQ'd code, otherwise; so a build on one never restores the other's prompts or codes as its own,
    and the CPU's keys are what they were), and the phase's own inputs (its name, prompts and tokens; a digest of the
    drafter's weights where they were quantized here). ``target_files`` / ``drafter_files``: records with ``path``
    and ``sha256``. Nothing without an enabled cache."""

    def __init__(self, plan, cache, target_files, drafter_files):
        self.cache = cache
        self.base = None if cache is None or not cache.enabled else {
            "code": build_cache.code_fingerprint(("convert.pipeline.drafter_build",)),
            "versions": build_cache.versions(PHASE_TOOLCHAIN),
            "target_sources": {f.path: f.sha256 for f in target_files},
            "target": plan.recipe.target.model_dump(mode="json"),
            "drafter_sources": {f.path: f.sha256 for f in drafter_files},
            "drafter": plan.drafter.config.model_dump(mode="json"), **cache_key(plan.torch_device)}

    def key(self, phase: str, prompts: list[list[int]], tokens: int, modules=None) -> str | None:
        """``phase``'s key over ``prompts`` and ``tokens``; ``modules``: the drafter they run, by its weights."""
        if self.base is None:
            return None
        weights = None if modules is None else weights_digest(modules)
        return build_cache.key({**self.base, "phase": phase, "prompts": prompts, "tokens": tokens,
                                "drafter_weights": weights})

    def journal(self, phase: str, prompts: list[list[int]], tokens: int,
                modules=None) -> drafter.PromptJournal | None:
        key = self.key(phase, prompts, tokens, modules)
        return None if key is None else drafter.PromptJournal(self.cache, key)


def text_prompts(plan, spec, field: str) -> tuple[list[list[int]], dict]:
    """``spec.samples`` windows of ``spec.length`` tokens of the spec's corpus through the target tokenizer, and
    their identity (corpus sha256, n, length, seed, tokens generated after each)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(plan.snapshot.directory / "tokenizer.json"))
    text = calibration_text(spec.corpus, plan.recipe_path.resolve().parent, field)
    data = gates.EvalData.from_text(text, tokenizer, spec.samples, spec.length, spec.seed, corpus=spec.corpus)
    return data.tokens.tolist(), {**data.identity.model_dump(), "tokens": spec.tokens}


def held_out_prompts(plan) -> tuple[list[list[int]], dict]:
    """The recipe's acceptance prompts (``drafter.accept``, by default the held-out split)."""
    return text_prompts(plan, plan.drafter.config.accept, "drafter.accept.corpus")


def stage_copy(plan, target: TargetModules) -> TargetModules:
    """The fp32 compute copy of the shipped ``target`` that the drafter stage runs its prompts on, on the build's
    torch device (on the CPU its weights shared; a GPU's copy is its own), its states (the ane layout: the host's
    buffers, made when it is driven) at the rows the stage reaches (``drafter.stage_target``), so a session holds
    those rows, not the package's whole context. On an accelerator its weights are laid out dense where its memory
    holds them (``dense_on_device``)."""
    copy = compute_copy(at_context(target, plan.args, drafter.stage_target(plan.recipe)), torch.float32,
                        share_weights=True, device=plan.torch_device)
    if plan.torch_device.type != "cpu":
        dense_on_device(plan, copy)
    return copy


DEVICE_HEADROOM_BYTES = 24 * 10**9
"""What the drafter stage keeps free on an accelerator beside its target's dense weights (``dense_on_device``), the
drafter's fp32 copy counted apart: GPTQ's Hessians, the calls' activations, the codes' workspaces. A choice, not
measured at 27B (on an H100's 80 GB: the target's codes 7 GB, its fp16 weights 54 GB)."""


def dense_on_device(plan, target32: TargetModules) -> None:
    """The stage copy's quantized linears on an accelerator compute from weights dequantized once
    (``export.quantized.dense_products``), not from their codes on every call, within its free memory less
    ``DEVICE_HEADROOM_BYTES`` and the drafter's fp32 copy: in fp32 where all fit, else in fp16 (cast on each call)
    as many as fit; each Walsh-Hadamard rotation one product (``export.hadamard.as_products``), as the gate's
    candidate computes there. On the CPU, whose memory the recipe's budget counts, the codes are dequantized a
    block at a time on every call."""
    linears = [m for m in target32.core.modules() if isinstance(m, CodesLinear) and not m.embedding]
    if not linears:
        return
    if plan.torch_device.type == "cuda":
        torch.cuda.empty_cache()  # what torch's allocator keeps of the phases before counts as free
    budget = free_bytes(plan.torch_device) - DEVICE_HEADROOM_BYTES - 4 * plan.drafter.args.parameter_count
    weights = sum(m.shape[0] * m.shape[1] for m in linears)
    dtype = torch.float32 if 4 * weights <= budget else torch.float16
    laid = dense_products(target32.core, dtype, max(0, budget))
    as_products(target32.core)
    console.print(f"  the target's weights on {plan.torch_device}: {laid / 1e9:.1f} GB dense in "
                  f"{str(dtype).removeprefix('torch.')} ({laid / (dtype.itemsize * weights):.0%} of them), the rest "
                  "from their codes on each call")


def shipped_drafter(plan, target: TargetModules, target32: TargetModules,
                    reload_layers: Callable[[], torch.nn.Module] | None = None, keys: PhaseKeys | None = None):
    """(shipped modules, fp16 reference modules or None, quantization record or None). ``target32`` is the
    shipped target computing in fp32 (``stage_copy``), which GPTQ calibration drives; the range scale, the
    calibration's Hessians and the quantizers compute on the build's torch device, the shipped modules stay on the
    CPU. With ``reload_layers`` (a loader of the target's decoder layers, a parted build's) the target lets its
    decoder layers go once the calibration's target calls are made, while GPTQ runs, and loads them again after
    (``target32``'s are then gone: make it again). ``keys``: the calibration's prompts are journaled and the GPTQ'd
    linears kept in the build cache (stage ``QUANTIZED_STAGE``, keyed by the torch device too: ``PhaseKeys``), whence
    a build run again restores them without calibrating."""
    dplan, quant = plan.drafter, plan.drafter.config.quantization
    with stage(f"load drafter {dplan.kind} ({dplan.snapshot.reference})"):
        modules = drafter.build_modules(dplan, plan.recipe, target, torch.float16)
    own, ranged = 1.0, None
    if plan.recipe.target.rescale:
        prompt, tokens = held_out_prompts(plan)[0][0], dplan.config.accept.tokens
        with stage(f"range: the drafter's fp32 peaks over speculative decoding of a held-out prompt ({tokens} "
                   "tokens)"):
            own, ranged = drafter.range_scale(plan, target, target32, modules, prompt, tokens)
        if own != 1:
            with stage(f"load drafter {dplan.kind} again, its range scale folded"):
                modules = drafter.build_modules(dplan, plan.recipe, target, torch.float16, own)
        modules.rescale = ranged
    if quant.method == "none":
        return modules, None, None
    hessians, calibration, quantized_key = None, None, None
    if quant.uses_gptq:
        spec = quant.calibration
        prompts, calibration = text_prompts(plan, spec, "drafter.quantization.calibration.corpus")
        quantized_key = None if keys is None else keys.key("quantize", prompts, spec.tokens)
        entry = None if quantized_key is None else keys.cache.get(QUANTIZED_STAGE, quantized_key)
        if entry is not None:
            with stage(f"quantize drafter {quant.method}: its GPTQ'd linears restored from the build cache"):
                record = drafter_calibration.restore_quantized(modules, entry)
            return modules, _fp16_reference(plan, target, own), {**record, "calibration": calibration}
        with stage(f"calibrate drafter: speculative decoding of {len(prompts)} x {spec.length} tokens + "
                   f"{spec.tokens} generated ({spec.corpus})"):
            journal = None if keys is None else keys.journal("calibrate", prompts, spec.tokens)
            hessians = drafter_calibration.calibration_hessians(  # the copy is let go before the last group's GPTQ
                dplan.kind, target32, compute_copy(modules, torch.float32, share_weights=True,
                                                   device=plan.torch_device),
                prompts, spec.tokens, drafter.anchor_table(target), plan.drafter_sessions, journal)
    groups = len(drafter_memory.hessian_groups(modules.core))
    replays = "" if hessians is None or groups == 1 else (
        f"; Hessians of {groups} groups of linears, from the calibration's drafter calls replayed")
    dropped = reload_layers is not None and hessians is not None
    if dropped:  # the target's calls are made; at 27B its layers' codes are 6.8 GB beside GPTQ's largest Hessians
        target.core.layers = target32.core.layers = torch.nn.ModuleList()
    device = plan.torch_device
    with stage(f"quantize drafter {quant.method} (groups of {quant.resolved_group_size}{replays}) on {device.type}"):
        if quantized_key is None:
            record = drafter_calibration.quantize(modules, quant, hessians, device=device)
        else:
            entry = keys.cache.put(QUANTIZED_STAGE, quantized_key,
                                   lambda directory: drafter_calibration.store_quantized(modules, quant, hessians,
                                                                                         directory, device))
            record = entry.meta["record"]
    if dropped:
        with stage("load the target's decoder layers again, as packed codes (let go while GPTQ ran)"):
            target.core.layers = reload_layers()
    return modules, _fp16_reference(plan, target, own), {**record, "calibration": calibration}


def _fp16_reference(plan, target: TargetModules, own_scale: float):
    """The A/B's fp16 reference, loaded again rather than held while the drafter was quantized (each linear's fp16
    weight is let go as it is quantized: at 27B the drafter's 3.85 GB beside GPTQ's largest Hessians), its range
    scale folded as the shipped one's."""
    with stage(f"load drafter {plan.drafter.kind} again in fp16 (the A/B's reference)"):
        return drafter.build_modules(plan.drafter, plan.recipe, target, torch.float16, own_scale)


def measure(plan, target: TargetModules, target32: TargetModules, modules, fp16_modules, prompts: list[list[int]],
            tokens: int, references: list, functions: tuple | None = None,
            keys: PhaseKeys | None = None) -> tuple[dict, dict | None]:
    """Acceptance of the shipped pair against ``references`` (plain greedy of each prompt: lossless or fail), the
    bytes each call reads and the predicted speedup, the n-gram baseline on the same target, and for a quantized
    drafter the A/B verdict against the fp16 one. The torch modules compute in fp32 on the build's torch device
    (``target32``: the shipped target upcast, ``stage_copy``; the drafters' copies are made there) unless
    ``functions`` (the target's and the drafter's, e.g. Core AI sessions of the packages) are given; the fp16 drafter
    of the A/B then runs as torch modules against that target (no fp16 package is shipped). Bytes are a property of
    the graphs and are metered on the torch modules. ``keys``: the torch runs' prompts are journaled (``PhaseKeys``;
    not on ``functions``)."""
    dplan, spec, sessions = plan.drafter, plan.drafter.config.accept, plan.drafter_sessions
    embeddings = drafter.anchor_table(target)
    drafter32 = compute_copy(modules, torch.float32, share_weights=True, device=plan.torch_device)
    keys = keys if functions is None else None

    def journal(phase: str, drafter_modules=None):
        return None if keys is None else keys.journal(phase, prompts, tokens, drafter_modules)

    def with_drafter(drafter_functions):
        return None if functions is None else (functions[0], drafter_functions)

    with stage(f"accept: {len(prompts)} prompts x {tokens} tokens, speculative vs greedy"):
        stats, runs = drafter_accept.accept(dplan.kind, target32, drafter32, prompts, tokens, embeddings, references,
                                     functions, sessions, journal("accept", modules))
    drafter_accept.raise_if_lossy(stats, runs)
    with stage("economics: bytes read per call (one metered run)"):
        economics = drafter_accept.economics(dplan.kind, target, target32, modules, drafter32, prompts[0], tokens,
                                      embeddings, stats["tokens_per_round"])
    with stage("n-gram baseline: prompt lookup on the same prompts and target (no package)"):
        ngram, ngram_runs = drafter_accept.accept(drafter.NGRAM, target32, None, prompts, tokens, embeddings,
                                                  references, with_drafter(None), sessions, journal("ngram"))
    drafter_accept.raise_if_lossy(ngram, ngram_runs)
    ngram["predicted_speedup"] = ngram_speedup(ngram, economics["verify_cost"])
    acceptance = {**stats, "economics": economics, "ngram": ngram}
    if fp16_modules is None:
        return acceptance, None
    base32 = compute_copy(fp16_modules, torch.float32, share_weights=True, device=plan.torch_device)
    with stage("A/B: the fp16 drafter on the same prompts"):
        base_stats, base_runs = drafter_accept.accept(dplan.kind, target32, base32, prompts, tokens, embeddings,
                                               references, with_drafter(ModuleFunctions(base32)), sessions,
                                               journal("ab-fp16"))
    ab = drafter_accept.ab_verdict(paired_ab(base_runs, runs), spec.max_p_value)
    ab["fp16_tokens_per_round"] = base_stats["tokens_per_round"]
    if ab["significant_loss"]:
        raise GateError(
            f"drafter quantization {dplan.config.quantization.method} loses acceptance: {ab['accepted_other']} vs "
            f"{ab['accepted_base']} accepted drafts over {ab['matched_rounds']} paired rounds, sign test p = "
            f"{ab['sign_test_p']:.3g} < {spec.max_p_value}; ship it with drafter.quantization.method: none"
        )
    return acceptance, ab


def measure_held_out(plan, target: TargetModules, target32: TargetModules, modules, fp16_modules, held_out,
                     keys: PhaseKeys | None = None):
    """``measure`` on the recipe's held-out prompts (``held_out_prompts``) in torch, against plain greedy of the
    same modules (``keys``: every phase's prompts journaled)."""
    (prompts, data), tokens = held_out, plan.drafter.config.accept.tokens
    with stage(f"plain greedy decoding: {len(prompts)} held-out prompts x {tokens} tokens"):
        references = drafter_accept.greedy_references(target32, prompts, tokens, plan.drafter_sessions,
                                               None if keys is None else keys.journal("greedy", prompts, tokens))
    acceptance, ab = measure(plan, target, target32, modules, fp16_modules, prompts, tokens, references, keys=keys)
    return {"data": data, **acceptance}, ab


def _by_position(stats: dict) -> str:
    return ", ".join("-" if a is None else f"{a:.2f}" for a in stats["acceptance_by_position"])


def format_stats(stats: dict) -> str:
    lines = [f"tokens per round {stats['tokens_per_round']:.3f} over {stats['rounds']} rounds; acceptance by draft "
             f"position [{_by_position(stats)}]; lossless {stats['lossless']} ({stats['near_ties']} near ties)"]
    if "economics" in stats:
        lines.append(format_economics(stats["economics"]))
    if "ngram" in stats:
        ngram = stats["ngram"]
        per_verify = "-" if ngram["tokens_per_verify"] is None else f"{ngram['tokens_per_verify']:.3f}"
        lines.append(
            f"n-gram baseline (prompt lookup, orders 3..1, no package): {ngram['tokens']} tokens in "
            f"{ngram['verify_calls']} verify + {ngram['decode_calls']} decode calls (a proposal in "
            f"{ngram['hit_rate']:.2f} of rounds, {per_verify} tokens per verify); acceptance by draft position "
            f"[{_by_position(ngram)}]; lossless {ngram['lossless']} -> predicted speedup "
            f"{ngram['predicted_speedup']:.2f}x")
    return "\n".join(lines)


def format_ab(ab: dict) -> str:
    return (f"A/B quantized vs fp16 (fp16: {ab['fp16_tokens_per_round']:.3f} tokens per round): "
            f"{ab['matched_rounds']} paired rounds, identical proposals "
            f"{ab['identical_proposals']:.3f}, more accepted: fp16 {ab['base_more']} / quantized {ab['other_more']}, "
            f"sign test p {ab['sign_test_p']:.3g}, accepted drafts fp16 {ab['accepted_base']} / quantized "
            f"{ab['accepted_other']}")


def build_drafter(plan, target: TargetModules, target_files: list, target_manifest: Callable[[], Manifest],
                  target_dir: Path, out: Path, cache=None, reload_layers: Callable[[], torch.nn.Module] | None = None,
                  side_by_side: bool = True):
    """The drafter's bundle in ``out``: its modules quantized as the recipe says, acceptance measured, packages (from
    the build ``cache`` when given: their keys hold the calls their check replays) and manifest. ``target_files``: the
    target's source files (the drafter's cache keys hold them); ``target_manifest``: the target's manifest, asked for
    once the drafter's packages are made (where the target's packaging pool runs beside this stage,
    ``build._overlaps``, it waits for the pool there: the drafter's packages are made while the pool still runs, one
    format after the other in this process, ``side_by_side`` False, as no process forks beside the pool's thread).
    ``target`` is spent:
    once the drafter's check calls are recorded, its decoder layers are dropped (at 27B, 7.5 GB of codes the
    packaging does not read; the tables the drafter borrows are its own layers by then). ``reload_layers``: see
    ``shipped_drafter``."""
    dplan = plan.drafter
    out.mkdir()
    with stage("hash drafter source files"):
        source_files = file_records(dplan.snapshot.directory)
    keys = PhaseKeys(plan, cache, target_files, source_files)
    target32 = stage_copy(plan, target)
    modules, fp16_modules, quantization = shipped_drafter(plan, target, target32, reload_layers, keys)
    if reload_layers is not None:
        del target32  # (on a GPU its own memory) before the copy over the layers loaded again
        target32 = stage_copy(plan, target)
    held_out = held_out_prompts(plan)
    acceptance, ab = measure_held_out(plan, target, target32, modules, fp16_modules, held_out, keys)
    tokens = dplan.config.accept.tokens
    with stage(f"device pass of the pair: a held-out prompt x {tokens} tokens, the target on the "
               f"{gates.DEVICE_OF_LAYOUT[plan.recipe.target.layout]}, the drafter on the "
               f"{gates.DEVICE_OF_LAYOUT[dplan.config.layout]} (their arithmetic)"):
        acceptance["device"] = drafter_accept.device_pass(plan, target, target32, modules, held_out[0][0], tokens)
    del target32  # packaging needs only the fp16 modules; the fp32 copy of the target is freed
    console.print(format_stats(acceptance))
    if ab:
        console.print(format_ab(ab))
    calls = packaged_calls(plan, target, modules, held_out)
    del fp16_modules  # the A/B's reference (the drafter's fp16 weights) is not packaged
    target.core.layers = torch.nn.ModuleList()
    packages = []
    stem = package_stem(dplan)
    for done in package_formats(plan.recipe.backends, modules, out, stem, calls, cache, side_by_side=side_by_side):
        packages.append(package_entry(done.format, done.path, out, done.check, done.compiled))
    extra_files = _write_extras(dplan, modules, out)
    made = target_manifest()  # where the target's pool runs beside this stage, it ends here
    manifest = _manifest(plan, source_files, modules, made, target_dir, packages, extra_files,
                         quantization, acceptance, ab)
    (out / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def packaged_calls(plan, target: TargetModules, modules, held_out: list) -> list:
    """The calls the drafter's package check replays (``drafter_calibration.recorded_calls`` over the first held-out
    prompt), recorded by its modules as they are packaged (``packaged_from_codes``: its quantized linears and a lean
    target's tables become the layers a package is made from), so that every product is the package's own: in the ane
    layout a 1x1 convolution, which the runtime rounds about once (as torch's kernel does), where a ``CodesLinear``
    multiplies rows, which the runtime's true fp16 rounds at every partial sum (at the 27B drafter's width its selector
    projection came out 0.41 from the package's: docs/lab/2026-12-07-the-drafter-check-at-27b.md)."""
    packaged_from_codes(modules.core)
    prompt = held_out[0][0][:CHECK_PROMPT_TOKENS]
    return drafter_calibration.recorded_calls(plan.drafter.kind, target, modules, prompt, CHECK_GENERATED,
                                              drafter.anchor_table(target))


def package_stem(dplan) -> str:
    """The drafter's packages' file stem, as forge names them: ``dflash2_lut4`` (``dflash2_fp16`` unquantized)."""
    method = dplan.config.quantization.method
    return f"{dplan.kind}_{'fp16' if method == 'none' else method}"


def _write_extras(dplan, modules, out: Path) -> list[dict]:
    """config.json, LICENSE / NOTICE, SOURCE.json and (DFlash2) selector.safetensors as shipped."""
    from safetensors.torch import save_file

    source = dplan.snapshot.directory
    written = []
    for path in [*license_files(source), source / "config.json"]:
        shutil.copy2(path, out / path.name)
        written.append(out / path.name)
    record = {"reference": dplan.snapshot.reference, "repo": dplan.snapshot.repo, "revision": dplan.snapshot.revision,
              "kind": dplan.kind, "layout": dplan.checkpoint_layout}
    (out / "SOURCE.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    written.append(out / "SOURCE.json")
    codebooks = {n: p.detach().contiguous() for n, p in modules.core.named_parameters() if "codebook" in n}
    if codebooks:  # upstream's keys: candidate_selector.{predecessor,successor}_codebook, no .weight
        save_file(codebooks, str(out / "selector.safetensors"))
        written.append(out / "selector.safetensors")
    return [{"path": p.name, "sha256": identity.file_sha256(p), "size": p.stat().st_size} for p in sorted(written)]


def _binding(dplan, target_manifest: Manifest, target_dir: Path) -> dict:
    """The target manifest's records the drafter depends on, whole (``manifests.schema.TargetBinding``), and what the
    drafter family takes from the target beside them (its ``binding``: a mask row's token, a hidden convention)."""
    own = dplan.family.binding(dplan.args)
    mask = own["mask_token_id"]
    records = target_manifest.model_dump(mode="json")
    return {
        "export_id": target_manifest.export_id,
        **{name: records[name] for name in identity.BOUND_RECORDS},
        "mask_token_id": mask,
        "mask_row_sha256": identity.embedding_row_sha256(target_dir / identity.EMBEDDINGS_FILE, mask)
        if mask is not None else None,
        "hidden_convention": own["hidden_convention"],
    }


def _architecture(dplan, modules) -> dict:
    args = dplan.args
    family = dplan.family.architecture(args, dplan.config, dplan.widths, modules.core)
    return {
        "kind": family["kind"], "architectures": family["architectures"], "layout": dplan.checkpoint_layout,
        "hidden_size": args.hidden_size, "num_layers": family["num_layers"], "num_heads": args.num_attention_heads,
        "num_kv_heads": args.num_key_value_heads, "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size,
        "rope_theta": args.rope_theta, "rms_norm_eps": args.rms_norm_eps,
        "parameter_count": args.parameter_count, "runtime": family["runtime"],
    }


def _manifest(plan, source_files, modules, target_manifest, target_dir, packages, extra_files, quantization,
              acceptance, ab) -> DrafterManifest:
    dplan = plan.drafter
    data = {
        "name": f"{plan.recipe.name}-{dplan.kind}",
        "export_id": "",
        "built_at": built_at(),
        "toolchain": toolchain_versions(),
        "source": {"reference": dplan.snapshot.reference, "repo": dplan.snapshot.repo,
                   "revision": dplan.snapshot.revision, "files": [vars(r) for r in source_files]},
        "architecture": _architecture(dplan, modules),
        "target": _binding(dplan, target_manifest, target_dir),
        "quantization": quantization,
        "acceptance": _jsonable(acceptance),
        "ab": _jsonable(ab) if ab else None,
        "rescale": modules.rescale.model_dump() if modules.rescale else None,
        "host_contract": modules.contract or None,
        "functions": [function_record(s) for s in dplan.specs],
        "packages": packages,
        "extra_files": extra_files,
    }
    manifest = DrafterManifest.model_validate(data)
    manifest.export_id = identity.export_id(manifest.identity())
    return manifest


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda v: v.item() if isinstance(v, np.generic) else str(v)))
