"""Issue #21, bad input: recipes, manifests, bundles and CLI arguments a tester mutated. Each is refused with one
short line on stderr naming the file or field, exit 2 (bad input) or 1 (a failed check), no traceback and no bundle.

One family a test (or a parametrized test): recipes (not UTF-8, contract values and dotted-key conflicts, gate
threshold names, YAML alias bombs and nesting, huge values), manifests given to ``inspect`` (binary, nested past the
parser, layer-less, a drafter's acceptance as a string, a 1 MB key, rich markup), bundle kinds (``gate -b`` with a
drafter bundle), CLI arguments (``accept --tokens -5``), and on a built target bundle: ``generate`` with a truncated
``main.mlirb`` or a deleted or truncated tokenizer, ``check-pair`` with a garbage ``embeddings.safetensors`` or
tokenizer.
"""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_inputs import GOOD

from convert.cli import main
from manifests.schema import DrafterManifest, Manifest
from tests.helpers.manifest_samples import drafter_manifest, target_manifest, write_bundle
from tests.helpers.recipes import gate, recipe, tiny_target

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
LINE_LIMIT = 300  # characters of an error line beside the paths it names


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, code: int, *needles: str, paths: tuple[str, ...] = ()) -> str:
    """The one stderr line of a refusal with exit ``code``; it holds every needle, and without ``paths`` it is at
    most ``LINE_LIMIT`` characters."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[:2000]
    line = lines[0]
    for needle in needles:
        assert needle in line, line
    rest = line
    for path in paths:
        rest = rest.replace(path, "")
    assert len(rest) <= LINE_LIMIT, line
    return line


@pytest.fixture
def workdir(tmp_path, tiny_checkpoint, monkeypatch):
    """A recipe's directory with the tiny checkpoint at path:ckpt, as the current directory."""
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def dry_run(workdir: Path, text: str | bytes):
    recipe = workdir / "r.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    return run("build", "r.yaml", "--dry-run")


# --- recipes -----------------------------------------------------------------------------------------------------


def test_a_recipe_that_is_not_utf8(workdir):
    result = dry_run(workdir, GOOD.encode().replace(b"name: t", b"name: t\xff\xfe"))
    refused(result, 2, "r.yaml", "not UTF-8", "byte 7")
    assert not (workdir / "out").exists()


CONTRACTS = {
    "negative": ("{hidden_size: -256}", "hidden_size: is -256; expected a positive integer (a size or count)"),
    "zero-heads": ("{num_attention_heads: 0}", "num_attention_heads: is 0; expected a positive integer"),
    "nested-zero": ("{text_config: {num_key_value_heads: 0}}", "text_config.num_key_value_heads: is 0; expected"),
    "string-size": ("{vocab_size: '4096'}", "vocab_size: is '4096'; expected a positive integer"),
    "negative-theta": ("{rope_theta: -1.0}", "rope_theta: is -1.0; expected a finite positive number"),
    "negative-tap": ("{dflash_config.target_layer_ids: [1, -2]}",
                     "dflash_config.target_layer_ids: is [1, -2]; expected a list of 0-based layer indices"),
    "dotted-and-nested": ("{text_config.hidden_size: 256, text_config: {hidden_size: 256}}",
                          ": 'text_config.hidden_size' and 'text_config' overlap"),
    "field-and-inside": ("{a.b: 1, a: 2}", ": 'a.b' and 'a' overlap"),
    "inside-and-field": ("{a: 2, a.b: 1}", ": 'a' and 'a.b' overlap"),
    "empty-part": ("{hidden_size.: 1}", ": key 'hidden_size.' is not a config.json field name"),
}


@pytest.mark.parametrize("name", CONTRACTS)
def test_target_contract_values(workdir, name):
    contract, message = CONTRACTS[name]
    result = dry_run(workdir, GOOD.replace("  context: 64\n", f"  context: 64\n  contract: {contract}\n"))
    refused(result, 2, "r.yaml: target.contract" + ("" if message.startswith(":") else ".") + message)


def test_a_drafter_contract_is_checked_the_same_way(workdir):
    text = GOOD + "drafter:\n  kind: mtp\n  contract: {num_hidden_layers: -1}\n"
    refused(dry_run(workdir, text), 2, "r.yaml: drafter.contract.num_hidden_layers: is -1; expected a positive integer")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("old, new, message", [
    ("text_config.hidden_size: 5120", "text_config.hidden_size: -5120",
     "target.contract.text_config.hidden_size: is -5120; expected"),
    ("text_config.num_attention_heads: 24", "text_config.num_attention_heads: 0",
     "target.contract.text_config.num_attention_heads: is 0; expected"),
    ("model_type: qwen3_5\n", "model_type: qwen3_5\n    model_type.x: 3\n", "'model_type' and 'model_type.x' overlap"),
    ("text_config.hidden_size: 5120", "text_config.hidden_size: 5120\n    text_config: {hidden_size: 5120}",
     "'text_config.hidden_size' and 'text_config' overlap"),
], ids=["negative", "zero-heads", "field-and-inside", "dotted-and-nested"])
def test_a_contract_planned_without_its_checkpoint(tmp_path, offline_hub, old, new, message):
    """The release recipe plans from its contract when its checkpoints are not here: these values were tracebacks
    there (a tensor of negative size, an item assignment on a string) or planned a model of 0 heads."""
    text = (RECIPES / "dflash2_27b.yaml").read_text()
    assert old in text
    (tmp_path / "r.yaml").write_text(text.replace(old, new, 1))
    line = refused(run("build", tmp_path / "r.yaml", "--dry-run"), 2, "target.contract", message,
                   paths=(str(tmp_path),))
    assert line.startswith(f"error: {tmp_path / 'r.yaml'}: ")


def test_a_misspelt_gate_threshold(workdir):
    result = dry_run(workdir, GOOD.replace("greedy_tokens: 4}", "greedy_tokens: 4, thresholds: {mean_kl_maxx: 0.1}}"))
    line = refused(result, 2, "r.yaml: target.gate.thresholds.mean_kl_maxx: unknown metric; one of ")
    assert "mean_kl_max, " in line and "top1_min" in line and "block_chain_real_flips_max" in line


def test_a_gate_threshold_out_of_its_bounds(workdir):
    result = dry_run(workdir, GOOD.replace("greedy_tokens: 4}", "greedy_tokens: 4, thresholds: {top1_min: 2}}"))
    refused(result, 2, "r.yaml: target.gate.thresholds.top1_min: Input should be less than or equal to 1 (got 2.0)")


def laughs(levels: int) -> str:
    """The "billion laughs": each level an anchored list of nine aliases of the one below (9^levels strings)."""
    text = 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for i in range(1, levels):
        text += f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n"
    return text


@pytest.mark.parametrize("where", ["name", "contract"])
def test_a_yaml_alias_bomb(workdir, where):
    """A recipe of a few hundred bytes naming a value of 9^9 strings: refused before anything is built from it (a
    contract takes any value, and its checks would walk all of it; the error would have echoed 310 KB)."""
    text = GOOD.replace("name: t\n", "name: *l8\n") if where == "name" else \
        GOOD.replace("  context: 64\n", "  context: 64\n  contract: {hidden_size: 256, extra: *l8}\n")
    refused(dry_run(workdir, laughs(9) + text), 2, "r.yaml: YAML of more than 10,000 values, an alias counted at "
            "each use (line 5)")


def test_a_recipe_of_too_many_values(workdir):
    refused(dry_run(workdir, GOOD + "x: [" + "1, " * 10_000 + "1]\n"), 2, "r.yaml: YAML of more than 10,000 values")


def test_a_small_alias_is_fine(workdir):
    text = GOOD.replace("gate: {data: {samples: 2, length: 32}, greedy_tokens: 4}",
                        "gate: {data: &d {samples: 2, length: 32}, greedy_tokens: 4}\n"
                        "  quantization: {calibration: *d}")
    assert "*d" in text
    result = dry_run(workdir, text)
    assert result.exit_code == 0, result.output


def test_yaml_nested_past_the_limit(workdir):
    refused(dry_run(workdir, GOOD + "x: " + "[" * 70 + "]" * 70 + "\n"), 2, "r.yaml", "nested more than 64 levels")
    refused(dry_run(workdir, GOOD + "x: " + "[" * 5000 + "]" * 5000 + "\n"), 2, "r.yaml", "YAML nested")


def test_a_self_containing_alias(workdir):
    refused(dry_run(workdir, GOOD + "x: &a [*a]\n"), 2, "r.yaml", "refers to a value that contains it")


@pytest.mark.parametrize("mutate, needles", [
    (lambda t: t.replace("name: t", "name: '" + "x/" * 500_000 + "'"), ["r.yaml: name: String should match",
                                                                        "(1000000 characters)"]),
    (lambda t: t.replace("context: 64", "context: 64\n  taps: [" + "1, " * 5_000 + "1]"),
     ["r.yaml: target.taps: duplicated layer index (got [1, 1, 1"]),
    (lambda t: t.replace("context: 64", "context: 64\n  ? " + "k" * 1_000_000 + "\n  : 1"), ["r.yaml: target.kkkk",
                                                                                             "...: unknown field"]),
    (lambda t: t.replace("verify: 8", "verify: " + "9" * 5000), ["r.yaml: a YAML value cannot be read (Exceeds the "
                                                                 "limit (4300 digits) for integer string conversion)"]),
    (lambda t: t.replace("verify: 8", "verify: " + "9" * 50), ["r.yaml: target.graphs.verify: 999999999999999999"
                                                               "9999999999999999999999... (50 characters) is out of "
                                                               "range (integers here are below 2**31)"]),
    (lambda t: t.replace("context: 64", "context: 64\n  contract: {x: [" + "9" * 50 + "]}"),
     ["r.yaml: target.contract: 9999999999999999999999999999999999999999... (50 characters) is out of range for a "
      "config.json value (64 bits)"]),
    (lambda t: t.replace("context: 64", "context: 64\n  max_part_mb: .inf"), ["target.max_part_mb: inf is not "
                                                                              "a finite number"]),
], ids=["1MB-name", "long-taps", "1MB-key", "5000-digits", "50-digits", "50-digit-pin", "infinite"])
def test_huge_values_are_not_echoed(workdir, mutate, needles):
    refused(dry_run(workdir, mutate(GOOD)), 2, *needles)


@pytest.mark.parametrize("command", [("--dry-run",), ("--output", "out/b")], ids=["dry-run", "build"])
def test_an_affine4_group_that_does_not_divide_a_width(workdir, command):
    """affine4 groups of 64 input columns on the tiny checkpoint, whose o_proj and down_proj take 96: refused at plan
    time naming the field, the weight and its width, and a group size that fits (the quantizer raised a ValueError
    mid-build)."""
    (workdir / "r.yaml").write_text(GOOD.replace("context: 64", "context: 64\n  quantization: {method: affine4, "
                                                 "group_size: 64}"))
    result = run("build", "r.yaml", *command)
    line = refused(result, 2, "target.quantization.group_size: 64 (affine4) does not divide the input width 96 of "
                   "layers.0.self_attn.o_proj (weight [64, 96]", "e.g. 32")
    assert "Traceback" not in result.output and "ValueError" not in line
    assert not (workdir / "out").exists()


def test_a_drafter_group_that_does_not_divide_a_width(tmp_path):
    """The drafter's own linears too: lut4 tables of 64 rows on the fixture DFlash2 drafter, whose selector
    projection has 32."""
    text = (RECIPES / "tiny_qwen3_dflash2.yaml").read_text().replace("path:../fixtures",
                                                                      f"path:{RECIPES.parent / 'fixtures'}")
    assert "  quantization: {method: lut4-gptq}" in text
    (tmp_path / "r.yaml").write_text(text.replace("  quantization: {method: lut4-gptq}",
                                                  "  quantization: {method: lut4, group_size: 64}"))
    result = run("build", tmp_path / "r.yaml", "--dry-run")
    refused(result, 2, "drafter.quantization.group_size: 64 (lut4) does not divide the output rows 32 of "
            "candidate_selector.hidden_projection (weight [32, 256]", "e.g. 16")


# --- manifests given to inspect ------------------------------------------------------------------------------------


def test_the_samples_match_the_schema():
    target = Manifest.model_validate(target_manifest())
    DrafterManifest.model_validate(drafter_manifest(target_manifest()))
    assert target.drafter_interface is not None and target.parts is None


def test_inspect_prints_a_sample(tmp_path):
    bundle = write_bundle(tmp_path / "b", target_manifest())
    result = run("inspect", bundle)
    assert result.exit_code == 0, result.output
    assert "tgt  export id" in result.stdout and "main.mlirb" not in result.stdout


def inspect_refusal(tmp_path: Path, manifest, code: int = 2, *needles: str) -> str:
    bundle = write_bundle(tmp_path / "b", manifest, files=target_manifest())
    return refused(run("inspect", bundle), code, f"{bundle / 'manifest.json'}", *needles, paths=(str(bundle),))


def test_inspect_a_binary_manifest(tmp_path):
    inspect_refusal(tmp_path, b"\x89PNG\r\n\x1a\n\x00\xff" * 100, 2, "not UTF-8 text (byte 0)")


def test_inspect_a_deeply_nested_manifest(tmp_path):
    inspect_refusal(tmp_path, "[" * 100_000 + "]" * 100_000, 2, "nested too deeply")
    nested = target_manifest()
    nested["gate"]["data"] = json.loads("[" * 500 + "]" * 500)
    inspect_refusal(tmp_path, nested, 2, "gate.data: Input should be a valid dictionary")


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["architecture"].update(num_layers=0), "architecture.num_layers: Input should be greater than or "
                                                       "equal to 1 (got 0)"),
    (lambda m: m.update(parts=[{"name": "p", "embedding_rows": None, "layers": [], "head_rows": None, "taps": [],
                                "functions": [], "packages": []}]), "parts.0.layers: a range [first, end)"),
    (lambda m: m.update(functions=[]), None),
], ids=["no-layers", "part-without-layers", "no-functions"])
def test_inspect_a_layerless_manifest(tmp_path, edit, needle):
    manifest = target_manifest()
    edit(manifest)
    if needle is None:  # printed: nothing there to index
        assert run("inspect", write_bundle(tmp_path / "b", manifest)).exit_code == 0
    else:
        inspect_refusal(tmp_path, manifest, 2, needle)


@pytest.mark.parametrize("acceptance, needle", [
    ({"tokens_per_round": "fast", "lossless": True}, "acceptance: tokens_per_round is str; expected a number"),
    ("3 tokens a round", "acceptance: Input should be a valid dictionary (got '3 tokens a round')"),
    ({"tokens_per_round": 2.0, "lossless": "yes"}, "acceptance: lossless is str; expected true or false"),
], ids=["tokens-string", "acceptance-string", "lossless-string"])
def test_inspect_a_drafter_whose_acceptance_is_a_string(tmp_path, acceptance, needle):
    manifest = drafter_manifest(target_manifest())
    manifest["acceptance"] = acceptance
    bundle = write_bundle(tmp_path / "d", manifest)
    refused(run("inspect", bundle), 2, needle, paths=(str(bundle),))
    manifest["acceptance"] = {"tokens_per_round": 2, "lossless": True}
    result = run("inspect", write_bundle(tmp_path / "d", manifest))
    assert result.exit_code == 0 and "acceptance: 2.000 tokens per round" in result.stdout


def test_inspect_a_manifest_with_a_1mb_key(tmp_path):
    manifest = target_manifest()
    manifest["architecture"]["h" * 1_000_000] = 1
    inspect_refusal(tmp_path, manifest, 2, "architecture.hhhhhhhh", "...: unknown field")
    text = json.dumps(target_manifest()).replace('"name": "tgt"', '"name": ' + "7" * 5000, 1)
    inspect_refusal(tmp_path, text, 2, "not JSON (Exceeds the limit (4300 digits)")


def test_inspect_prints_markup_as_text(tmp_path):
    manifest = target_manifest()
    manifest["name"] = "[/bold] [red]x"
    manifest["packages"][0]["check"]["note"] = "[/]"
    result = run("inspect", write_bundle(tmp_path / "b", manifest), "--details")
    assert result.exit_code == 0, result.output
    assert "[/bold] [red]x  export id" in result.stdout and "note=[/]" in result.stdout


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["extra_files"][0].update(path="../../etc/passwd"), "extra_files.0.path: a relative path inside"),
    (lambda m: m["extra_files"][0].update(path="/etc/passwd"), "extra_files.0.path: a relative path inside"),
    (lambda m: m["extra_files"][0].update(size=-1), "extra_files.0.size: Input should be greater than or equal to 0"),
    (lambda m: m["packages"][0].update(part="head"), "package 'tgt.aimodel': part 'head' is not one of the parts"),
], ids=["dotdot", "absolute", "size", "part"])
def test_inspect_refuses_records_off_the_schema(tmp_path, edit, needle):
    manifest = target_manifest()
    edit(manifest)
    inspect_refusal(tmp_path, manifest, 2, needle)


def test_inspect_names_a_missing_or_resized_file(tmp_path):
    bundle = write_bundle(tmp_path / "b", target_manifest())
    (bundle / "tgt.aimodel" / "main.mlirb").unlink()
    refused(run("inspect", bundle), 2, "tgt.aimodel/main.mlirb: missing, the manifest's packages[0].files[1] records "
            "it", paths=(str(bundle),))
    write_bundle(bundle, target_manifest())
    (bundle / "lm_head.safetensors").write_bytes(b"x")
    refused(run("inspect", bundle), 1, "lm_head.safetensors: 1 bytes, the manifest's drafter_interface.lm_head_file "
            "records 524,368", paths=(str(bundle),))


# --- bundle kinds and CLI arguments ----------------------------------------------------------------------------------


def test_gate_given_a_drafter_bundle(tmp_path):
    drafter = write_bundle(tmp_path / "drafter", drafter_manifest(target_manifest()))
    result = run("gate", RECIPES / "tiny_qwen3.yaml", "-b", drafter, "--report", tmp_path / "report.json")
    refused(result, 2, f"{drafter}: a drafter bundle; gate --bundle takes a target bundle", paths=(str(drafter),))
    assert not (tmp_path / "report.json").exists()


def test_gate_never_replaces_a_file_that_is_not_its_report(tmp_path):
    """``-r`` is ``--recipe`` wherever it exists (``generate``); ``gate --report`` refuses a path holding anything but
    a gate report, before any work, and leaves it as it was."""
    other = tmp_path / "other.yaml"
    other.write_text("name: mine\n")
    refused(run("gate", RECIPES / "tiny_qwen3.yaml", "--report", other), 2,
            f"{other}: holds something that is not a gate report; give --report a new path", paths=(str(other),))
    assert other.read_text() == "name: mine\n"
    assert run("gate", RECIPES / "tiny_qwen3.yaml", "-r", other).exit_code == 2  # no such option
    assert other.read_text() == "name: mine\n"


def test_generate_given_a_drafter_bundle(tmp_path):
    drafter = write_bundle(tmp_path / "drafter", drafter_manifest(target_manifest()))
    refused(run("generate", drafter, "-p", "x"), 2, "a drafter bundle; generate", paths=(str(drafter),))


@pytest.mark.parametrize("option", ["--tokens", "--prompts"])
def test_accept_negative_counts(option):
    result = run("accept", RECIPES / "tiny_qwen3_dflash2.yaml", option, "-5")
    refused(result, 2, f"Invalid value for '{option}': -5 is not in the range x>=1", "accept --help)")


def test_usage_errors_are_one_line():
    refused(run("build"), 2, "Missing argument 'RECIPE'")
    refused(run("generate", "b", "-p", "x", "--runtime", "y" * 100_000), 2, "Invalid value for '--runtime'")
    result = run("--help")
    assert result.exit_code == 0 and "Usage:" in result.stdout


# --- a built target bundle -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_bundle(tmp_path_factory):
    """A tiny target built the normal way, with the drafter interface (taps): .aimodel, tokenizer, embeddings."""
    from tests.helpers.checkpoints import write_checkpoint

    tmp = tmp_path_factory.mktemp("bad-bundles")
    write_checkpoint(tmp / "ckpt", hidden_size=64, num_hidden_layers=4)
    # random weights have near-flat logits: fp16 rounding flips a few argmax ids
    bars = gate(2, 48, greedy_tokens=8, top1_min=0.95, greedy_match_min=0.5)
    path = recipe(tmp, "tgt", target=tiny_target(tmp / "ckpt", taps=[0, 2, 3], gate=bars), backends=["coreai"])
    result = run("build", path, "--output", tmp / "tgt")
    assert result.exit_code == 0, result.output
    return tmp / "tgt"


@pytest.fixture
def bundle_copy(target_bundle, tmp_path):
    shutil.copytree(target_bundle, tmp_path / "tgt")
    return tmp_path / "tgt"


@pytest.mark.slow
def test_generate_refuses_a_truncated_package(bundle_copy):
    """The Core AI runtime aborts the process (SIGABRT, no message) on a truncated main.mlirb: it never sees one."""
    program = bundle_copy / "tgt.aimodel" / "main.mlirb"
    with program.open("r+b") as f:
        f.truncate(program.stat().st_size // 2)
    refused(run("generate", bundle_copy, "-p", "def f"), 1, "tgt.aimodel/main.mlirb: ", "bytes, the manifest's "
            "packages[0].files[1] records", "truncated", paths=(str(bundle_copy),))


@pytest.mark.slow
def test_generate_refuses_a_package_its_main_hash_disowns(bundle_copy):
    """A main.mlirb changed and the manifest's records rewritten to match: the package's own main.hash refuses it."""
    program = bundle_copy / "tgt.aimodel" / "main.mlirb"
    data = bytearray(program.read_bytes())
    data[len(data) // 2] ^= 0xFF
    program.write_bytes(bytes(data))
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    from manifests.identity import file_sha256

    manifest["packages"][0]["files"][1]["sha256"] = file_sha256(program)
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    refused(run("generate", bundle_copy, "-p", "def f"), 1, "main.mlirb: its sha256 is not the one main.hash records",
            paths=(str(bundle_copy),))


@pytest.mark.slow
@pytest.mark.parametrize("damage, code, needle", [
    (lambda b: shutil.rmtree(b / "tokenizer"), 2, "tokenizer/tokenizer.json: missing, the manifest's extra_files"),
    (lambda b: (b / "tokenizer" / "tokenizer.json").write_text('{"model": '), 1,
     "tokenizer/tokenizer.json: 10 bytes, the manifest's extra_files"),
    (lambda b: (b / "tokenizer" / "tokenizer_config.json").write_bytes(
        b"\0" * (b / "tokenizer" / "tokenizer_config.json").stat().st_size), 1,
     "tokenizer/tokenizer_config.json: its sha256 differs from the manifest's extra_files"),
], ids=["deleted", "truncated", "garbage"])
def test_generate_refuses_a_damaged_tokenizer(bundle_copy, damage, code, needle):
    damage(bundle_copy)
    refused(run("generate", bundle_copy, "-p", "def f"), code, needle, paths=(str(bundle_copy),))


@pytest.mark.slow
def test_generate_runs_the_undamaged_bundle(target_bundle):
    result = run("generate", target_bundle, "-p", "def f", "-n", "3", "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["generated_ids"]) == 3


@pytest.fixture
def drafter_of(target_bundle, tmp_path):
    """A drafter manifest bound to the built target (its records copied whole, the mask row hashed): check-pair
    passes until the target is damaged."""
    from manifests.identity import embedding_row_sha256

    target = json.loads((target_bundle / "manifest.json").read_text())
    row = embedding_row_sha256(target_bundle / "embeddings.safetensors", 3)
    return write_bundle(tmp_path / "drafter", drafter_manifest(target, row))


@pytest.mark.slow
@pytest.mark.parametrize("damage, needle", [
    (lambda b: (b / "embeddings.safetensors").write_bytes(b"\xff" * 4096),
     "target.drafter_interface.embeddings_file.sha256: embeddings.safetensors in the bundle hashes to"),
    (lambda b: (b / "embeddings.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}garbage"),
     "target.drafter_interface.embeddings_file.sha256"),
    (lambda b: (b / "tokenizer" / "tokenizer.json").write_bytes(b"\x00garbage\xff"),
     "target.tokenizer: tokenizer/tokenizer.json in the bundle is not a readable tokenizer"),
    (lambda b: (b / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}'),
     "target.tokenizer: tokenizer/tokenizer.json in the bundle is not a readable tokenizer"),
], ids=["embeddings-bytes", "embeddings-header", "tokenizer-bytes", "tokenizer-json"])
def test_check_pair_with_garbage_files(drafter_of, bundle_copy, damage, needle):
    assert run("check-pair", drafter_of, bundle_copy).exit_code == 0
    damage(bundle_copy)
    result = run("check-pair", drafter_of, bundle_copy)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    assert needle in result.stderr.splitlines()[-1]  # the mismatches, then the one error line
    assert all(line.startswith(("mismatch: ", "error: ")) for line in result.stderr.splitlines())


@pytest.mark.slow
def test_generate_refuses_a_manifest_without_its_functions(bundle_copy):
    """A layer-less manifest the schema takes (no functions): generate names what it needs instead of indexing."""
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["functions"] = [f for f in manifest["functions"] if f["name"] != "decode"]
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    refused(run("generate", bundle_copy, "-p", "def f"), 2, "manifest.json functions: no decode function",
            paths=(str(bundle_copy),))
    manifest["functions"][0]["inputs"] = []
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    refused(run("generate", bundle_copy, "-p", "def f"), 2, "manifest.json functions[0] ('prefill'): no position_ids, "
            "input_ids or hidden_states input [1, S, ...]", paths=(str(bundle_copy),))


def test_an_output_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    """A file where the output's folder must be: exit 2, one line naming it, nothing built or left beside it."""
    blocker = tmp_path / "afile"
    blocker.write_text("mine\n")
    out = blocker / "bundle"
    refused(run("build", RECIPES / "tiny_qwen3.yaml", "--output", out), 2,
            f"output {out}: cannot be written there ({blocker} is a file, not a folder)",
            paths=(str(out), str(blocker)))
    assert blocker.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
