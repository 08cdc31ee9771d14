"""Where a checkpoint keeps the target's tensors (its key prefix) and which of its tensor groups are not the
target's: what a family's ``sanitize`` returns and every reader of the checkpoint uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """How a checkpoint stores the target: its text model's key prefix, and the tensor groups that are not the
    target's (a vision tower, an MTP head), counted."""

    prefix: str = "model."  # "model." (a causal LM) or "model.language_model." (a vision-language checkpoint)
    ignored: tuple[tuple[str, int], ...] = ()  # (what, tensor count)

    def canonical(self, key: str) -> str:
        """The key under the causal LM's naming (``model.*``, ``lm_head.weight``)."""
        return "model." + key.removeprefix(self.prefix) if key.startswith(self.prefix) else key

    def stored(self, canonical: str) -> str:
        """The checkpoint key of a canonical one."""
        return self.prefix + canonical.removeprefix("model.") if canonical.startswith("model.") else canonical

    def notes(self) -> list[str]:
        return [f"{what}: {count} tensors, not shipped with the target" for what, count in self.ignored]
