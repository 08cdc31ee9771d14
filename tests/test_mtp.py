"""MTP head: both checkpoint layouts, refusals, the gated / partial-RoPE decoder layer against transformers'
Qwen3-Next and Qwen3.5 layers, export modules vs the eager reference, packages on the runtime."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from convert.backends import coreai, coreml
from convert.errors import InputError
from convert.inputs.sources import load_tensors, read_json, tensor_shapes
from convert.models import mtp, qwen3
from convert.models.mtp import MTPArgs
from convert.models.qwen3.core import RMSNorm
from convert.models.qwen3_5.core import ZeroCentredRMSNorm
from tests.helpers.checkpoints import tiny_config, write_checkpoint
from tests.helpers.mtp_checkpoints import head_tensors, qwen35_text_config, write_head_only, write_target_with_head

S = mtp.DRAFT_STEPS + 1
CONTEXT = 64
FP32_LOGITS_BOUND = 1e-4
FP16_TIE_GAP = 0.25  # a runtime/torch id flip is allowed only where torch's top-2 logit gap is below this
FP16_HIDDEN_RELATIVE = 2e-2


def _args(directory) -> MTPArgs:
    return MTPArgs.from_config(read_json(directory / "config.json"), where=str(directory / "config.json"))


def _write_qwen35_head(tmp_path, gated: bool = True, partial_rotary_factor: float = 0.25, tensors_gated=None):
    """A zero-centred Qwen3.5-style head-only checkpoint (gated q_proj and partial RoPE by default) next to a
    tiny Qwen3 target; ``tensors_gated`` writes the q_proj of the other kind than the config says."""
    hf = write_checkpoint(tmp_path / "target", vocab_size=512)
    config = qwen35_text_config(read_json(tmp_path / "target" / "config.json"), gated, partial_rotary_factor)
    gated_q = gated if tensors_gated is None else tensors_gated
    written = head_tensors(config["text_config"], zero_centred=True, seed=5, gated=gated_q)
    write_head_only(tmp_path / "head", config, written)
    return hf, written


def _target_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The target's final-norm output (what its lm_head reads) at every position: the head's hidden input."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


# ---------------------------------------------------------------- loading


def test_qwen35_layout_inside_the_target_checkpoint(tmp_path):
    _, written = write_target_with_head(tmp_path / "ckpt", layout="qwen3.5")
    args = _args(tmp_path / "ckpt")
    head = mtp.load_head(tmp_path / "ckpt", args)
    assert (head.layout, args.zero_centred_norm, args.mtp_layers, head.copies) == ("qwen3.5", False, 1, {})
    assert len(head.tensors) == 15 == len(written)
    for key, tensor in written.items():
        assert torch.equal(head.tensors[key.removeprefix("mtp.")], tensor), key
    assert args.parameter_count == sum(t.numel() for t in written.values())
    # the target's own sanitize ignores the head it declares, and still refuses it when undeclared
    config = read_json(tmp_path / "ckpt" / "config.json")
    qwen3.sanitize(tensor_shapes(tmp_path / "ckpt"), qwen3.Qwen3Args.from_config(config))
    del config["mtp_num_hidden_layers"]
    with pytest.raises(InputError, match=r"unexpected tensor 'mtp\.fc\.weight' and 14 more"):
        qwen3.sanitize(tensor_shapes(tmp_path / "ckpt"), qwen3.Qwen3Args.from_config(config))


def test_modules_are_filled_in_their_dtype_from_a_core_on_meta(tmp_path):
    """``build_modules`` makes the core with its parameters on meta and sets each from the head's tensors and the
    borrowed tables, cast to the modules' dtype (at 27B a core made in fp32 first held its two 248320-row tables in
    fp32, 10 GB): every parameter is the tensor's value in that dtype, and a table already in it is shared."""
    write_target_with_head(tmp_path / "ckpt", layout="qwen3.5")
    args = _args(tmp_path / "ckpt")
    head = mtp.load_head(tmp_path / "ckpt", args)
    target = {k: v.half() for k, v in load_tensors(tmp_path / "ckpt").items()}
    modules = mtp.build_modules(args, head, target, CONTEXT, dtype=torch.float16)
    params = dict(modules.core.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float16 for p in params.values())
    assert all(torch.equal(params[name], tensor.half()) for name, tensor in head.tensors.items())
    assert params["embed_tokens.weight"].data_ptr() == target["model.embed_tokens.weight"].data_ptr()
    assert torch.equal(params["lm_head.weight"], target["lm_head.weight"])
    head.tensors.pop("norm.weight")
    with pytest.raises(InputError, match="MTP head: no tensor for parameter 'norm.weight'"):
        mtp.build_modules(args, head, target, CONTEXT, dtype=torch.float16)


def test_deepseek_layout_with_table_copies(tmp_path):
    model, written = write_target_with_head(tmp_path / "ckpt", layout="deepseek", copies=True)
    args = _args(tmp_path / "ckpt")
    head = mtp.load_head(tmp_path / "ckpt", args)
    assert head.layout == "deepseek" and args.num_hidden_layers == 3
    assert torch.equal(head.tensors["fc.weight"], written["model.layers.3.eh_proj.weight"])
    assert torch.equal(head.tensors["pre_fc_norm_embedding.weight"], written["model.layers.3.enorm.weight"])
    assert torch.equal(head.tensors["pre_fc_norm_hidden.weight"], written["model.layers.3.hnorm.weight"])
    assert torch.equal(head.tensors["norm.weight"], written["model.layers.3.shared_head.norm.weight"])
    assert torch.equal(head.tensors["layers.0.mlp.up_proj.weight"], written["model.layers.3.mlp.up_proj.weight"])
    assert sorted(head.copies) == ["lm_head.weight", "model.embed_tokens.weight"]
    target = load_tensors(tmp_path / "ckpt")
    modules = mtp.build_modules(args, head, target, CONTEXT, dtype=torch.float32)
    assert torch.equal(modules.core.lm_head.weight, model.lm_head.weight)
    head.copies["lm_head.weight"] = head.copies["lm_head.weight"] + 1e-3
    with pytest.raises(InputError, match=r"'model\.layers\.3\.shared_head\.head\.weight' differs from the target's"):
        mtp.build_modules(args, head, target, CONTEXT, dtype=torch.float32)


def test_head_only_checkpoint_with_zero_centred_norms(tmp_path):
    write_checkpoint(tmp_path / "target", vocab_size=512)
    config = qwen35_text_config(read_json(tmp_path / "target" / "config.json"))
    written = head_tensors(config["text_config"], zero_centred=True, seed=3)
    write_head_only(tmp_path / "head", config, written)
    args = _args(tmp_path / "head")
    assert args.zero_centred_norm and args.model_type == "qwen3_5_text"
    head = mtp.load_head(tmp_path / "head", args)
    core = mtp.build_modules(args, head, load_tensors(tmp_path / "target"), CONTEXT, dtype=torch.float32).core
    norms = [m for m in core.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 7 and all(isinstance(m, ZeroCentredRMSNorm) for m in norms)
    x = torch.randn(5, 64)
    w = written["mtp.pre_fc_norm_hidden.weight"]
    by_hand = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(core.pre_fc_norm_hidden(x), by_hand, atol=1e-5)
    q_norm = core.layers[0].self_attn.q_norm.weight
    assert torch.equal(q_norm, written["mtp.layers.0.self_attn.q_norm.weight"])  # stored as written (around 0)


def _shapes(layout: str = "qwen3.5") -> tuple[dict, MTPArgs]:
    config = tiny_config(vocab_size=512).to_dict()
    config["mtp_num_hidden_layers" if layout == "qwen3.5" else "num_nextn_predict_layers"] = 1
    args = MTPArgs.from_config(config)
    return {k: tuple(v.shape) for k, v in head_tensors(config, layout).items()}, args


@pytest.mark.parametrize(
    "layout, edit, message",
    [
        (
            "qwen3.5",
            ("drop", "mtp.layers.0.self_attn.k_norm.weight"),
            r"'mtp\.layers\.0\.self_attn\.k_norm\.weight' is missing \(expected shape \[24\]\)",
        ),
        (
            "qwen3.5",
            ("set", "mtp.fc.weight", (64, 64)),
            r"'mtp\.fc\.weight' has shape \[64, 64\], expected \[64, 128\]",
        ),
        ("qwen3.5", ("set", "mtp.layers.0.mlp.extra.weight", (4,)), r"unexpected tensor 'mtp\.layers\.0\.mlp\.extra"),
        ("qwen3.5", ("set", "mtp.layers.1.input_layernorm.weight", (64,)), r"unexpected tensor 'mtp\.layers\.1\."),
        (
            "qwen3.5",
            ("set", "mtp.layers.0.mlp.experts.0.up_proj.weight", (96, 64)),
            r"'mtp\.layers\.0\.mlp\.experts\.0\.up_proj\.weight': a mixture-of-experts MLP",
        ),
        (
            "qwen3.5",
            ("set", "mtp.layers.0.mlp.gate.weight", (8, 64)),
            r"'mtp\.layers\.0\.mlp\.gate\.weight': a mixture",
        ),
        (
            "qwen3.5",
            ("set", "mtp.layers.0.self_attn.q_proj.weight", (192, 64)),
            r"'mtp\.layers\.0\.self_attn\.q_proj\.weight' has shape \[192, 64\] \(2 x heads x head_dim rows: an "
            r"attention output gate\), but the config has no gated attention .*expected \[96, 64\]",
        ),
        (
            "deepseek",
            ("set", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", (88, 64)),
            r"'model\.layers\.3\.self_attn\.kv_a_proj_with_mqa\.weight': MLA attention",
        ),
        ("deepseek", ("drop", "model.layers.3.hnorm.weight"), r"'model\.layers\.3\.hnorm\.weight' is missing"),
        (
            "deepseek",
            ("set", "model.layers.3.shared_head.head.weight", (512, 32)),
            r"'model\.layers\.3\.shared_head\.head\.weight' has shape \[512, 32\], expected \[512, 64\]",
        ),
        ("deepseek", ("set", "mtp.fc.weight", (64, 128)), r"both mtp\.\* and model\.layers\.3\.\*"),
    ],
)
def test_sanitize_refuses_naming_the_tensor(layout, edit, message):
    shapes, args = _shapes(layout)
    assert mtp.sanitize(shapes, args) == layout
    if edit[0] == "drop":
        del shapes[edit[1]]
    else:
        shapes[edit[1]] = edit[2]
    with pytest.raises(InputError, match=message):
        mtp.sanitize(shapes, args)


def test_refusals_on_disk_and_in_the_config(tmp_path):
    write_target_with_head(tmp_path / "ckpt")
    config = read_json(tmp_path / "ckpt" / "config.json")
    with pytest.raises(InputError, match="no MTP head tensors"):
        mtp.sanitize({"model.embed_tokens.weight": (512, 64)}, _args(tmp_path / "ckpt"))
    for edits, message in [
        ({"mtp_num_hidden_layers": 0}, "declares no MTP head"),
        ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers=2: only a single MTP head layer"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn'"),
        ({"partial_rotary_factor": 0.125}, r"partial_rotary_factor=0\.125 gives 3 rotary dims of head_dim 24"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0}}, r"gives 0 rotary dims"),
        ({"hidden_size": None}, "missing field 'hidden_size'"),
    ]:
        changed = {k: v for k, v in {**config, **edits}.items() if v is not None}
        with pytest.raises(InputError, match=message):
            MTPArgs.from_config(changed)
    config["num_attention_heads"] = 8  # q_proj rows then differ: read from disk, refused with the path
    with pytest.raises(InputError, match=r"ckpt: tensor 'mtp\.layers\.0\.self_attn\.q_proj\.weight' has shape"):
        mtp.load_head(tmp_path / "ckpt", MTPArgs.from_config(config))
    config["num_attention_heads"] = 4  # as a Qwen3-Next config, the plain q_proj lacks the family's output gate
    with pytest.raises(InputError, match=r"ckpt: tensor 'mtp\.layers\.0\.self_attn\.q_proj\.weight' has shape "
                       r"\[96, 64\] \(heads x head_dim rows: no attention output gate\), but the config asks for "
                       r"gated attention \(attn_output_gate=true.*expected \[192, 64\]"):
        mtp.load_head(tmp_path / "ckpt", MTPArgs.from_config({**config, "model_type": "qwen3_next"}))


def test_family_defaults_follow_transformers_configs():
    """Absent fields take the Qwen3-Next / Qwen3.5 config classes' defaults: gate on, partial rotary 0.25,
    head_dim 256 (the Qwen3.5 27B head's sizes); a Qwen3 config keeps full RoPE and no gate."""
    text = {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4,
            "intermediate_size": 17408, "vocab_size": 248320, "num_hidden_layers": 64, "mtp_num_hidden_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10]}}
    args = MTPArgs.from_config({"model_type": "qwen3_5", "text_config": text})
    assert (args.attn_output_gate, args.head_dim, args.rotary_dim, args.zero_centred_norm) == (True, 256, 64, True)
    shapes = mtp.expected_shapes(args, "qwen3.5")
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (12288, 5120)
    assert shapes["mtp.layers.0.self_attn.o_proj.weight"] == (5120, 6144)
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
    fields = copy.deepcopy({k: v for k, v in text.items() if k != "model_type"})  # transformers edits the dicts
    hf_text = qwen3_5.Qwen3_5TextConfig(**fields).to_dict()
    assert hf_text["head_dim"] == 256 and hf_text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert MTPArgs.from_config(hf_text) == args
    qwen3_like = MTPArgs.from_config({**text, "model_type": "qwen3", "head_dim": 128})
    assert (qwen3_like.attn_output_gate, qwen3_like.rotary_dim, qwen3_like.zero_centred_norm) == (False, 128, False)
    gate_off = MTPArgs.from_config({**text, "attn_output_gate": False, "partial_rotary_factor": 0.5})
    assert (gate_off.attn_output_gate, gate_off.rotary_dim) == (False, 128)


@pytest.mark.parametrize("config_gated", [False, True])
def test_gated_q_proj_must_match_the_config(tmp_path, config_gated):
    """A gated q_proj under a config without the gate, and a plain one under a gated config: refused by name."""
    _write_qwen35_head(tmp_path, gated=config_gated, tensors_gated=not config_gated)
    args = _args(tmp_path / "head")
    assert args.attn_output_gate is config_gated
    found, expected = ([96, 64], [192, 64]) if config_gated else ([192, 64], [96, 64])
    key = r"'mtp\.layers\.0\.self_attn\.q_proj\.weight'"
    with pytest.raises(InputError, match=rf"head: tensor {key} has shape \{found}.*expected \{expected}"):
        mtp.load_head(tmp_path / "head", args)


# ---------------------------------------------------------------- parity with transformers' own layer


def _hf_full_attention_layer(model_type: str, seed: int = 11):
    """transformers' own Qwen3-Next / Qwen3.5 full-attention decoder layer (tiny, seeded, eager attention) and its
    rotary embedding; Qwen3-Next's layer 0 made dense (``mlp_only_layers``), as an MTP head's block is."""
    sizes = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next import configuration_qwen3_next as conf
        from transformers.models.qwen3_next import modeling_qwen3_next as modeling
        config = conf.Qwen3NextConfig(**sizes, mlp_only_layers=[0])
        layer, rotary = modeling.Qwen3NextDecoderLayer(config, 0), modeling.Qwen3NextRotaryEmbedding(config)
    else:
        from transformers.models.qwen3_5 import configuration_qwen3_5 as conf
        from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling
        config = conf.Qwen3_5TextConfig(**sizes)
        layer, rotary = modeling.Qwen3_5DecoderLayer(config, 0), modeling.Qwen3_5TextRotaryEmbedding(config)
    config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():  # norm gains around 0 (the layer applies 1 + w), matrices N(0, 0.08)
            p.copy_((0.2 if p.dim() == 1 else 0.08) * torch.randn(p.shape, generator=g))
    return config, layer.eval(), rotary


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_decoder_layer_matches_transformers(model_type):
    """Our reference and export core's decoder layer = transformers' full-attention layer (gated q_proj, partial
    RoPE 0.25 of head_dim 32, zero-centred norms) on the same inputs and positions, fp32."""
    config, layer, rotary = _hf_full_attention_layer(model_type)
    args = MTPArgs.from_config({**config.to_dict(), "mtp_num_hidden_layers": 1})
    assert (args.attn_output_gate, args.rotary_dim, args.zero_centred_norm) == (True, 8, True)
    reference, core = mtp.MTPReference(args).eval(), mtp.MTPCore(args, CONTEXT).eval()
    for head in (reference, core):
        head.layers[0].load_state_dict(layer.state_dict())
    assert tuple(core.layers[0].self_attn.q_proj.weight.shape) == (256, 64)
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(12))
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    worst = 0.0
    with torch.no_grad():
        for start in (1, 40):  # positions start..start+8
            positions = torch.arange(start, start + 9)[None]
            want = layer(x, position_embeddings=rotary(x, positions), attention_mask=causal, position_ids=positions)
            got = reference.decoder(x, positions)
            worst = max(worst, (got - want).abs().max().item())
            if start == 1:  # the core from fresh caches (its rows start at 1): 5 rows, then 4 more on the cache
                caches = [torch.zeros(core.cache_shape()) for _ in range(2)]
                first = core.decoder(x[0, :5], positions[:, :5].int(), *caches)
                rest = core.decoder(x[0, 5:], positions[:, 5:].int(), *caches)
                worst = max(worst, (torch.cat([first, rest]) - want[0]).abs().max().item())
    print(f"{model_type}: max |delta| vs transformers' decoder layer {worst:.2e} (output scale {want.abs().max():.2f})")
    assert worst < 1e-5, worst


# ---------------------------------------------------------------- numerics (fp32, export vs reference)


class Scenario:
    """Run the export functions like a host and the reference on the true sequence after every call.

    ``rows`` is the sequence the head has seen, by position (token, hidden, position): each call first drops the
    rows at or past its first position (positional rollback) and appends its real rows.
    """

    def __init__(self, modules, reference, tokens, target_hidden):
        self.modules, self.reference, self.tokens, self.target_hidden = modules, reference, tokens, target_hidden
        self.rows: list[tuple[int, torch.Tensor, int]] = []
        self.worst, self.rows_checked = 0.0, 0

    def accept(self, t0: int, t1: int):
        """Rows t0..t1-1: token t+1 with the target's hidden at t, at position t+1; padded by repeating the last."""
        real = [(self.tokens[t + 1], self.target_hidden[t], t + 1) for t in range(t0, t1)]
        return self._call("accept", real, real + [real[-1]] * (S - len(real)))

    def draft_step(self, token: int, hidden: torch.Tensor, position: int):
        return self._call("draft_step", [(token, hidden, position)], [(token, hidden, position)])

    def _call(self, name, real, padded):
        ids, hidden, positions = zip(*padded, strict=True)
        out = self.modules.call(name, list(ids), torch.stack(hidden)[None], list(positions))
        self.rows = [r for r in self.rows if r[2] < real[0][2]] + real
        ids, hidden, positions = zip(*self.rows, strict=True)
        with torch.no_grad():
            ref = self.reference(torch.tensor([ids]), torch.stack(hidden)[None], torch.tensor([positions]))
        n = len(real)
        got_logits, ref_logits = out["logits"][0, :n], ref.logits[0, -n:]
        self.worst = max(self.worst, (got_logits - ref_logits).abs().max().item())
        self.worst = max(self.worst, (out["hidden_out"][0, :n] - ref.hidden_out[0, -n:]).abs().max().item())
        assert torch.equal(out["draft_ids"][0, :n].long(), ref_logits.argmax(-1)), f"{name} at {real[0][2]}"
        if name == "accept":  # a padding row repeats the last real row, so it gives the same outputs
            assert torch.equal(out["logits"][0, n:], out["logits"][0, n - 1 : n].expand(S - n, -1))
        self.rows_checked += n
        return int(out["draft_ids"][0, n - 1]), out["hidden_out"][0, n - 1]


def _setup(tmp_path, variant: str, dtype=torch.float32):
    """(target model, args, export modules in ``dtype``, fp32 reference) for a head variant."""
    if variant == "qwen3.5-in-target":
        hf, _ = write_target_with_head(tmp_path / "ckpt", vocab_size=512)
        args, head_dir, target = _args(tmp_path / "ckpt"), tmp_path / "ckpt", load_tensors(tmp_path / "ckpt")
    else:  # a zero-centred head-only checkpoint next to its target: plain, or gated with partial RoPE
        gated = variant == "gated-partial-rope-head-only"
        hf, _ = _write_qwen35_head(tmp_path, gated=gated, partial_rotary_factor=0.25 if gated else 1.0)
        args, head_dir, target = _args(tmp_path / "head"), tmp_path / "head", load_tensors(tmp_path / "target")
        assert (args.attn_output_gate, args.rotary_dim) == ((True, 6) if gated else (False, 24))
    head = mtp.load_head(head_dir, args)
    modules = mtp.build_modules(args, head, target, CONTEXT, dtype=dtype)
    reference = mtp.build_reference(args, head, target)
    return hf, args, modules, reference


VARIANTS = ["qwen3.5-in-target", "zero-centred-head-only", "gated-partial-rope-head-only"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_modules_match_the_reference_through_drafts_and_rollback(tmp_path, variant):
    hf, args, modules, reference = _setup(tmp_path, variant)
    tokens = torch.randint(4, args.vocab_size, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    run = Scenario(modules, reference, tokens, _target_hidden(hf, tokens))
    run.accept(0, 4)
    run.accept(4, 8)
    draft, hidden = run.accept(8, 11)  # a partial chunk: 3 rows + 1 padding row repeating the last
    for position in (12, 13):
        draft, hidden = run.draft_step(draft, hidden, position)
    draft, hidden = run.accept(11, 13)  # rows 12, 13 rewritten over the draft steps' rows
    for position in (14, 15):
        draft, hidden = run.draft_step(draft, hidden, position)
    stale = modules.functions["accept"][0].key_cache[0, :, 15].clone()
    draft, hidden = run.accept(13, 14)  # only 14 accepted: row 15 (a draft row) stays in the cache, unseen
    assert stale.abs().max() > 0 and torch.equal(modules.functions["accept"][0].key_cache[0, :, 15], stale)
    for position in (15, 16):
        draft, hidden = run.draft_step(draft, hidden, position)
    run.accept(14, 18)
    assert run.rows_checked == 24
    print(f"{variant}: max |delta| logits/hidden_out {run.worst:.2e} over {run.rows_checked} rows")
    assert run.worst < FP32_LOGITS_BOUND, run.worst
    assert modules.functions["draft_step"][0].key_cache[0, :, 0].abs().max() == 0  # row 0: never a head row


def test_stale_rows_and_row_zero_are_never_read(tmp_path):
    _, args, modules, _ = _setup(tmp_path, "gated-partial-rope-head-only")
    hidden = torch.randn(S, args.hidden_size, generator=torch.Generator().manual_seed(2))
    clean = modules.call("accept", [5, 6, 7, 8], hidden, [1, 2, 3, 4])["logits"]
    module = modules.functions["accept"][0]
    module.key_cache[:, :, 5:].normal_()
    module.value_cache[:, :, 5:].normal_()
    module.key_cache[:, :, 0].normal_()
    module.value_cache[:, :, 0].normal_()
    assert torch.equal(modules.call("accept", [5, 6, 7, 8], hidden, [1, 2, 3, 4])["logits"], clean)


@pytest.mark.parametrize("variant", ["qwen3.5-in-target", "gated-partial-rope-head-only"])
def test_chain_training_form_equals_the_sequence_view(tmp_path, variant):
    """Step k of ``chain`` at row t = the last row of a plain run over step 1's rows 0..t then one row per step."""
    _, args, _, reference = _setup(tmp_path, variant)
    g = torch.Generator().manual_seed(4)
    steps = [torch.randint(4, args.vocab_size, (2, 9), generator=g) for _ in range(3)]
    hidden = torch.randn(2, 9, args.hidden_size, generator=g)
    positions = torch.arange(1, 10).expand(2, 9) + 3
    with torch.no_grad():
        chained = reference.chain(steps, hidden, positions)
        for t in (0, 4, 8):
            ids, hid, pos = steps[0][:, : t + 1], hidden[:, : t + 1], positions[:, : t + 1]
            for k in range(3):
                if k:
                    ids = torch.cat([ids, steps[k][:, t : t + 1]], dim=1)
                    hid = torch.cat([hid, chained[k - 1].hidden_out[:, t : t + 1]], dim=1)
                    pos = torch.cat([pos, positions[:, t : t + 1] + k], dim=1)
                plain = reference(ids, hid, pos)
                assert (plain.logits[:, -1] - chained[k].logits[:, t]).abs().max() < 1e-5
                assert torch.equal(plain.logits[:, -1].argmax(-1), chained[k].logits[:, t].argmax(-1))


# ---------------------------------------------------------------- packages


@pytest.mark.parametrize("variant", ["qwen3.5-in-target", "gated-partial-rope-head-only"])
def test_packages_read_back_and_run_on_the_coreai_runtime(tmp_path, variant):
    hf, args, modules, _ = _setup(tmp_path, variant, dtype=torch.float16)
    functions = modules.functions
    specs = {name: spec for name, (_, spec) in functions.items()}
    assert specs == {s.name: s for s in mtp.function_specs(args, mtp.DRAFT_STEPS, CONTEXT, torch.float16)}
    assert [t.shape for t in specs["accept"].inputs] == [(1, 4), (1, 4, 64), (1, 4)]
    assert [t.shape for t in specs["draft_step"].states] == [(1, 2, CONTEXT, 24)] * 2
    coreai.package(functions, tmp_path / "mtp.aimodel")
    coreml.package(functions, tmp_path / "mtp.mlpackage")
    assert coreai.read_back(tmp_path / "mtp.aimodel") == specs
    accept, draft_step = functions["accept"][0], functions["draft_step"][0]
    assert accept.core is draft_step.core and accept.key_cache is draft_step.key_cache
    assert [n for n, _ in accept.named_parameters()] == [n for n, _ in draft_step.named_parameters()]
    weight_bytes = sum(p.nbytes for p in accept.parameters())  # head + borrowed embedding and lm_head, fp16
    assert (tmp_path / "mtp.aimodel" / "main.mlirb").stat().st_size < 1.3 * weight_bytes
    assert (tmp_path / "mtp.mlpackage" / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size < 1.2 * weight_bytes
    assert coreml.read_back(tmp_path / "mtp.mlpackage") == specs

    tokens = torch.randint(4, args.vocab_size, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    target_hidden = _target_hidden(hf, tokens).half()
    calls = [("accept", tokens[1:5], target_hidden[0:4], [1, 2, 3, 4])]
    flips, worst_hidden = 0, 0.0
    with coreai.open_session(tmp_path / "mtp.aimodel") as session:
        for _ in range(3):
            name, ids, hidden, positions = calls[-1]
            inputs = {
                "input_ids": np.asarray(ids, np.int32)[None],
                "hidden": hidden.numpy()[None],
                "position_ids": np.asarray(positions, np.int32)[None],
            }
            got = session.call(name, inputs)
            want = modules.call(name, ids, hidden, positions)
            logits = want["logits"][0].float()
            top2 = logits.topk(2, dim=-1).values
            same = got["draft_ids"][0] == want["draft_ids"][0].numpy()
            assert all(same | (top2[:, 0] - top2[:, 1] < FP16_TIE_GAP).numpy()), (name, got["draft_ids"], want)
            flips += int((~same).sum())
            ref_hidden = want["hidden_out"][0].float().numpy()
            delta = np.abs(got["hidden_out"][0].astype(np.float32) - ref_hidden).max()
            worst_hidden = max(worst_hidden, float(delta / np.abs(ref_hidden).max()))
            # both sides continue from torch's outputs, so a tie flip cannot make them diverge
            draft, out_hidden = int(want["draft_ids"][0, -1]), want["hidden_out"][0, -1:]
            calls.append(("draft_step", [draft], out_hidden, [positions[-1] + 1]))
        states = session.states()
    print(f"{variant}: runtime vs torch fp16: {flips} id flips, hidden_out max relative delta {worst_hidden:.2e}")
    assert flips <= 1, flips
    assert worst_hidden < FP16_HIDDEN_RELATIVE, worst_hidden
    torch_cache = functions["draft_step"][0].key_cache.float().numpy()
    assert np.abs(states["key_cache"][:, :, :7].astype(np.float32) - torch_cache[:, :, :7]).max() < 2e-2
    assert np.abs(states["key_cache"][:, :, 7:]).max() == 0 and np.abs(states["key_cache"][:, :, 0]).max() == 0
