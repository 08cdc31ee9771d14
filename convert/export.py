"""Static-shape entrypoints over one shared core module.

Every function of a package (prefill, decode, verify ...) is a ``FunctionModule``: the same core
(same parameter tensors, so a package stores the weights once) called at one static width. The KV
buffers are registered on the function module itself, under the state names of its
``FunctionSpec``, and the same tensor objects are shared by all functions of a part, so in torch a
prefill call followed by decode calls carries the cache exactly as a runtime carries package states.
"""

from __future__ import annotations

import torch
from torch import nn

from convert.backends.base import FunctionSpec


class FunctionModule(nn.Module):
    def __init__(self, core: nn.Module, spec: FunctionSpec, states: dict[str, torch.Tensor]):
        super().__init__()
        self.core = core
        self.spec = spec
        for state in spec.states:
            self.register_buffer(state.name, states[state.name], persistent=False)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state_tensors = [getattr(self, s.name) for s in self.spec.states]
        produced = self.core(*inputs, *state_tensors)
        return tuple(produced[o.name] for o in self.spec.outputs)
