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

A call's rows are right-padded to the function's width with the last token at positions continuing past the real
rows (never the same position twice: on a hybrid target a padding row computes something else than the real row
at its position, and both would write that attention row).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from convert.errors import InputError

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
        inputs = {"input_ids": padded(tokens, width), "position_ids": positions(p0, width)}
        if not self.commits:
            return inputs
        accept = p0 - self.committed
        if not 0 <= accept <= self.pending:
            kept = f"{self.committed}..{self.committed + self.pending}"
            raise HostContractError(
                f"{function} at position {p0}: the next call must start at a position in {kept} (the previous call "
                "left its rows pending from its first position; earlier rows are committed and cannot be rolled back)")
        inputs["accept"] = np.asarray([accept], dtype=np.int32)
        if function in self.lazy:
            self.committed, self.pending = p0, real
        else:
            inputs["valid"] = np.asarray([real], dtype=np.int32)
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
        ids, logits = [int(out["argmax_ids"][-1])], [out.get("logits", [None])[-1]]
        while len(ids) < tokens:
            step = self.run("decode", [ids[-1]], len(prompt) + len(ids) - 1)
            ids.append(int(step["argmax_ids"][0]))
            logits.append(step["logits"][0] if "logits" in step else None)
        return ids, logits


class ModuleFunctions:
    """``Functions`` over target export modules (numpy in and out; every core output, logits included)."""

    def __init__(self, modules):
        self.modules = modules

    def reset(self) -> None:
        self.modules.reset()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.numpy(self.modules.call(function, **inputs))

    def states(self) -> dict[str, np.ndarray]:
        return self.numpy(self.modules.states())

    @staticmethod
    def numpy(out: dict) -> dict[str, np.ndarray]:
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in out.items()}


def module_driver(modules) -> TargetDriver:
    """A driver over target export modules (``TargetModules``), with their contract."""
    return TargetDriver(ModuleFunctions(modules), modules.widths, modules.contract)
