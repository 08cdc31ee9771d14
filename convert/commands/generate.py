"""``spec-convert generate``: greedy decoding of a bundle through its host contract, the smoke test a release
engineer runs on a bundle.

The prompt goes through the bundle's own tokenizer, then prefill chunks (the last one right-padded) and decode
steps, driven by ``convert.runtime.host.TargetDriver`` from the manifest's functions and host contract alone, as a
runtime would. ``--runtime coreai`` runs the shipped ``.aimodel`` (a parted target's parts, chained) on the Core AI
runtime (on Linux its CPU reference, fp16 emulated: slow); ``--runtime torch`` runs the export modules with the shipped
weights, rebuilt from the recipe and checked against the bundle's hashes. Decoding stops after ``tokens`` ids or
at the end-of-sequence id, as transformers' greedy ``generate`` does.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from convert.commands.gate import weights_match
from convert.commands.inspect import open_target
from convert.errors import InputError, quote
from convert.export.names import ARGMAX_IDS
from convert.export.spec import WIDTH_INPUTS
from convert.pipeline.build import shipped_modules
from convert.pipeline.bundle import MANIFEST
from convert.pipeline.plan import make_plan
from convert.progress import console, stage, steps
from convert.runtime.chain import coreai_target
from convert.runtime.host import TargetDriver, module_driver
from manifests.schema import Manifest


@dataclass
class Generation:
    runtime: str
    prompt: str
    prompt_ids: list[int]
    generated_ids: list[int]
    text: str

    def as_dict(self) -> dict:
        return asdict(self)


def target_bundle(bundle: Path, run_formats: tuple[str, ...] = ()) -> tuple[Path, Manifest]:
    """The target part of a bundle (a pair's ``target/``) and its manifest, its files checked
    (``convert.commands.inspect.open_target``; those of ``run_formats``' packages hashed)."""
    folder = bundle / "target" if not (bundle / MANIFEST).is_file() and (bundle / "target" / MANIFEST).is_file() \
        else bundle
    manifest = open_target(folder, "generate (give the pair or its target/)", run_formats)
    widths(manifest, folder)
    return folder, manifest


def widths(manifest: Manifest, folder: Path | None = None) -> dict[str, int]:
    """Tokens per call of each function (the ``[1, S]`` of its ``position_ids`` input, or in the ane layout of its
    ``hidden_states``: ``WIDTH_INPUTS``); a manifest without prefill and decode functions of that form is refused."""
    found = {}
    for i, f in enumerate(manifest.functions):
        by_name = {t.name: t.shape for t in f.inputs}
        shape = next((by_name[n] for n in WIDTH_INPUTS if n in by_name), None)
        if shape is None or len(shape) < 2 or shape[0] != 1 or shape[1] < 1:
            raise InputError(f"{folder or manifest.name}: manifest.json functions[{i}] ({quote(f.name, 40)}): no "
                             f"{', '.join(WIDTH_INPUTS[:-1])} or {WIDTH_INPUTS[-1]} input [1, S, ...]; rebuild the "
                             "bundle")
        found[f.name] = shape[1]
    missing = [name for name in ("prefill", "decode") if name not in found]
    if missing:
        raise InputError(f"{folder or manifest.name}: manifest.json functions: no {' or '.join(missing)} function; "
                         "rebuild the bundle")
    return found


def greedy(driver: TargetDriver, prompt: list[int], tokens: int, eos: int | None, told: bool = False) -> list[int]:
    """Greedy ids after ``prompt``: at most ``tokens``, ending early with ``eos``. ``told``: the prefill and the decode
    steps are stages on stderr (``convert.progress``), the decoding rate at the end."""
    if not told:
        out = driver.prefill(prompt)
        ids = [int(out[ARGMAX_IDS][-1])]
        while len(ids) < tokens and ids[-1] != eos:
            ids.append(int(driver.run("decode", [ids[-1]], len(prompt) + len(ids) - 1)[ARGMAX_IDS][0]))
        return ids
    start = time.perf_counter()
    with stage(f"prefill: {len(prompt)} prompt tokens"):
        ids = [int(driver.prefill(prompt)[ARGMAX_IDS][-1])]
    prefilled = time.perf_counter()
    if len(ids) < tokens and ids[-1] != eos:
        with steps("decode", tokens - 1, "steps at most") as advance:
            while len(ids) < tokens and ids[-1] != eos:
                ids.append(int(driver.run("decode", [ids[-1]], len(prompt) + len(ids) - 1)[ARGMAX_IDS][0]))
                advance()
    end = time.perf_counter()
    decoded = len(ids) - 1
    rate = f"{decoded / (end - prefilled):.2f} tokens/s decoding" if decoded else "no decode step"
    console.print(f"generated {len(ids)} tokens in {end - start:.1f} s: {len(ids) / (end - start):.2f} tokens/s "
                  f"overall (prefill {len(prompt)} tokens in {prefilled - start:.1f} s; {rate})", soft_wrap=True)
    return ids


def generate(bundle: Path, prompt: str, tokens: int, runtime: str, recipe: Path | None = None) -> Generation:
    from transformers import AutoTokenizer

    folder, manifest = target_bundle(bundle, ("coreai",) if runtime == "coreai" else ())
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    ids = tokenizer.encode(prompt)
    if not ids:
        raise InputError("--prompt: the text encodes to no tokens")
    context = manifest.architecture.context
    if len(ids) + tokens > context:
        raise InputError(f"--prompt is {len(ids)} tokens: with -n {tokens} that exceeds the bundle's context "
                         f"({context})")
    contract, eos = manifest.host_contract.model_dump(), manifest.tokenizer.eos_id
    if runtime == "coreai":
        packages = [p.path for p in manifest.packages if p.format == "coreai"]
        with ExitStack() as stack:
            with stage(f"load {', '.join(packages)} on the Core AI runtime"):
                functions = stack.enter_context(coreai_target(folder, manifest))
            generated = greedy(TargetDriver(functions, widths(manifest), contract), ids, tokens, eos, told=True)
    else:
        if recipe is None:
            raise InputError("--runtime torch rebuilds the shipped weights from the bundle's recipe: give --recipe")

        modules, _ = shipped_modules(make_plan(recipe))
        weights_match(manifest, modules, folder, recipe)
        generated = greedy(module_driver(modules), ids, tokens, eos, told=True)
    return Generation(runtime, prompt, ids, generated, tokenizer.decode(generated))
