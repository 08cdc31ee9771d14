"""The gate's fp32 reference, streamed: transformers' arithmetic with one decoder layer's weights in memory at a time.

``gates.load_reference`` loads the whole transformers model in fp32, which at 27B is 108 GB, more than a host holds.
This computes what ``gates._reference_window`` computes on it (a forward over each window with the cache on, the
tapped decoder layers' outputs, then one forward of the candidate's greedy continuation on that cache), with
transformers' own modules and functions (its embedding, rotary embedding, mask functions, cache classes, decoder
layers, final norm and lm_head) on the text causal LM built with its parameters on the meta device. Only the loop
over the layers is ours: it runs layer-major, every window through layer i before layer i+1 is read from the
checkpoint (cast to fp32, as ``from_pretrained(dtype=float32)`` does) and layer i freed again. The preamble of each
pass (positions from the cache, masks, rotary tables) replicates ``Qwen3Model.forward`` and
``Qwen3_5TextModel.forward`` of transformers 5.24, calling their functions; a vision-language checkpoint's
``Qwen3_5ForConditionalGeneration`` computes the same text positions for text-only input (its multimodal position
ids stay unset without images).

Memory: the largest of one decoder layer's, the embedding's and the lm_head's (with the final norm) fp32 weights,
never two of them at once, plus every window's cache and hidden states. Each window's logits (length x vocab in fp32:
16 windows of 256 tokens are 4 GB at a 248320 vocabulary) go to a file as soon as the head has computed them and
come back memory-mapped, so they take host memory only while the gate reads them. The greedy continuation is one
more pass over all the weights (every window's continuation on its own cache), whatever its length: the weights
are read twice, where a free-running continuation would read them once per token (16 by default; at 27B each read
unfolds 27G weights).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask

from convert.export.functions import META
from convert.inputs.checkpoint import checkpoint_shapes, open_checkpoint
from convert.inputs.sources import read_json
from convert.models import family_for
from convert.progress import steps
from convert.weights.stream import release_free_memory


@dataclass
class ReferenceWindow:
    logits: torch.Tensor  # fp32 [length, vocab]
    taps: dict[int, torch.Tensor]  # tapped layer -> fp32 [length, hidden] (that decoder layer's output)
    greedy: list[int]  # the argmax after the window and after each continuation id but the last


def meta_model(source: Path, device: torch.device) -> nn.Module:
    """transformers' text causal LM of the checkpoint, every parameter on meta; its rotary embedding (the only
    buffers) built again for real, as transformers computes it at init, on ``device``."""
    config = AutoConfig.from_pretrained(str(source)).get_text_config()
    with torch.device(META):
        model = AutoModelForCausalLM.from_config(config).eval()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)
    return model


class Weights:
    """Fills a ``meta_model`` module from the checkpoint (fp32 on the device) and frees it again."""

    def __init__(self, source: Path, device: torch.device):
        config = read_json(source / "config.json")
        family = family_for(config)
        self.args = family.Args.from_config(config)
        self.layout = family.sanitize(checkpoint_shapes(source), self.args)
        self.reader, self.device = open_checkpoint(source, device), device

    def load(self, module: nn.Module, prefix: str) -> None:
        """``prefix``: the module's canonical key (``model.layers.3``, ``lm_head``); a tied lm_head reads the
        embedding."""
        if prefix == "lm_head" and self.args.tie_word_embeddings:
            prefix = "model.embed_tokens"
        state = {name: self.reader.get(self.layout.stored(f"{prefix}.{name}")).to(self.device, torch.float32)
                 for name, _ in module.named_parameters()}
        module.load_state_dict(state, assign=True)

    @staticmethod
    def free(module: nn.Module) -> None:
        module.to(META)
        release_free_memory()


def _layer_inputs(model: nn.Module, hidden: torch.Tensor, cache: DynamicCache) -> tuple[dict, dict]:
    """The masks (by layer type) and the keywords every decoder layer gets, as the text model's forward makes them
    before its loop over the layers."""
    inner, length = model.model, hidden.shape[1]
    positions = (torch.arange(length, device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
    if model.config.model_type == "qwen3":
        rope_positions = positions
        masks = {"full_attention": create_causal_mask(model.config, hidden, None, cache, position_ids=positions)}
    else:  # Qwen3.5: text positions, then three equal multimodal rows for the rotary embedding
        rope_positions = positions.view(1, 1, -1).expand(4, 1, -1)
        positions, rope_positions = rope_positions[0], rope_positions[1:]
        masks = {"full_attention": create_causal_mask(model.config, hidden, None, cache, position_ids=positions),
                 "linear_attention": create_recurrent_attention_mask(model.config, hidden, None, cache=cache,
                                                                     position_ids=positions)}
    position_embeddings = inner.rotary_emb(hidden, rope_positions)
    return masks, dict(position_embeddings=position_embeddings, position_ids=positions, use_cache=True)


def _pass(model: nn.Module, weights: Weights, inputs: list[torch.Tensor], caches: list[DynamicCache],
          taps: dict[int, list], advance, keep=None) -> list[torch.Tensor]:
    """One forward of every window's ``inputs`` [1, n] on its cache, layer-major; returns each window's logits
    [1, n, vocab] (on the host; ``keep(logits)``'s result when given, called as each is computed);
    ``taps[i][w]`` gets window w's layer-i output."""
    inner = model.model
    weights.load(inner.embed_tokens, "model.embed_tokens")
    hidden = [inner.embed_tokens(ids) for ids in inputs]
    weights.free(inner.embed_tokens)
    prepared = [_layer_inputs(model, h, cache) for h, cache in zip(hidden, caches, strict=True)]
    for i, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        weights.load(layer, f"model.layers.{i}")
        kind = model.config.layer_types[i]
        for w, ((masks, keywords), cache) in enumerate(zip(prepared, caches, strict=True)):
            hidden[w] = layer(hidden[w], attention_mask=masks[kind], cache=cache, **keywords)
            if i in taps:
                taps[i][w] = hidden[w][0].float().cpu()
        weights.free(layer)
        advance()
    weights.load(inner.norm, "model.norm")
    weights.load(model.lm_head, "lm_head")
    logits = [(keep or _same)(model.lm_head(inner.norm(h)).float().cpu()) for h in hidden]
    weights.free(inner.norm)
    weights.free(model.lm_head)
    return logits


@torch.no_grad()
def streamed_reference(source: Path, windows: list[list[int]], taps: list[int], continuations: list[list[int]],
                       device: str | torch.device = "cpu") -> list[ReferenceWindow]:
    """``gates._reference_window`` of each window and its ``continuations`` entry (the candidate's greedy ids) on
    ``gates.load_reference(source)``, streamed (module docstring)."""
    source, device = Path(source), torch.device(device)
    model, weights = meta_model(source, device), Weights(source, device)
    caches = [DynamicCache(config=model.config) for _ in windows]
    captured = {t: [None] * len(windows) for t in taps}
    passes = 2 if any(len(c) > 1 for c in continuations) else 1
    with steps("streamed fp32 reference", passes * model.config.num_hidden_layers, "layer passes") as advance:
        inputs = [torch.tensor([window], device=device) for window in windows]
        logits = _pass(model, weights, inputs, caches, captured, advance, memory_mapped)
        results = [ReferenceWindow(out[0], {t: captured[t][w] for t in taps}, [int(out[0, -1].argmax())])
                   for w, out in enumerate(logits)]
        if passes == 2:
            inputs = [torch.tensor([c[:-1]], device=device) for c in continuations]
            for r, out in zip(results, _pass(model, weights, inputs, caches, {}, advance), strict=True):
                r.greedy += out[0].argmax(-1).tolist()
    return results


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def memory_mapped(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values, written to a file and mapped back (the file is unlinked at once: its disk space is freed
    with the tensor), so that they are paged in only while read."""
    with tempfile.TemporaryDirectory(prefix="spec-convert-reference-") as scratch:
        path = Path(scratch) / "logits.pt"
        torch.save(tensor, path)
        return torch.load(path, mmap=True)
