"""A part of a target (its embedding rows, decoder layers, head rows) and the ends of a family's core that a part
changes: where its rows come from, what it returns, and its tensors' specs. The families build their cores with
these; how a target is cut into parts is ``convert/pipeline/partition.py``'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from convert.export.ane import logits_ranges, pointwise, rms_norm, rows_of
from convert.export.names import ARGMAX_IDS, HIDDEN, HIDDEN_STATES, INPUT_IDS, LOGITS, MAX_LOGIT, POSITION_IDS, TAPS
from convert.export.spec import FunctionSpec, TensorSpec

HIDDEN_OUT = "hidden_states_out"  # a part's rows for the next part (Core ML refuses one name for an input and output)
KEPT_FP32 = "kept_fp32"  # the names of a core's parameters kept in fp32 among fp16 ones (convert/weights/precision.py)


ROW_ALIGN = 64  # vocabulary splits fall on multiples of this many rows (and of a lut4 table's rows)


@dataclass(frozen=True)
class Part:
    """One package of a target: the vocabulary rows of the embedding it looks up, the decoder layers ``first ..
    end-1`` it runs, the vocabulary rows of the head it computes (None / an empty range: not this part's)."""

    name: str
    vocab: int
    embedding: tuple[int, int] | None = None
    layers: tuple[int, int] = (0, 0)
    head: tuple[int, int] | None = None

    @classmethod
    def whole(cls, args) -> Part:
        v = args.vocab_size
        return cls("model", v, (0, v), (0, args.num_hidden_layers), (0, v))

    @property
    def layer_indices(self) -> range:
        return range(*self.layers)

    @property
    def takes_hidden(self) -> bool:
        """Whether the part reads the rows the previous part returns (every part but the first)."""
        return self.embedding is None or self.embedding[0] > 0

    @property
    def splits_head(self) -> bool:
        return self.head is not None and self.head != (0, self.vocab)

    @property
    def is_whole(self) -> bool:
        return self.embedding == (0, self.vocab) == self.head

    def own_taps(self, taps) -> tuple[int, ...]:
        """The tapped layers this part runs, in the recipe's order."""
        return tuple(t for t in taps or () if t in self.layer_indices)

    @classmethod
    def from_record(cls, record, vocab: int) -> Part:
        """The part a manifest's ``parts`` entry describes."""
        def rows(value):
            return tuple(value) if value is not None else None

        return cls(record.name, vocab, rows(record.embedding_rows), tuple(record.layers), rows(record.head_rows))

    def record(self, taps) -> dict:
        """The manifest's description of the part (besides its functions and packages)."""
        return {"name": self.name, "embedding_rows": list(self.embedding) if self.embedding else None,
                "layers": list(self.layers), "head_rows": list(self.head) if self.head else None,
                "taps": list(self.own_taps(taps))}


def build_embedding(core: nn.Module, args) -> None:
    """The part's embedding rows as ``core.embed_tokens`` (none without an embedding), and ``core.residual_scale``
    (1): what the rows are multiplied by as they enter the layers (``convert/weights/rescale.py``)."""
    part = core.part
    core.residual_scale = 1.0
    if part.embedding is not None:
        core.embed_tokens = nn.Embedding(part.embedding[1] - part.embedding[0], args.hidden_size)


def build_head(core: nn.Module, args, norm: type[nn.Module]) -> None:
    """The part's final ``norm`` and lm_head rows (tied to the embedding when the config ties them and the part
    holds both whole)."""
    part = core.part
    if part.head is None:
        return
    core.norm = norm(args.hidden_size, args.rms_norm_eps)
    core.lm_head = nn.Linear(args.hidden_size, part.head[1] - part.head[0], bias=False)
    if args.tie_word_embeddings and part.embedding == part.head == (0, part.vocab):
        core.lm_head.weight = core.embed_tokens.weight


def stream_norms(core: nn.Module) -> list[nn.Module]:
    """The norms that read ``core``'s residual stream: each decoder layer's own (its children with an ``eps`` and a
    ``gain``: the input and post-attention norms) and the final norm where the core has one. A range scale of the
    stream multiplies their eps by its square (``convert/weights/rescale.py``)."""
    norms = [m for layer in core.layers for m in layer.children() if hasattr(m, "eps") and hasattr(m, "gain")]
    final = getattr(core, "norm", None)
    return norms if final is None else [*norms, final]


def core_dtype(core: nn.Module) -> torch.dtype:
    """The dtype a core computes its rows in: its parameters', but those it keeps in fp32 (``KEPT_FP32``: an exact
    pack's norms in an fp16 core, which compute in fp32 and return the rows' dtype); a core of a table held as its
    codes alone (an embedding piece of a lean target): the dtype its rows are computed in."""
    kept = getattr(core, KEPT_FP32, frozenset())
    own = next((p.dtype for name, p in core.named_parameters() if name not in kept), None)
    if own is None:
        own = next((m.compute_dtype for m in core.modules() if hasattr(m, "compute_dtype")), None)
    return own if own is not None else next(core.parameters()).dtype


def part_input(core: nn.Module, input_ids, hidden_states) -> torch.Tensor:
    """The rows [S, H] a part's layers start from: its embedding rows of ``input_ids`` (zero for ids outside them)
    added to the previous part's ``hidden_states``, or those rows alone."""
    part = core.part
    if hidden_states is not None:  # in the core's dtype: a tracing copy computes in fp32 on the fp16 rows given
        hidden_states = hidden_states.to(core_dtype(core))
    if part.embedding is None:
        return hidden_states[0]
    ids = input_ids[0].long()
    lo, hi = part.embedding
    if (lo, hi) == (0, part.vocab):
        x = core.embed_tokens(ids)
    else:
        rows = core.embed_tokens((ids - lo).clamp(0, hi - lo - 1))
        x = torch.where(((ids >= lo) & (ids < hi))[:, None], rows, torch.zeros_like(rows))
    if core.residual_scale != 1:
        x = x * core.residual_scale
    return x if hidden_states is None else hidden_states[0] + x


def part_outputs(core: nn.Module, x: torch.Tensor, tapped: list) -> dict[str, torch.Tensor]:
    """Every output a part's function may expose, from its last layer's rows ``x`` [S, H] and the ``tapped``
    (index among the part's taps, layer output) pairs: with the head, argmax ids (and the best logit when the head is
    split), logits and the final-norm hidden states; without it the rows for the next part; and the taps."""
    out = _rows_outputs(core.part, x, tapped)
    if core.part.head is None:
        return out
    hidden = core.norm(x)[None]
    logits = core.lm_head(hidden)
    ids = logits.argmax(-1)
    if core.part.splits_head:
        out[MAX_LOGIT] = logits.amax(-1)
        ids = ids + core.part.head[0]
    return {**out, ARGMAX_IDS: ids.to(torch.int32), LOGITS: logits, HIDDEN: hidden}


def host_tables(core: nn.Module) -> tuple[str, ...]:
    """The modules and parameters of ``core`` (by name) whose weights its functions never read, only the host: an ane
    core's embedding table (``host_lookup``: only the host looks rows up in it) unless the head is tied to it, and the
    parameters it names in ``host_parameters`` (an ane DFlash2 core's selector codebooks). The package checks leave
    them out."""
    own = tuple(getattr(core, "host_parameters", ()))
    table = getattr(core, "embed_tokens", None)
    if not getattr(core, "host_lookup", False) or table is None:
        return own
    head = getattr(core, "lm_head", None)
    if head is not None and any(p is q for p in table.parameters() for q in head.parameters()):
        return own
    return ("embed_tokens", *own)


def host_rows(core: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The rows [S, H] an ane part's layers start from: ``hidden_states`` [1, S, H] as given (the host's embedding
    lookup for the first part, the previous part's rows for the others), in the core's dtype."""
    rows = hidden_states[0].to(core_dtype(core))
    return rows * core.residual_scale if core.part.embedding is not None and core.residual_scale != 1 else rows


def ane_outputs(core: nn.Module, x: torch.Tensor, tapped: list) -> dict[str, torch.Tensor]:
    """``part_outputs`` in the ane layout: ``x`` and the tapped rows channels first [1, H, 1, S], the final norm over
    the channels and the lm_head a 1x1 convolution (``convert/export/ane.py``); the outputs in ``part_outputs``'
    shapes, but the head returns logits and no argmax (the host takes it: ``convert.runtime.host.HostOwned``)."""
    out = _rows_outputs(core.part, rows_of(x), [(i, rows_of(t)) for i, t in tapped])
    if core.part.head is None:
        return out
    hidden = rms_norm(core.norm, x)
    return {**out, LOGITS: rows_of(pointwise(core.lm_head, hidden))[None], HIDDEN: rows_of(hidden)[None]}


def _rows_outputs(part: Part, x: torch.Tensor, tapped: list) -> dict[str, torch.Tensor]:
    """The taps (concatenated in the recipe's order) and, without the head, the rows ``x`` [S, H] for the next part."""
    out = {}
    if tapped:
        out[TAPS] = torch.cat([t for _, t in sorted(tapped, key=lambda p: p[0])], dim=-1)[None]
    if part.head is None:
        out[HIDDEN_OUT] = x[None]
    return out




def part_tensors(args, target, part: Part, width: int, dtype: str) -> tuple[tuple[TensorSpec, ...], tuple]:
    """The inputs and outputs every family's function of ``part`` has at ``width`` (the family adds its own inputs,
    e.g. a hybrid's ``accept`` / ``valid``). The whole target's: ``input_ids``, ``position_ids`` in; ``argmax_ids``
    [1,S] int32 (the host reads the row of its last real token, so a prompt's final chunk may be right-padded), then
    ``taps``, ``hidden`` and ``logits`` when the recipe asks for them. In the ane layout the host looks the embedding
    rows up (the part holding the table takes them as ``hidden_states``) and takes the argmax of the ``logits`` the
    head always returns."""
    h, ane = args.hidden_size, target.layout == "ane"
    inputs = []
    if part.embedding is not None and not ane:
        inputs.append(TensorSpec(INPUT_IDS, (1, width), "int32"))
    if part.takes_hidden or ane:
        inputs.append(TensorSpec(HIDDEN_STATES, (1, width, h), dtype))
    if part.layer_indices:
        inputs.append(TensorSpec(POSITION_IDS, (1, width), "int32"))
    outputs = []
    if part.head is not None and not ane:
        outputs.append(TensorSpec(ARGMAX_IDS, (1, width), "int32"))
        if part.splits_head:
            outputs.append(TensorSpec(MAX_LOGIT, (1, width), dtype))
    elif part.head is None:
        outputs.append(TensorSpec(HIDDEN_OUT, (1, width, h), dtype))
    taps = part.own_taps(target.taps)
    if taps:
        outputs.append(TensorSpec(TAPS, (1, width, len(taps) * h), dtype))
    if part.head is not None and target.hidden and part.head[0] == 0:
        outputs.append(TensorSpec(HIDDEN, (1, width, h), dtype))
    if part.head is not None and (target.logits or ane):
        outputs.append(TensorSpec(LOGITS, (1, width, part.head[1] - part.head[0]), dtype))
    return tuple(inputs), tuple(outputs)


def with_ladder(target, specs_at) -> list[FunctionSpec]:
    """The functions at ``target.context`` and, for each context of its ladder (the ane layout's), the same functions
    at that context named ``<function>_<context>`` (``specs_at(target)``: a family's specs at a target's context);
    a function whose shapes do not depend on the context (a part without attention layers) is not repeated."""
    specs = specs_at(target)
    for rung in target.ladder:
        smaller = specs_at(target.model_copy(update={"context": rung, "ladder": []}))
        specs += [dataclasses.replace(s, name=rung_name(s.name, rung))
                  for s, top in zip(smaller, specs, strict=False) if s != top]
    return specs


def rung_name(function: str, context: int) -> str:
    return f"{function}_{context}"


def function_widths(target) -> tuple[tuple[str, int], ...]:
    return (("prefill", target.graphs.prefill), ("decode", 1), ("verify", target.graphs.verify))


def drafter_head_ranges(vocab: int, ranges: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The vocabulary rows of an ane drafter's logits outputs: ``ranges`` as given (the pipeline's, on whole lut4
    tables of the target's head), else ``logits_ranges`` on ``ROW_ALIGN`` rows."""
    return [tuple(r) for r in ranges] if ranges else logits_ranges(vocab, ROW_ALIGN)

