"""A parted target's packages called in order as one target (``convert/pipeline/partition.py`` says how a target
is cut): each part's rows passed to the next, the taps gathered, a split head's best ids merged. ``Chain`` serves
the torch part modules and the Core AI runtime's sessions alike (``convert.runtime.host.Functions``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
from safetensors import safe_open

from convert import backends
from convert.errors import InputError
from convert.export.names import (
    ARGMAX_IDS,
    HIDDEN,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MAX_LOGIT,
    TAPS,
)
from convert.export.spec import FunctionSpec
from convert.models.part import HIDDEN_OUT, Part
from convert.runtime.host import DERIVED_INPUTS, ModuleFunctions, host_owned, table_lookup


class Chain:
    """The parts' functions called in order as one target: ``convert.runtime.host.Functions`` over one ``Functions`` per
    part (torch part modules or Core AI sessions), each given the inputs its spec names and the previous part's
    ``hidden_states``; returns what the whole target returns (taps in the recipe's order, the head's argmax over
    every split, logits concatenated where the parts return them)."""

    def __init__(self, links: list[tuple[Part, dict[str, FunctionSpec], object]], taps):
        self.links, self.taps = links, tuple(taps or ())

    def reset(self) -> None:
        for _, _, functions in self.links:
            functions.reset()

    def states(self) -> dict[str, np.ndarray]:
        """Every part's states, named ``part/state``."""
        return {f"{part.name}/{k}": v for part, _, functions in self.links for k, v in functions.states().items()}

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, tapped, out = None, {}, {}
        best = logits = None
        for part, specs, functions in self.links:
            got = functions.call(function, link_inputs(specs[function], inputs, rows))
            own = part.own_taps(self.taps)
            if own:
                for layer, value in zip(own, np.split(np.asarray(got[TAPS]), len(own), axis=-1), strict=True):
                    tapped[layer] = value
            if HIDDEN_OUT in got:
                rows = got[HIDDEN_OUT]
            if part.head is None:
                continue
            ids = np.asarray(got[ARGMAX_IDS])
            top = np.asarray(got[MAX_LOGIT]) if part.splits_head else None
            if best is None:
                out[ARGMAX_IDS], best = ids, top
            else:  # a later part wins only with a strictly larger logit: ties keep the lower id, as argmax does
                better = top > best
                out[ARGMAX_IDS], best = np.where(better, ids, out[ARGMAX_IDS]), np.where(better, top, best)
            if HIDDEN in got and HIDDEN not in out:
                out[HIDDEN] = got[HIDDEN]
            if LOGITS in got:
                logits = [*(logits or []), np.asarray(got[LOGITS])]
        if tapped:
            out[TAPS] = np.concatenate([tapped[t] for t in self.taps], axis=-1)
        if logits:
            out[LOGITS] = np.concatenate(logits, axis=-1)
        return out


def link_inputs(spec: FunctionSpec, inputs: dict[str, np.ndarray], rows: np.ndarray | None) -> dict[str, np.ndarray]:
    """What one part's function takes of a whole target's call ``inputs`` and the previous part's ``rows`` (the
    host's buffers, which the part's ``host_owned`` functions add, are not the call's; nor are the inputs its host
    computes, from the positions or, for the first part of an ane target, from the ids)."""
    given = {**inputs, HIDDEN_STATES: rows} if rows is not None else inputs
    linked = {t.name: np.asarray(given[t.name], dtype=t.dtype) for t in spec.inputs if t.name in given}
    taken = {t.name for t in spec.inputs}
    for source in {DERIVED_INPUTS[name] for name in taken & set(DERIVED_INPUTS)}:
        linked[source] = np.asarray(inputs[source], dtype=np.int32)
    if HIDDEN_STATES in taken and rows is None:
        linked[INPUT_IDS] = np.asarray(inputs[INPUT_IDS], dtype=np.int32)
    return linked


def module_chain(parts: list[Part], pieces: list, taps, wrap=None) -> Chain:
    """A ``Chain`` over the parts' torch modules (each ``ModuleFunctions``, wrapped by ``wrap`` when given)."""
    functions = [ModuleFunctions(m) if wrap is None else wrap(ModuleFunctions(m)) for m in pieces]
    specs = [{name: spec for name, (_, spec) in m.functions.items()} for m in pieces]
    return Chain(list(zip(parts, specs, functions, strict=True)), taps)


def manifest_parts(manifest) -> list[Part]:
    """The parts of a target bundle's manifest, in order (the whole target when it has none)."""
    vocab = manifest.architecture.vocab_size
    return [Part.from_record(r, vocab) for r in manifest.parts] if manifest.parts else []


@contextmanager
def coreai_target(folder: Path, manifest) -> Iterator[object]:
    """A target bundle's Core AI packages as one ``convert.runtime.host.Functions``: its session, or its parts' sessions
    chained in the manifest's order (the host's embedding lookup, where the contract has one, in the bundle's
    table)."""
    packages = {p.part: p for p in manifest.packages if p.format == "coreai"}
    if not packages:
        raise InputError(f"{folder}: no .aimodel package (built without the coreai backend); use --runtime torch")
    parts, contract = manifest_parts(manifest), manifest.host_contract.model_dump()
    lookup = bundle_lookup(folder, contract)
    if not parts:
        with coreai_functions(folder / packages[None].path, contract, lookup) as functions:
            yield functions
        return
    with coreai_chain(parts, [folder / packages[p.name].path for p in parts],
                      manifest.taps.layers if manifest.taps else (), contract, lookup) as chain:
        yield chain


def bundle_lookup(folder: Path, contract: dict):
    """The host's embedding lookup in the (target) bundle's table (``contract["embedding"]["file"]``; None without
    one), read a row at a time from the file (``table_lookup``)."""
    if not contract.get("embedding"):
        return None
    return table_lookup(_bundle_file(folder / contract["embedding"]["file"], "embedding rows").get_slice("weight"))


def bundle_codebooks(folder: Path, contract: dict):
    """A DFlash2 drafter bundle's selector codebook lookups (``contract["selector"]["file"]``; None without a
    selector), read a row at a time."""
    if not contract.get("selector"):
        return None
    tables = _bundle_file(folder / contract["selector"]["file"], "selector codebooks")
    return tuple(table_lookup(tables.get_slice(f"candidate_selector.{side}_codebook"))
                 for side in ("predecessor", "successor"))


def _bundle_file(path: Path, what: str):
    if not path.is_file():
        raise InputError(f"{path}: missing; the bundle's host contract reads its {what} from it (rebuild the bundle)")
    return safe_open(str(path), framework="np")


@contextmanager
def coreai_drafter(folder: Path, manifest, target_folder: Path) -> Iterator[object]:
    """A drafter bundle's Core AI package as a runtime drives it under its host contract (none: the package itself):
    an MTP head's embedding rows from the target bundle's table, a DFlash2 selector's codebooks from its own file."""
    package = next((p for p in manifest.packages if p.format == "coreai"), None)
    if package is None:
        raise InputError(f"{folder}: no .aimodel package (built without the coreai backend); use --runtime torch")
    contract = manifest.host_contract.model_dump() if manifest.host_contract else {}
    with backends.load("coreai").open_session(folder / package.path) as session:
        yield host_owned(session, session.specs(), contract, bundle_lookup(target_folder, contract), None,
                         bundle_codebooks(folder, contract))


@contextmanager
def coreai_functions(path: Path, contract: dict, lookup=None) -> Iterator[object]:
    """A Core AI session of one ``.aimodel`` as a runtime drives it under the target's host ``contract``: with what
    the host owns (``convert.runtime.host.host_owned``; ``lookup``: its embedding lookup)."""
    with backends.load("coreai").open_session(path) as session:
        yield host_owned(session, session.specs(), contract, lookup)


@contextmanager
def coreai_chain(parts: list[Part], paths: list[Path], taps, contract: dict, lookup=None) -> Iterator[Chain]:
    """A ``Chain`` over a Core AI session of each part's ``.aimodel`` (``paths``, in the parts' order), each driven
    under the target's host ``contract`` (``lookup``: its embedding lookup)."""
    coreai = backends.load("coreai")
    with ExitStack() as stack:
        sessions = [stack.enter_context(coreai.open_session(path)) for path in paths]
        yield Chain([(p, s.specs(), host_owned(s, s.specs(), contract, lookup, p.head if p.splits_head else None))
                     for p, s in zip(parts, sessions, strict=True)], taps)
