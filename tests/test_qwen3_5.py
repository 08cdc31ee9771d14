"""The hybrid (Qwen3.5-family) export modules against transformers' own Qwen3_5ForCausalLM /
Qwen3_5ForConditionalGeneration run token by token, in fp32: prefill chunks (the last one padded), decode steps,
verify blocks with any accept, and the rollback over many random rounds; plus the device-safe forms."""

import copy

import pytest
import torch
import torch.nn.functional as F

from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import qwen3_5, read_args
from convert.models.layout import Layout
from convert.runtime.host import HostContractError, module_driver
from tests.helpers.qwen3_5_checkpoints import F as FULL
from tests.helpers.qwen3_5_checkpoints import L as LINEAR
from tests.helpers.qwen3_5_checkpoints import rewrite_config, write_checkpoint

PREFILL, VERIFY, CONTEXT = 16, 8, 160
TOLERANCE = 1e-4
# the ane layout computes the same in another order (1x1 convolutions, channels first): 1e-5 from the stateful logits
# at a first prefill, up to 1.8e-4 after 73 positions on the interval-3 variant (logits near 3), where the stateful
# functions are 6.1e-5 from transformers and the ane ones 1.2e-4 (measured)
TOLERANCE_BY_LAYOUT = {"stateful": TOLERANCE, "ane": 2e-4}


class TokenByToken:
    """transformers' forward one token at a time with its cache (the recurrent GDN path), over any token sequence:
    each position's logits and hidden states, computed from the longest already-computed prefix (cache snapshots)."""

    def __init__(self, model):
        self.model = model
        self.tokens: list[int] = []
        self.snapshots = [None]  # cache after tokens[:i]
        self.rows: list[tuple[torch.Tensor, tuple]] = []  # (logits, hidden_states) at position i

    @torch.no_grad()
    def outputs(self, tokens: list[int]) -> list[tuple[torch.Tensor, tuple]]:
        common = 0
        while common < min(len(tokens), len(self.tokens)) and tokens[common] == self.tokens[common]:
            common += 1
        del self.tokens[common:], self.snapshots[common + 1 :], self.rows[common:]
        for token in tokens[common:]:
            cache = copy.deepcopy(self.snapshots[-1])
            out = self.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[len(self.tokens)]]),
                             cache=cache, use_cache=True, output_hidden_states=True)
            self.tokens.append(token)
            self.snapshots.append(out.cache)
            self.rows.append((out.logits[0, -1], tuple(h[0, -1] for h in out.hidden_states)))
        return self.rows[: len(tokens)]


class FullSequence:
    """transformers' forward over the whole sequence without a cache (its chunked GDN path), for a model whose cache
    transformers cannot run (an all-linear-attention one has no attention layer to count positions by)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def outputs(self, tokens: list[int]) -> list[tuple[torch.Tensor, tuple]]:
        out = self.model(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True)
        return [(out.logits[0, i], tuple(h[0, i] for h in out.hidden_states)) for i in range(len(tokens))]


def modules_for(directory, taps=(), layout="stateful", **graphs):
    args = read_args(read_json(directory / "config.json"))
    graphs = {"prefill": PREFILL, "verify": VERIFY, **graphs}
    target = Target(source="path:x", graphs=Graphs(**graphs), context=CONTEXT, taps=list(taps) or None, layout=layout)
    from convert.weights.target import build_modules

    return args, build_modules(args, target, load_tensors(directory), torch.float32)


class Checker:
    """Runs calls through the host driver and compares every real row with the token-by-token reference."""

    def __init__(self, hf, modules, taps, reference=TokenByToken):
        self.reference, self.driver, self.taps = reference(hf), module_driver(modules), taps
        self.hidden = modules.core.args.hidden_size
        self.committed: list[int] = []
        self.worst_logits = self.worst_taps = 0.0
        self.positions = 0

    def call(self, function: str, tokens: list[int], p0: int) -> list[int]:
        out = self.driver.run(function, tokens, p0)
        self.committed = self.committed[:p0]
        ref = self.reference.outputs(self.committed + tokens)[p0:]
        for row, (logits, hidden_states) in enumerate(ref):
            got = torch.from_numpy(out["logits"][row])
            self.worst_logits = max(self.worst_logits, float((got - logits).abs().max()))
            assert int(out["argmax_ids"][row]) == int(logits.argmax()), f"{function} at {p0 + row}: argmax differs"
            for k, layer in enumerate(self.taps):
                tap = torch.from_numpy(out["taps"][row, k * self.hidden : (k + 1) * self.hidden])
                self.worst_taps = max(self.worst_taps, float((tap - hidden_states[layer + 1]).abs().max()))
        self.positions += len(tokens)
        self.committed = self.committed + tokens
        return [int(t) for t in out["argmax_ids"]]


def _script(vocab: int):
    """(function, tokens, first position): prefill chunks (the last padded), decodes, verify blocks whose next call
    keeps 3, 0, all 8 and 3 of their rows, decodes between them."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(4, vocab, (120,), generator=g).tolist()
    b = torch.randint(4, vocab, (120,), generator=g).tolist()
    calls = [("prefill", a[0:16], 0), ("prefill", a[16:32], 16), ("prefill", a[32:37], 32)]  # 5 of 16: padded
    calls += [("decode", [a[p]], p) for p in range(37, 41)]
    calls += [("verify", a[41:49], 41), ("verify", b[44:52], 44)]  # keep 3 of the first block
    calls += [("verify", a[44:52], 44)]  # keep 0: the whole block at 44 is rejected, re-verified
    calls += [("verify", b[52:60], 52), ("decode", [a[60]], 60)]  # keep all 8, then a decode
    calls += [("verify", b[61:69], 61), ("verify", a[64:72], 64)]  # keep 1 (the decode), then 3
    calls += [("decode", [b[p]], p) for p in range(72, 76)]
    return calls


def _interval_only(config: dict) -> None:
    """config.json with full_attention_interval instead of layer_types (what transformers derives them from)."""
    del config["layer_types"]
    config["full_attention_interval"] = 3


VARIANTS = {  # (checkpoint overrides, config.json edit)
    "causal-lm-untied": (dict(), None),
    "tied": (dict(tie_word_embeddings=True), None),
    "conditional-generation": (dict(conditional=True), None),
    "conditional-tied": (dict(conditional=True, tie_word_embeddings=True), None),
    "pattern-FLLF-odd-dims": (dict(layer_types=[FULL, LINEAR, LINEAR, FULL], hidden_size=40, head_dim=10,
                                   num_attention_heads=5, num_key_value_heads=5, linear_num_key_heads=3,
                                   linear_num_value_heads=3, linear_key_head_dim=7, linear_value_head_dim=9,
                                   linear_conv_kernel_dim=3, intermediate_size=52), None),
    "interval-3-gqa-3-to-1": (dict(layer_types=[LINEAR, LINEAR, FULL, LINEAR, LINEAR], num_hidden_layers=5,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.5}), _interval_only),
}


@pytest.mark.parametrize("layout", ["stateful", "ane"])
@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
def test_export_modules_match_transformers_token_by_token(tmp_path, variant, layout):
    """Both layouts (the ane one through the host: its buffers, commit inputs, lookup and argmax)."""
    overrides, edit = variant
    hf = write_checkpoint(tmp_path / "ckpt", **overrides)
    if edit:
        rewrite_config(tmp_path / "ckpt", edit)
    args = read_args(read_json(tmp_path / "ckpt" / "config.json"))
    assert list(args.layer_types) == list(hf.config.get_text_config().layer_types)
    taps = (args.num_hidden_layers - 2, 0)  # recipe order, not sorted
    args, modules = modules_for(tmp_path / "ckpt", taps, layout)
    checker = Checker(hf, modules, taps)
    for function, tokens, p0 in _script(args.vocab_size):
        checker.call(function, tokens, p0)
    assert len(checker.committed) == 76 and checker.positions >= 64
    assert checker.worst_logits < TOLERANCE_BY_LAYOUT[layout], checker.worst_logits
    assert checker.worst_taps < TOLERANCE_BY_LAYOUT[layout], checker.worst_taps


def test_all_linear_attention_layers(tmp_path):
    """No attention layer at all: no KV states; compared with transformers' uncached forward."""
    hf = write_checkpoint(tmp_path / "ckpt", layer_types=[LINEAR] * 3, num_hidden_layers=3)
    args, modules = modules_for(tmp_path / "ckpt", (1,))
    assert [s.name for s in modules.functions["verify"][1].states] == list(qwen3_5.STATE_NAMES[2:])
    checker = Checker(hf, modules, (1,), FullSequence)
    for function, tokens, p0 in _script(args.vocab_size)[:8]:
        checker.call(function, tokens, p0)
    assert checker.worst_logits < TOLERANCE and checker.worst_taps < TOLERANCE


@pytest.mark.parametrize("layout", ["stateful", "ane"])
def test_rollback_is_exact_for_random_accepts(tmp_path, layout):
    """200 verify rounds, each keeping a random 0..S of its rows on the next call (every k seen), some through a
    decode, all against the token-by-token reference of what was kept; a new session every ~96 positions (fp32
    rounding, not the rollback, is what grows with the position: transformers' own chunked and token-by-token
    paths differ by 1e-5 here)."""
    hf = write_checkpoint(tmp_path / "ckpt", seed=3)
    args, modules = modules_for(tmp_path / "ckpt", (1,), layout, prefill=8, verify=4)
    checker = Checker(hf, modules, (1,))
    g = torch.Generator().manual_seed(7)
    tokens = lambda n: torch.randint(4, args.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    checker.call("prefill", tokens(5), 0)
    p, seen, rounds = 5, set(), 0
    while rounds < 200:
        if p > 96:  # start a new session: the reference restarts too
            checker.driver.reset()
            checker.committed, p = [], 0
            checker.call("prefill", tokens(3), 0)
            p = 3
        checker.call("verify", tokens(4), p)
        keep = int(torch.randint(0, 5, (), generator=g))
        seen.add(keep)
        p += keep
        rounds += 1
        if int(torch.randint(0, 4, (), generator=g)) == 0:
            checker.call("decode", tokens(1), p)
            p += 1
    assert seen == {0, 1, 2, 3, 4}
    assert checker.worst_logits < TOLERANCE, checker.worst_logits
    assert checker.worst_taps < TOLERANCE, checker.worst_taps


def test_a_rollback_past_the_previous_call_is_refused(tmp_path):
    write_checkpoint(tmp_path / "ckpt")
    _, modules = modules_for(tmp_path / "ckpt")
    driver = module_driver(modules)
    driver.reset()
    driver.run("prefill", [5, 6, 7, 8], 0)
    driver.run("decode", [9], 4)
    with pytest.raises(HostContractError, match="position in 4..5"):
        driver.run("verify", [9, 10], 3)  # before the decode: committed, cannot be rolled back
    with pytest.raises(HostContractError, match="position in 4..5"):
        driver.run("decode", [9], 6)  # past the decode's row: a gap


# ------------------------------------------------------------------------------------- device-safe forms


def test_softplus_and_silu_equal_the_plain_forms_in_fp32():
    x = torch.linspace(-30, 30, 100_001, dtype=torch.float32)
    torch.testing.assert_close(qwen3_5.softplus(x), F.softplus(x), rtol=2e-7, atol=2e-7)
    torch.testing.assert_close(qwen3_5.silu(x), F.silu(x), rtol=2e-7, atol=2e-7)
    assert float(qwen3_5.softplus(torch.tensor(20.0, dtype=torch.float16))) == pytest.approx(20.0, abs=0.02)


def _rule_inputs(rows: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(rows, heads, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(rows, heads, dk, generator=g), dim=-1)
    v = torch.randn(rows, heads, dv, generator=g)
    gate = -torch.rand(rows, heads, generator=g) * 2
    beta = torch.rand(rows, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return state, q, k, v, gate, beta


def _recurrence(state, q, k, v, g, beta):
    """transformers' torch_recurrent_gated_delta_rule step by step, row-major inputs."""
    outs = []
    for t in range(k.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - (state * k[t][:, :, None]).sum(-2))
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(-2))
    return torch.stack(outs), state


def _masks(size):
    return None if size == 1 else qwen3_5.ChunkMasks.of(size)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 37])
def test_chunked_delta_rule_equals_the_recurrence(rows):
    state, q, k, v, g, beta = _rule_inputs(rows)
    want_out, want_state = _recurrence(state, q, k, v, g, beta)
    out, final = qwen3_5.delta_rule(state, q, k, v, g, beta, rows, _masks)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_state, rtol=1e-5, atol=1e-5)


def test_a_chunk_of_64_in_the_anes_arithmetic_keeps_its_decays_at_real_magnitudes():
    """The ane layout's delta rule computes in fp16 (the Neural Engine has no fp32). With a trained checkpoint's decays
    (exp(A_log) up to about 15: a head's G over a chunk of 64 rows reaches -263 here), G_i - G_j taken as the
    difference of two running sums near 263 carries their fp16 rounding (1/8 there): the outputs were 1.04% off
    fp64 (states 1.24%); as the sum of the rows between, 0.10% (0.08%)."""
    from convert.fp16 import device_arithmetic
    from convert.models.qwen3_5.gated_delta import delta_rule_chunk

    gen = torch.Generator().manual_seed(0)
    heads, rows, dim = 8, 64, 128
    q = torch.nn.functional.normalize(torch.randn(heads, rows, dim, generator=gen), dim=-1) * dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(heads, rows, dim, generator=gen), dim=-1)
    v = torch.randn(heads, rows, dim, generator=gen)
    decay = torch.rand(heads, 1, generator=gen) * 5  # exp(A_log) of a head
    g = -decay * torch.nn.functional.softplus(torch.randn(heads, rows, generator=gen))
    beta = torch.sigmoid(torch.randn(heads, rows, generator=gen))
    state = torch.randn(heads, dim, dim, generator=gen) * 0.1
    masks = qwen3_5.ChunkMasks.of(rows)
    assert float(-g.sum(-1).min()) > 200
    want_out, want_state = delta_rule_chunk(*(t.double() for t in (state, q, k, v, g, beta)), masks)
    with device_arithmetic("ane"):
        out, final = delta_rule_chunk(*(t.half() for t in (state, q, k, v, g, beta)), masks)
    assert float((out.double() - want_out).abs().max() / want_out.abs().max()) < 0.003
    assert float((final.double() - want_state).abs().max() / want_state.abs().max()) < 0.003


def test_identity_rows_leave_the_state_exactly_as_the_kept_rows_do():
    """The commit's masking: rows with g = 0 and beta = 0 after the kept ones change nothing, bit for bit."""
    state, q, k, v, g, beta = _rule_inputs(8)
    for kept in range(9):
        masked_g, masked_beta = g.clone(), beta.clone()
        masked_g[kept:], masked_beta[kept:] = 0.0, 0.0
        _, full = qwen3_5.delta_rule(state, None, k, v, masked_g, masked_beta, 8, _masks)
        _, short = (None, state) if kept == 0 else qwen3_5.delta_rule(
            state, None, k[:kept], v[:kept], g[:kept], beta[:kept], kept, _masks)
        torch.testing.assert_close(full, short, rtol=1e-6, atol=1e-6)


def test_power_of_two_scaling_is_exact():
    """q x 16 and v x 64 (state stored x 64) give the plain outputs x 1024 bit for bit in fp32."""
    state, q, k, v, g, beta = _rule_inputs(16, seed=2)
    plain_out, plain_state = qwen3_5.delta_rule(state, q, k, v, g, beta, 16, _masks)
    scaled_out, scaled_state = qwen3_5.delta_rule(state * qwen3_5.VALUE_SCALE, q * qwen3_5.QUERY_SCALE, k,
                                                  v * qwen3_5.VALUE_SCALE, g, beta, 16, _masks)
    assert torch.equal(scaled_out / (qwen3_5.QUERY_SCALE * qwen3_5.VALUE_SCALE), plain_out)
    assert torch.equal(scaled_state / qwen3_5.VALUE_SCALE, plain_state)


@pytest.mark.parametrize("size", [2, 3, 8, 16])
def test_unit_lower_inverse(size):
    a = torch.randn(4, size, size, generator=torch.Generator().manual_seed(size)).tril(-1) * 0.5
    got = qwen3_5.unit_lower_inverse(a, qwen3_5.ChunkMasks.of(size))
    torch.testing.assert_close(got, torch.linalg.inv(torch.eye(size) + a), rtol=1e-5, atol=1e-5)


def test_causal_conv_is_the_windowed_sum():
    g = torch.Generator().manual_seed(0)
    window, weight = torch.randn(3 + 10, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    want = torch.stack([sum(weight[:, 0, j] * window[t + j] for j in range(4)) for t in range(10)])
    torch.testing.assert_close(qwen3_5.causal_conv(window, weight, 6), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- quantization


def test_calibration_runs_the_gdn_layers_and_keeps_the_small_linears(tmp_path):
    """GPTQ's layer-sequential capture over a hybrid core: the layers' outputs equal a prefill of each sample, the
    linears come in each layer kind's groups, and in_proj_a / in_proj_b are never handed to the quantizer."""
    from convert.weights.quantize import quantize_sequential
    from quant.calibrate import each_linear

    write_checkpoint(tmp_path / "ckpt")
    args, modules = modules_for(tmp_path / "ckpt", (3,), prefill=24)
    tokens = torch.randint(4, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = []
    result = quantize_sequential(modules.core, tokens, each_linear(lambda name, w, h: seen.append(name)))
    driver = module_driver(modules)
    for sample, hidden in zip(tokens.tolist(), result.hidden, strict=True):
        driver.reset()
        tap = torch.from_numpy(driver.run("prefill", sample, 0)["taps"])
        torch.testing.assert_close(hidden, tap, rtol=1e-5, atol=1e-5)
    gdn = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
    attention = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    want = [f"model.layers.{i}.{n}" for i in range(args.num_hidden_layers)
            for n in (gdn if args.layer_types[i] == LINEAR else attention) + mlp]
    assert seen == want


def test_quantized_hybrid_keeps_the_gates_in_fp16(tmp_path):
    from convert.export.quantized import QuantizedLinear, apply_quantized
    from convert.inputs.recipe import Quantization
    from convert.weights.quantize import quantize_checkpoint

    write_checkpoint(tmp_path / "ckpt", hidden_size=64, intermediate_size=128, linear_key_head_dim=16,
                     linear_value_head_dim=16, head_dim=16)
    args, modules = modules_for(tmp_path / "ckpt")
    quant = Quantization(method="affine4", group_size=32)
    target = Target(source="path:x", graphs=Graphs(prefill=PREFILL, verify=VERIFY), context=CONTEXT)
    result = quantize_checkpoint(tmp_path / "ckpt", args, target, Layout(), quant, tmp_path)
    apply_quantized(modules.core, result.weights)
    linears = {name: m for name, m in modules.core.named_modules() if isinstance(m, torch.nn.Linear | QuantizedLinear)}
    kept = sorted(name for name, m in linears.items() if not isinstance(m, QuantizedLinear))
    assert kept == [f"layers.{i}.linear_attn.in_proj_{x}" for i in (0, 1, 2) for x in ("a", "b")]
    assert "embed_tokens" in result.weights and "lm_head" in result.weights
