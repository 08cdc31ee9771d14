"""DFlash2: the functions' specs (context_update, context_append, draft over a shared ring) and the export modules
over one core."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert.errors import InputError
from convert.export.ane import logits_specs, split_head
from convert.export.functions import ExportModules, FunctionModule, parameters_on_meta
from convert.export.names import (
    ANCHOR_EMBEDDING,
    ANCHOR_ID,
    DRAFT_IDS,
    LOGITS,
    POSITION_IDS,
    RING_KEYS,
    RING_LAPS,
    RING_VALUES,
    ROPE_COS,
    ROPE_SIN,
    TAPS,
)
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.dflash2.ane import PROJECTED, RING, DFlash2AneCore, host_contract, ring_mask_name
from convert.models.dflash2.config import DFlash2Args
from convert.models.dflash2.core import DFlash2Core
from convert.models.part import drafter_head_ranges, stream_norms
from convert.models.qwen3.core import RESIDUAL_WRITERS


class DrafterFunction(FunctionModule):
    """A FunctionModule that calls one entry of the shared core (``context`` or ``draft``) with its inputs and states
    by name; the core is stored under ``core`` in every function, so parameter names (and the package's weights) are
    shared."""

    def __init__(self, core: DFlash2Core, spec: FunctionSpec, states: dict[str, torch.Tensor], entry: str):
        super().__init__(core, spec, states)
        self.entry = entry

    def produce(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        named = {t.name: value for t, value in zip(self.spec.inputs, inputs, strict=True)}
        return getattr(self.core, self.entry)(**named, **{s.name: getattr(self, s.name) for s in self.spec.states})


ENTRIES = {"context_update": "context", "context_append": "context", "draft": "draft"}


def function_specs(args: DFlash2Args, update_width: int = 64, append_width: int = 8, ring_rows: int = 2048,
                   dtype: torch.dtype = torch.float16, draft_width: int | None = None,
                   logits: bool = False, layout: str = "stateful",
                   head_ranges: list[tuple[int, int]] | None = None) -> list[FunctionSpec]:
    """context_update / context_append (write context rows into the ring) and draft, sharing the ring states; in the
    ane layout (``convert/models/dflash2/ane.py``) over the host's ring instead, its logits in ``head_ranges``
    (``drafter_head_ranges``)."""
    draft_width = draft_width or args.block_size
    if not 2 <= draft_width <= args.block_size:
        raise InputError(f"draft width {draft_width} must be in 2..block_size ({args.block_size})")
    if ring_rows < max(update_width, append_width):
        raise InputError(f"ring rows {ring_rows} must hold one context chunk ({max(update_width, append_width)} rows)")
    if layout == "ane":
        return _ane_specs(args, update_width, append_width, ring_rows, DTYPE_NAMES[dtype], draft_width,
                          drafter_head_ranges(args.vocab_size, head_ranges))
    fdtype = DTYPE_NAMES[dtype]
    ring = (args.num_hidden_layers, args.num_key_value_heads, ring_rows, args.head_dim)
    states = (TensorSpec(RING_KEYS, ring, fdtype), TensorSpec(RING_VALUES, ring, fdtype),
              TensorSpec(RING_LAPS, (1, ring_rows), fdtype))
    specs = []
    for name, width in (("context_update", update_width), ("context_append", append_width)):
        inputs = (TensorSpec(TAPS, (1, width, args.feature_size), fdtype),
                  TensorSpec(POSITION_IDS, (1, width), "int32"))
        specs.append(FunctionSpec(name, inputs, (TensorSpec("written", (1, width), "int32"),), states))
    inputs = (TensorSpec(ANCHOR_EMBEDDING, (1, 1, args.hidden_size), fdtype),
              TensorSpec(ANCHOR_ID, (1, 1), "int32"),
              TensorSpec(POSITION_IDS, (1, draft_width), "int32"))
    outputs = [TensorSpec(DRAFT_IDS, (1, draft_width - 1), "int32")]
    if logits:
        outputs.append(TensorSpec(LOGITS, (1, draft_width - 1, args.vocab_size), fdtype))
    specs.append(FunctionSpec("draft", inputs, tuple(outputs), states))
    return specs


def _ane_specs(args: DFlash2Args, update_width: int, append_width: int, ring_rows: int, fdtype: str,
               draft_width: int, head_ranges: list[tuple[int, int]]) -> list[FunctionSpec]:
    ring = (args.num_hidden_layers, args.num_key_value_heads, ring_rows, args.head_dim)

    def rope(width: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec(ROPE_COS, (width, args.head_dim // 2), fdtype),
                TensorSpec(ROPE_SIN, (width, args.head_dim // 2), fdtype))

    specs = []
    for name, width in (("context_update", update_width), ("context_append", append_width)):
        rows = (args.num_hidden_layers, args.num_key_value_heads, width, args.head_dim)
        specs.append(FunctionSpec(name, (TensorSpec(TAPS, (1, width, args.feature_size), fdtype), *rope(width)),
                                  tuple(TensorSpec(out, rows, fdtype) for out in RING.values()), ()))
    masks = tuple(TensorSpec(ring_mask_name(w), (ring_rows, draft_width), fdtype)
                  for w in dict.fromkeys(args.layer_windows))
    inputs = (TensorSpec(ANCHOR_EMBEDDING, (1, 1, args.hidden_size), fdtype), *rope(draft_width),
              *(TensorSpec(buffer, ring, fdtype) for buffer in RING), *masks)
    outputs = logits_specs(head_ranges, draft_width - 1, fdtype)
    if args.has_selector:
        outputs.append(TensorSpec(PROJECTED, (1, draft_width - 1, args.selector_rank), fdtype))
    specs.append(FunctionSpec("draft", inputs, tuple(outputs), ()))
    return specs


@dataclass
class DrafterModules(ExportModules):
    core: DFlash2Core

    def call(self, name: str, **inputs) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states with inputs by name (``call_with``); returns every
        core output (``logits`` and ``selector_scores`` included)."""
        return self.call_with(name, inputs)


def build_modules(args: DFlash2Args, tensors: dict[str, torch.Tensor], lm_head_weight: torch.Tensor,
                  mask_embedding: torch.Tensor, dtype: torch.dtype, max_positions: int, ring_rows: int = 2048,
                  update_width: int = 64, append_width: int = 8, mask_scale: float = 1.0,
                  draft_width: int | None = None, logits: bool = False, layout: str = "stateful",
                  head_ranges: list[tuple[int, int]] | None = None, residual_scale: float = 1.0,
                  taps_scale: float = 1.0) -> DrafterModules:
    """Export modules in ``dtype`` over one core (drafter ``tensors`` by canonical key, each taken out of the dict as
    it is set; the target's ``lm_head`` weight [vocab, H], shared when it is in ``dtype``, and raw mask row [H], scaled
    here by ``mask_scale``) and one set of ring states (none in the ane ``layout``: the host's ring).

    ``max_positions`` sizes the fp32 RoPE tables: context rows and block anchors must sit below it (a block
    starting at ``max_positions - 1`` still fits). ``logits`` adds the [1, S-1, vocab] logits output to ``draft``.
    In the ane layout the lm_head is computed in ``head_ranges`` (``drafter_head_ranges``: ``RowParts`` past the
    ANE's largest dim).

    ``residual_scale``: the range scale of the drafter's residual stream (``convert/weights/rescale.py``; its
    target's, whose embedding rows it starts from, times its own): the anchor row times it in the graph, the mask row
    and every draft layer's ``o_proj`` and ``down_proj`` times it (in fp32, before the cast), ``fc`` times it over
    ``taps_scale`` (the target's taps arrive times that), and the eps of every norm that reads the stream or the fc
    (``hidden_norm``) times its square.
    """
    for name, tensor, shape in (("lm_head weight", lm_head_weight, (args.vocab_size, args.hidden_size)),
                                ("mask embedding row", mask_embedding, (args.hidden_size,))):
        if tuple(tensor.shape) != shape:
            raise InputError(f"the target's {name} is {list(tensor.shape)}; this drafter needs {list(shape)}")
    head_ranges = drafter_head_ranges(args.vocab_size, head_ranges)
    specs = function_specs(args, update_width, append_width, ring_rows, dtype, draft_width, logits, layout,
                           head_ranges)
    # the parameters on meta until the checkpoint's fill them (no core made in fp32 first); the fp32 RoPE tables are
    # cast with the core: the same values as a lookup in fp32 followed by the cast
    with parameters_on_meta():
        core = (DFlash2AneCore if layout == "ane" else DFlash2Core)(args, ring_rows, max_positions, draft_width)
    core = core.to(dtype).eval()
    if residual_scale != 1:
        writers = [f"layers.{i}.{w}.weight" for i in range(args.num_hidden_layers) for w in RESIDUAL_WRITERS]
        for key in writers:
            tensors[key] = tensors[key].float() * residual_scale
        if residual_scale != taps_scale:
            tensors["fc.weight"] = tensors["fc.weight"].float() * (residual_scale / taps_scale)
        mask_embedding = mask_embedding.float() * residual_scale
        core.residual_scale = residual_scale
        for norm in [core.hidden_norm, *stream_norms(core)]:
            norm.eps *= residual_scale**2
    core.load_weights(tensors)
    core.set_target(lm_head_weight, mask_embedding, mask_scale)
    if layout == "ane":
        split_head(core, head_ranges)
    for p in core.parameters():
        p.requires_grad_(False)
    states = {s.name: torch.zeros(s.shape, dtype=dtype) for s in specs[0].states}
    functions = {s.name: (DrafterFunction(core, s, states, ENTRIES[s.name]), s) for s in specs}
    contract = host_contract(args, ring_rows, head_ranges) if layout == "ane" else {}
    return DrafterModules(core=core, functions=functions, contract=contract)
