"""The host side of a target: calls its functions the way a runtime must, following its host contract.

One driver serves every caller (the gates, the package checks, ``generate``, ``demo``, speculative decoding) and
every runtime: it talks to a ``Functions`` (``call(function, inputs) -> outputs`` on numpy arrays, ``reset()``:
a fresh session with zeroed states), which the torch export modules and the Core AI runtime's sessions both are.

The contract (``host_contract`` of the architecture family, recorded in the manifest) decides what the driver adds:

- ``positional`` (dense targets): nothing. Rolling back is continuing at an earlier position.
- ``commit-next-call`` (hybrid targets): every call gets ``accept``, the rows of the previous call to keep,
  which the driver derives from positions (the next call's first position minus the previous call's first
  position), and refuses a position the contract cannot reach (rolling back past the previous call); a prefill also
  gets ``valid``, its real rows.

A contract with ``buffers`` (the ane layout: packages without states, lookups or argmax) is served under the driver,
per package, by ``HostOwned`` (``host_owned``): the host's history passed in, each call's rows written back, the
position inputs computed from ``position_ids``, the embedding rows looked up from ``input_ids``, the head's argmax
taken from its logits. Drafters in the ane layout have contracts of their own, served the same way under their
drivers (``convert.runtime.speculative``): a DFlash2 drafter's ring (rows at slot position mod ring, the masks from
the positions its slots hold, the selector's walk), an MTP head's history (row 0 never read) and argmax.

A call's rows are right-padded to the function's width with the last token at positions continuing past the real
rows (never the same position twice: on a hybrid target a padding row computes something else than the real row
at its position, and both would write that attention row).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from convert.errors import InputError
from convert.export.ane import MASKED, history_mask_row, rope_rows
from convert.export.functions import torch_device_of
from convert.export.names import (
    ACCEPT,
    ANCHOR_ID,
    ARGMAX_IDS,
    COMMIT_MASK,
    COMMIT_SELECT,
    HISTORY_MASK,
    INPUT_IDS,
    LOGITS,
    MAX_LOGIT,
    POSITION_IDS,
    ROPE_COS,
    ROPE_SIN,
    VALID,
    VALID_MASK,
    VALID_SELECT,
)
from convert.export.quantized import embedding_rows
from convert.export.selector import selector_walk
from convert.export.spec import TORCH_DTYPES, buffer_specs
from convert.fp16 import device_arithmetic
from convert.models.part import rung_name

COMMIT = "commit-next-call"


class Functions(Protocol):
    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def reset(self) -> None: ...


class HostContractError(ValueError):
    """A call the target's host contract cannot serve (e.g. a rollback past the previous call on a hybrid)."""


def padded(values: list[int], width: int) -> np.ndarray:
    """int32 [1, width]: ``values`` right-padded by repeating the last one."""
    return np.asarray([values + [values[-1]] * (width - len(values))], dtype=np.int32)


def positions(p0: int, width: int) -> np.ndarray:
    """int32 [1, width]: positions p0 .. p0+width-1 (padding rows get positions of their own)."""
    return np.arange(p0, p0 + width, dtype=np.int32)[None]


class TargetDriver:
    """prefill / decode / verify of a target on ``functions``, through ``contract`` (a manifest ``host_contract``)."""

    def __init__(self, functions: Functions, widths: dict[str, int], contract: dict):
        self.functions, self.widths, self.contract = functions, widths, contract
        self.commits = contract["rollback"] == COMMIT
        self.lazy = set(contract.get("pending_rows", {}))
        self.committed = self.pending = 0  # committed rows end at `committed`; `pending` rows follow, not yet kept

    def reset(self) -> None:
        self.functions.reset()
        self.committed = self.pending = 0

    def inputs(self, function: str, tokens: list[int], p0: int) -> dict[str, np.ndarray]:
        """The inputs of one call (and the contract's bookkeeping for it)."""
        width, real = self.widths[function], len(tokens)
        if not 1 <= real <= width:
            raise HostContractError(f"{function} takes 1..{width} tokens, got {real}")
        inputs = {INPUT_IDS: padded(tokens, width), POSITION_IDS: positions(p0, width)}
        if not self.commits:
            return inputs
        accept = p0 - self.committed
        if not 0 <= accept <= self.pending:
            kept = f"{self.committed}..{self.committed + self.pending}"
            raise HostContractError(
                f"{function} at position {p0}: the next call must start at a position in {kept} (the previous call "
                "left its rows pending from its first position; earlier rows are committed and cannot be rolled back)")
        inputs[ACCEPT] = np.asarray([accept], dtype=np.int32)
        if function in self.lazy:
            self.committed, self.pending = p0, real
        else:
            inputs[VALID] = np.asarray([real], dtype=np.int32)
            self.committed, self.pending = p0 + real, 0
        return inputs

    def run(self, function: str, tokens: list[int], p0: int) -> dict[str, np.ndarray]:
        """Outputs of the ``len(tokens)`` real rows of one call at positions ``p0 ..``."""
        out = self.functions.call(function, self.inputs(function, tokens, p0))
        return {k: np.asarray(v)[0, : len(tokens)] for k, v in out.items()}

    def prefill(self, prompt: list[int]) -> dict[str, np.ndarray]:
        """A fresh session, then the whole prompt in prefill chunks; outputs concatenated over its rows."""
        if not prompt:
            raise InputError("the prompt has no tokens")
        self.reset()
        width, parts = self.widths["prefill"], []
        for start in range(0, len(prompt), width):
            parts.append(self.run("prefill", prompt[start : start + width], start))
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def greedy(self, prompt: list[int], tokens: int) -> tuple[list[int], list[np.ndarray | None]]:
        """Plain greedy decoding: the ids, and per id the logits it was chosen from when returned."""
        out = self.prefill(prompt)
        ids, logits = [int(out[ARGMAX_IDS][-1])], [out.get(LOGITS, [None])[-1]]
        while len(ids) < tokens:
            step = self.run("decode", [ids[-1]], len(prompt) + len(ids) - 1)
            ids.append(int(step[ARGMAX_IDS][0]))
            logits.append(step[LOGITS][0] if LOGITS in step else None)
        return ids, logits


class HostOwned:
    """``Functions`` of a package whose states, lookups and argmax the host owns (the ane layout, docs/layouts.md):
    each of the contract's ``buffers`` is passed to every call that takes it, and the call's rows for it (the output
    the contract names, taken out of what the call returns) are written into it at the call's positions; the inputs
    the host computes from the positions (``contract["positions"]``: RoPE's rows, the history mask) are passed in
    place of ``position_ids``; the embedding rows of the call's ids (``contract["embedding"]``) in place of
    ``input_ids`` where the package takes them and the caller passed none; a hybrid's commit masks and selections
    from ``accept`` / ``valid`` (``contract["commits"]``); a head's logits in parts (``contract["logits_parts"]``)
    put side by side as ``logits``; and, with ``contract["argmax"]`` ``host``, the head's ``logits`` are reduced to
    ``argmax_ids`` (or the contract's ``argmax_ids`` name; and ``max_logit``) as a package with its own argmax returns
    them. With a ``contract["ladder"]`` a call goes to the smallest entry that holds it (``rung``). A drafter's: the
    ring masks from the positions its ring's slots hold (``ring_mask_inputs``) and the candidate selector's walk
    (``walk``). ``reset`` zeros the buffers and ``states`` returns them, so a driver sees what a package with states
    shows: after each call the buffers hold what its states would hold."""

    def __init__(self, functions: Functions, specs: dict, contract: dict, lookup=None,
                 split_head: tuple[int, int] | None = None, codebooks=None, on: torch.device | None = None):
        """``contract``: the target's (or the drafter's); its buffers taken by no function of ``specs`` are left out.
        ``lookup``: the embedding rows of ids (``ids -> rows``; ``table_lookup``, ``module_lookup``), for a package that
        takes the host's rows. ``split_head``: the vocabulary rows of the head the package computes when it is a split
        head's part (its ids count from the first; it returns ``max_logit`` for the host to merge the parts' ids).
        ``codebooks``: a DFlash2 drafter's (predecessor, successor) codebook lookups, for its selector walk.
        ``on``: a torch device the buffers are held on as tensors (torch modules computing on an accelerator, whose
        calls return the buffers' rows as tensors there: ``ModuleFunctions``); numpy on the host without it."""
        self.functions, self.specs, self.lookup, self.split_head = functions, specs, lookup, split_head
        self.on = on
        inputs = {t.name: t for spec in specs.values() for t in spec.inputs}
        outputs = {t.name for spec in specs.values() for t in spec.outputs}
        self.rules = {name: rule for name, rule in contract.get("buffers", {}).items() if name in inputs}
        self.positions = contract.get("positions") if set(inputs) & POSITION_INPUTS else None
        embedding = contract.get("embedding") or {}
        self.embedded = embedding.get("input") if embedding.get("input") in inputs else None
        self.commits = {count: names for count, names in contract.get("commits", {}).items() if names["mask"] in inputs}
        self.argmax = contract.get("argmax") == "host"
        self.ids = contract.get(ARGMAX_IDS, ARGMAX_IDS)
        self.ladder = contract.get("ladder", [])
        self.ring_masks = {name: window for name, window in contract.get("ring_masks", {}).items() if name in inputs}
        selector = contract.get("selector")
        self.selector = selector if selector and selector["projection"] in outputs else None
        parts = list(contract.get("logits_parts", {}))
        self.logits_parts = parts if parts and set(parts) <= outputs else []
        self.codebooks = codebooks
        # each as large as the largest function takes it (a ladder's entries take leading rows)
        self.buffers = {t.name: np.zeros(t.shape, dtype=t.dtype) if on is None else
                        torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype], device=on)
                        for t in buffer_specs(list(specs.values()), self.rules)}
        # a ring's slots: the position each holds (-1: none yet), for the ring masks
        ring = next((rule["ring"] for rule in self.rules.values() if rule.get("ring")), None)
        self.slot_positions = None if ring is None else np.full(ring, -1, dtype=np.int64)

    def reset(self) -> None:
        self.functions.reset()
        for buffer in self.buffers.values():
            buffer[...] = 0
        if self.slot_positions is not None:
            self.slot_positions[...] = -1

    def states(self) -> dict[str, np.ndarray]:
        return dict(self.buffers) if self.on is None else numpy_outputs(self.buffers)

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``inputs`` as a driver gives them (``input_ids``, ``position_ids``, a hybrid's ``accept`` / ``valid``); the
        package gets what its function takes (the smallest entry of the ladder that holds the call)."""
        function = self.rung(function, inputs)
        spec = self.specs[function]
        where = np.asarray(inputs[POSITION_IDS]).reshape(-1).astype(np.int64) if POSITION_IDS in inputs else None
        taken = self.package_inputs(spec, inputs, where)
        out = dict(self.functions.call(function, taken))
        written = False
        for name, rule in self.rules.items():
            rows = out.pop(rule["rows"], None)
            if rows is not None:
                write(self.buffers[name], rows if self.on is not None else np.asarray(rows), rule, where)
                written |= bool(rule.get("ring"))
        if written:
            self.slot_positions[where % len(self.slot_positions)] = where
        if self.logits_parts and self.logits_parts[0] in out:  # the head's parts side by side: the whole logits
            out[LOGITS] = np.concatenate([np.asarray(out.pop(name)) for name in self.logits_parts], axis=-1)
        if self.selector and self.selector["projection"] in out:
            out.update(self.walk(spec, out, inputs))
        elif self.argmax and LOGITS in out:
            logits = np.asarray(out[LOGITS])  # argmax: the first of equal maxima, as the packages' own argmax
            out[self.ids] = logits.argmax(-1).astype(np.int32)
            if self.split_head:
                out[self.ids] += self.split_head[0]
                out[MAX_LOGIT] = logits.max(-1)
        return out

    def walk(self, spec, out: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A DFlash2 draft's selector walk (``contract["selector"]``) from its ``logits`` and projection and the
        caller's ``anchor_id``, in the dtype the function returns its logits in (fp16 from a package: the arithmetic of
        the stateful function's walk)."""
        if self.codebooks is None:
            raise HostContractError("the drafter's host walks its candidate selector, and no codebooks were given")
        dtype = TORCH_DTYPES[next(t.dtype for t in spec.outputs if t.name in (LOGITS, *self.logits_parts))]
        logits = torch.from_numpy(np.asarray(out[LOGITS])[0]).to(dtype)
        projected = torch.from_numpy(np.asarray(out[self.selector["projection"]])[0]).to(dtype)
        anchor = torch.as_tensor(np.asarray(inputs[ANCHOR_ID]).reshape(-1)[:1].astype(np.int64))
        predecessor, successor = (lambda ids, table=table: torch.from_numpy(
            np.asarray(table(ids.reshape(-1).numpy()))).to(dtype).reshape(*ids.shape, -1) for table in self.codebooks)
        ids, scores, _ = selector_walk(projected, logits, anchor, self.selector["top_k"], predecessor, successor)
        return {self.selector["ids"]: ids.to(torch.int32).numpy()[None],
                self.selector["scores"]: scores.float().numpy()[None]}

    def package_inputs(self, spec, inputs: dict[str, np.ndarray], where: np.ndarray | None) -> dict[str, np.ndarray]:
        """What ``spec``'s function takes: the caller's inputs, the buffers (a smaller ladder entry's: their leading
        rows), and what the host computes from the positions, the ids and the commit counts."""
        given = {**inputs, **self.buffers}
        for name, rule in self.rules.items():
            wanted = next((t.shape for t in spec.inputs if t.name == name), None)
            if wanted is not None and wanted != self.buffers[name].shape:
                index = [slice(None)] * len(wanted)
                index[rule["axis"]] = slice(0, wanted[rule["axis"]])
                leading = self.buffers[name][tuple(index)]
                given[name] = np.ascontiguousarray(leading) if self.on is None else leading.contiguous()
        if self.positions and where is not None:
            given.update(self.position_inputs(spec, where))
        if self.ring_masks and where is not None:
            given.update(self.ring_mask_inputs(spec, where))
        if self.embedded and given.get(self.embedded) is None:
            dtype = next(t.dtype for t in spec.inputs if t.name == self.embedded)
            given[self.embedded] = self.embedded_rows(np.asarray(inputs[INPUT_IDS])).astype(dtype)
        for count, names in self.commits.items():
            if count in inputs:
                given.update(commit_inputs(spec, names, int(np.asarray(inputs[count]).reshape(-1)[0])))
        return {t.name: given[t.name] for t in spec.inputs}

    def rung(self, function: str, inputs: dict[str, np.ndarray]) -> str:
        """The entry of ``function`` to call (``contract["ladder"]``): the one at the smallest context whose history
        holds the call's rows (its first position plus its width at most the context), else ``function`` itself."""
        return rung(self.specs, self.ladder, function, inputs)

    def embedded_rows(self, ids: np.ndarray) -> np.ndarray:
        """The host's lookup: the rows [1, S, hidden] of ``ids`` [1, S]."""
        if self.lookup is None:
            raise HostContractError(f"the package takes the host's embedding rows as {self.embedded}, and no "
                                    "embedding table was given to look them up in")
        return np.asarray(self.lookup(ids.reshape(-1).astype(np.int64)))[None]

    def position_inputs(self, spec, where: np.ndarray) -> dict[str, np.ndarray]:
        """RoPE's rows and the history mask of a call at positions ``where`` (the contract's ``positions``), in the
        dtypes the function takes them."""
        dtypes = {t.name: t.dtype for t in spec.inputs}
        shapes = {t.name: t.shape for t in spec.inputs}
        given = {}
        if ROPE_COS in dtypes:
            cos, sin = rope_rows(torch.from_numpy(where), self.positions["rotary_dim"], self.positions["rope_theta"])
            given[ROPE_COS], given[ROPE_SIN] = (cos.numpy().astype(dtypes[ROPE_COS]),
                                                    sin.numpy().astype(dtypes[ROPE_SIN]))
        if HISTORY_MASK in dtypes:
            mask = history_mask_row(int(where[0]), shapes[HISTORY_MASK][1], self.positions.get("first_row", 0))
            given[HISTORY_MASK] = mask.astype(dtypes[HISTORY_MASK])
        return given

    def ring_mask_inputs(self, spec, where: np.ndarray) -> dict[str, np.ndarray]:
        """The ring masks [ring, S] (``contract["ring_masks"]``) of a call at positions ``where``: a slot is visible to
        the query at position q when it holds a position below the call's first and, with a window, within it."""
        held = self.slot_positions[:, None]
        visible = (held >= 0) & (held < where[0])
        masks = {}
        for t in spec.inputs:
            if t.name in self.ring_masks:
                window = self.ring_masks[t.name]
                seen = visible if window is None else visible & (where[None, :] - held < window)
                masks[t.name] = np.broadcast_to(np.where(seen, 0.0, MASKED), t.shape).astype(t.dtype)
        return masks


def rung(specs: dict, ladder: list[int], function: str, inputs: dict[str, np.ndarray]) -> str:
    """The entry of ``function`` among ``specs`` a host with ``ladder`` calls for ``inputs``: the one at the smallest
    context whose history holds the call's rows (its first position plus its width at most the context), else
    ``function`` itself."""
    if not ladder or POSITION_IDS not in inputs:
        return function
    first, width = int(np.asarray(inputs[POSITION_IDS]).reshape(-1)[0]), specs[function].width
    return next((rung_name(function, c) for c in ladder if rung_name(function, c) in specs and first + width <= c),
                function)


POSITION_INPUTS = frozenset({ROPE_COS, ROPE_SIN, HISTORY_MASK})  # what the host computes from position_ids


def write(buffer, rows, rule: dict, where: np.ndarray | None) -> None:
    """A call's ``rows`` into a host ``buffer`` by its contract ``rule`` (``manifests.schema.HostBuffer``): at the
    call's positions ``where`` (or their ring slots), at the leading rows, or the whole buffer. Both numpy arrays, or
    both torch tensors on one device (``HostOwned.on``)."""
    mode, axis = rule.get("write", "positions"), rule["axis"]
    if mode == "whole":
        buffer[...] = rows
        return
    slots = np.arange(rows.shape[axis]) if mode == "leading" else where % rule["ring"] if rule.get("ring") else where
    kept = slots < buffer.shape[axis]  # a padding row past the buffer is never read
    index = [slice(None)] * buffer.ndim
    if isinstance(buffer, torch.Tensor):
        index[axis] = torch.as_tensor(slots[kept], device=buffer.device)
        taken = torch.as_tensor(np.flatnonzero(kept), device=rows.device)
        buffer[tuple(index)] = rows.index_select(axis, taken).to(buffer.dtype)  # cast as numpy casts
        return
    index[axis] = slots[kept]
    buffer[tuple(index)] = np.compress(kept, rows, axis=axis)


def commit_inputs(spec, names: dict, count: int) -> dict[str, np.ndarray]:
    """The ``mask`` and ``select`` inputs (``manifests.schema.HostCommit``) of a commit of ``count`` rows, in the
    function's shapes and dtypes: the mask [1, R] (1 below ``count``), the one-hot rows ``count .. count+K-2`` of a
    [history (K-1) | R rows] window."""
    taken = {t.name: t for t in spec.inputs}
    mask, select = taken[names["mask"]], taken[names["select"]]
    rows, (history, window) = mask.shape[1], select.shape
    one_hot = np.zeros((history, window), dtype=select.dtype)
    one_hot[np.arange(history), count + np.arange(history)] = 1
    return {mask.name: (np.arange(rows) < count).astype(mask.dtype)[None], select.name: one_hot}


# the inputs the host computes for a package, by the caller's input each comes from (``convert.runtime.chain``
# passes a part the sources of those it takes)
DERIVED_INPUTS = {**dict.fromkeys(POSITION_INPUTS, POSITION_IDS), COMMIT_MASK: ACCEPT,
                  COMMIT_SELECT: ACCEPT, VALID_MASK: VALID, VALID_SELECT: VALID}


def host_owned(functions: Functions, specs: dict, contract: dict, lookup=None,
               split_head: tuple[int, int] | None = None, codebooks=None, on: torch.device | None = None) -> Functions:
    """``functions`` (one package's, with ``specs``) as a runtime drives them under the target's (or drafter's)
    ``contract``: with what the host owns of them (``HostOwned``: buffers, position inputs, the embedding lookup, the
    argmax, a ring's masks, a selector's walk), else themselves (a package with states, or a part of one). ``on``:
    ``HostOwned``'s."""
    owned = HostOwned(functions, specs, contract, lookup, split_head, codebooks, on)
    host_argmax = owned.argmax and any(t.name == LOGITS for spec in specs.values() for t in spec.outputs)
    served = owned.rules or owned.positions or owned.embedded or owned.commits or owned.ring_masks or \
        owned.selector or owned.logits_parts
    return owned if served or host_argmax else functions


def table_lookup(table):
    """The lookup of ``ids`` in a table of rows read a row at a time: an array, or a bundle's embeddings.safetensors
    opened lazily (``safe_open(...).get_slice``: a 27B table is 2.4 GiB, a call reads S rows of it)."""
    return lambda ids: np.concatenate([table[i : i + 1] for i in ids.tolist()])


def module_lookup(core):
    """The lookup of ``ids`` in a core's ``embed_tokens`` (None without one): the rows as the bundle's
    embeddings.safetensors holds them (``export.quantized.embedding_rows``), in the table's dtype."""
    table = getattr(core, "embed_tokens", None)
    if table is None:
        return None
    return lambda ids: torch.cat([embedding_rows(table, i, i + 1) for i in ids.tolist()]).cpu().numpy()


def module_codebooks(core):
    """A DFlash2 core's selector codebook lookups (predecessor, successor; None without a selector), as the bundle's
    selector.safetensors holds them."""
    selector = getattr(core, "candidate_selector", None)
    if selector is None:
        return None
    return tuple(table_lookup(table.detach().cpu().numpy())
                 for table in (selector.predecessor_codebook, selector.successor_codebook))


def owned_as_modules(functions: Functions, specs: dict, modules, on: torch.device | None = None) -> Functions:
    """``host_owned`` for the package (or the torch calls) of export ``modules``: their contract, the lookup in their
    core's table, their part's split head, a DFlash2 core's codebooks; ``on``: ``HostOwned``'s."""
    part = getattr(modules.core, "part", None)  # a drafter's core has none
    split = part.head if part is not None and part.splits_head else None
    return host_owned(functions, specs, modules.contract, module_lookup(modules.core), split,
                      module_codebooks(modules.core), on)


class ModuleFunctions:
    """``Functions`` over target export modules (numpy in and out; every core output, logits included), with what the
    host owns where the modules' contract says so (``host_owned``: the lookup in the core's own table, the head's
    first row from its part). Modules on an accelerator keep the host's buffers there as tensors (``HostOwned.on``),
    each call's rows for them written there: in the ane layout a call's history (at a 27B's 8,192 rows about 34 MB
    a full-attention layer) would otherwise travel to the accelerator and its rows back at every call."""

    def __init__(self, modules, tensors: bool | None = None):
        """``tensors``: whether the buffers are tensors where the modules compute (default: on an accelerator)."""
        self.modules = modules
        specs = {name: spec for name, (_, spec) in modules.functions.items()}
        where = torch_device_of(modules.core)
        calls = _ModuleCalls(modules)
        tensors = where.type != "cpu" if tensors is None else tensors
        self.driven = owned_as_modules(calls, specs, modules, where if tensors else None)
        if isinstance(self.driven, HostOwned) and self.driven.on is not None:
            calls.held = {rule["rows"] for rule in self.driven.rules.values()}

    def reset(self) -> None:
        self.driven.reset()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.driven.call(function, inputs)

    def states(self) -> dict[str, np.ndarray]:
        return self.driven.states()

    def host_buffers(self) -> dict[str, np.ndarray]:
        """The host's buffers themselves (the ane layout's; none for modules with states)."""
        return self.driven.buffers if isinstance(self.driven, HostOwned) else {}


class DeviceFunctions:
    """``Functions`` whose every call computes in ``device``'s arithmetic (``convert.fp16.device_arithmetic``: fp16
    modules as the ANE or the GPU computes them; None: torch's own, watched), noting ``peaks`` when given: a pair whose
    target and drafter run on different devices enters each one's arithmetic call by call, and a range watches one
    of the pair's calls alone."""

    def __init__(self, functions, device: str | None, peaks=None):
        self.functions, self.device, self.peaks = functions, device, peaks

    def reset(self) -> None:
        self.functions.reset()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad(), device_arithmetic(self.device, self.peaks):
            return self.functions.call(function, inputs)

    def states(self) -> dict[str, np.ndarray]:
        return self.functions.states()


class _ModuleCalls:
    """The modules' own calls and states, in numpy (``ModuleFunctions`` adds the host's buffers)."""

    def __init__(self, modules):
        self.modules = modules
        self.held: set[str] = set()  # outputs returned as the tensors they are (the rows of buffers held beside them)

    def reset(self) -> None:
        self.modules.reset()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.modules.call(function, **inputs)
        return {**numpy_outputs({k: v for k, v in out.items() if k not in self.held}),
                **{k: v for k, v in out.items() if k in self.held}}

    def states(self) -> dict[str, np.ndarray]:
        return numpy_outputs(self.modules.states())


def numpy_outputs(out: dict) -> dict[str, np.ndarray]:
    return {k: (v.float() if v.is_floating_point() else v).cpu().numpy() for k, v in out.items()}


def module_driver(modules) -> TargetDriver:
    """A driver over target export modules (``TargetModules``), with their contract."""
    return TargetDriver(ModuleFunctions(modules), modules.widths, modules.contract)
