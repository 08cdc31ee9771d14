"""Layer-by-layer access to a checkpoint for the streamed stages: a target core whose parameters take no memory
until a stage fills one module of it (a decoder layer, the head) from the checkpoint, and frees it again.

The values are the shipped core's computing copy, bit for bit: each tensor cast to the shipping dtype (fp16) and
then to the work dtype (fp32), the core's buffers (RoPE tables, masks) likewise, as ``copy.deepcopy(core).float()``
of the fp16 modules would hold them. Peak memory is one module's weights, whatever the model's size.
"""

from __future__ import annotations

import torch
from torch import nn

from convert.export.functions import META, parameters_on_meta, set_parameter
from convert.inputs.checkpoint import Reader
from convert.models import family_of
from convert.models.layout import Layout
from convert.weights import precision


def skeleton(args, target, ship_dtype: torch.dtype, work_dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The family's export core with every parameter on meta and its buffers as the shipped core's, in
    ``work_dtype`` on ``device``; the parameters ``precision.kept_fp32_names`` names in fp32 (``Streamer`` fills them
    uncast)."""
    with parameters_on_meta():
        core = family_of(args).build_core(args, target)
    core = core.to(ship_dtype).to(work_dtype)
    precision.keep_fp32(core, target)
    for module in core.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return core.eval()


def checkpoint_key(core: nn.Module, name: str) -> str:
    """The canonical (causal LM) key of core parameter ``name``; a tied lm_head reads the embedding's."""
    if name == "lm_head.weight" and core.args.tie_word_embeddings:
        name = "embed_tokens.weight"
    return name if name.startswith("lm_head") else "model." + name


class Streamer:
    """Fills and frees the modules of a ``skeleton`` core from a checkpoint stored under ``layout``."""

    def __init__(self, core: nn.Module, reader: Reader, layout: Layout, ship_dtype: torch.dtype,
                 work_dtype: torch.dtype, device: torch.device | str, factors: dict[str, float] | None = None):
        """``factors``: core parameter name -> what it is multiplied by as read (``rescale.weight_factors``)."""
        self.core, self.reader, self.layout = core, reader, layout
        self.ship_dtype, self.work_dtype, self.device = ship_dtype, work_dtype, torch.device(device)
        self.factors = factors or {}

    def tensor(self, name: str) -> torch.Tensor:
        """Core parameter ``name`` as the shipped core's computing copy holds it, on the device."""
        return self._cast(self.reader.get(self.layout.stored(checkpoint_key(self.core, name))), name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of core parameter ``name`` (a large table read in chunks), as ``tensor`` gives them."""
        return self._cast(self.reader.rows(self.layout.stored(checkpoint_key(self.core, name)), start, stop), name)

    def _cast(self, stored: torch.Tensor, name: str) -> torch.Tensor:
        """To the device first, then cast (the same values either way): the host holds only the stored bytes. A
        factor is applied in fp32 before the cast; a parameter the core keeps in fp32 (``precision.kept``) is only
        made fp32."""
        factor = self.factors.get(name, 1.0)
        stored = stored.to(self.device)
        if factor != 1:
            stored = stored.float() * factor
        if name in precision.kept(self.core):
            return stored.float()
        return stored.to(self.ship_dtype).to(self.work_dtype)

    def fill(self, prefix: str, skip: frozenset[str] = frozenset()) -> nn.Module:
        """Give every parameter under module ``prefix`` (e.g. ``layers.3``, ``lm_head``) its checkpoint values, but
        those named in ``skip`` (core names: weights about to be replaced by quantized ones)."""
        module = self.core.get_submodule(prefix)
        for name, param in module.named_parameters():
            if f"{prefix}.{name}" in skip:
                continue
            value = self.tensor(f"{prefix}.{name}")  # a fresh tensor (cast from the stored one)
            if value.shape != param.shape:
                raise ValueError(f"{prefix}.{name}: checkpoint shape {list(value.shape)}, core {list(param.shape)}")
            set_parameter(module, name, value)
        return module

    def free(self, prefix: str) -> None:
        """Put the parameters under module ``prefix`` back on meta (their memory is released)."""
        module = self.core.get_submodule(prefix)
        for name, param in list(module.named_parameters()):
            set_parameter(module, name, torch.empty(param.shape, dtype=param.dtype, device=META))
        release_free_memory()


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): a streamed stage frees a unit's
    tensors of similar sizes again and again, and without this the heap's free space grows with the unit count
    (about 2 MB per layer on the 32-layer test model, measured)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()
