"""Property tests (hypothesis) of what a person writes or copies: recipes and bundle manifests (issue #21). Whatever
the bytes or values, ``load_recipe``, ``read_manifest`` and the CLI (``build --dry-run``, ``inspect``) give their
result, or exit 1 / 2 with exactly one short line on stderr naming the file; never a traceback, never a written file.

- recipe YAML: a valid recipe mutated (a field set to a value of another type, a huge string or deep nesting; an
  unknown key; a key deleted; random bytes spliced into the text; a YAML alias bomb or a self-reference), and the
  release recipe's contract mutated (it plans from the contract when the checkpoint is not here);
- manifest JSON: a real target manifest's dict and a drafter manifest bound to it, mutated the same way, and the
  file's bytes cut or replaced.
"""

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_inputs import GOOD

from convert.cli import main
from convert.errors import InputError
from convert.inputs.recipe import load_recipe
from convert.pipeline.bundle import read_manifest
from tests.helpers.manifest_samples import drafter_manifest, target_manifest, write_bundle

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MESSAGE_LIMIT = 300  # characters of an error line beside the paths it names
RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DEEP = "__deep__"  # placeholders replaced in the YAML / JSON text (a nested value too deep for yaml.dump, an alias)
ALIAS = "__alias__"


def values():
    """Any value a tester writes into a field: numbers at the edges, strings short and huge, nesting."""
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(-3, 3), st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
        st.sampled_from(["", "0", "-1", "true", "path:", "hf://a/b@1234567", "fixture:eval", "[/bold]", "x" * 300]),
        st.integers(1000, 1_000_000).map(lambda n: "y" * n),
    )
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                        max_leaves=6)


def paths(data, prefix=()):
    """Every (path, value) of a JSON-like value: dict keys and list indices."""
    yield prefix, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield from paths(value, (*prefix, key))


def set_path(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@st.composite
def mutated(draw, base: dict) -> tuple[str, object]:
    """(how, a copy of ``base`` with one mutation); DEEP and ALIAS strings stand for what the text gets later."""
    data = copy.deepcopy(base)
    inner = [p for p, _ in paths(data) if p]
    mappings = [p for p, v in paths(data) if isinstance(v, dict)]
    how = draw(st.sampled_from(["set", "set", "set", "unknown", "delete", "deep", "alias"]))
    if how in ("set", "deep", "alias"):
        value = {"set": draw(values()), "deep": DEEP, "alias": ALIAS}[how]
        set_path(data, draw(st.sampled_from(inner)), value)
    elif how == "unknown":
        where = draw(st.sampled_from(mappings))
        key = draw(st.one_of(st.text(min_size=1, max_size=10), st.just("k" * 1_000_000)))
        node = data
        for part in where:
            node = node[part]
        node[key] = draw(values())
    else:
        path = draw(st.sampled_from([p for p in inner if isinstance(p[-1], str)]))
        node = data
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]
    return how, data


def yaml_text(draw, data) -> bytes:
    text = yaml.safe_dump(data, allow_unicode=True, width=10**9)
    if DEEP in text:
        depth = draw(st.sampled_from([10, 70, 1000]))
        text = text.replace(DEEP, "[" * depth + "]" * depth)
    if ALIAS in text:
        levels = draw(st.integers(1, 9))
        bomb = 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
        for i in range(1, levels):
            bomb += f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n"
        text = bomb + text.replace(ALIAS, f"*l{levels - 1}")
    raw = text.encode()
    if draw(st.integers(0, 5)) == 0:  # random bytes spliced in: not UTF-8, or not YAML
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    return raw


@st.composite
def recipes(draw) -> bytes:
    _, data = draw(mutated(yaml.safe_load(GOOD)))
    return yaml_text(draw, data)


RELEASE = yaml.safe_load((RECIPES / "dflash2_27b.yaml").read_text())


@st.composite
def release_recipes(draw) -> bytes:
    """The release recipe with its target or drafter contract mutated: a value set, a key added or deleted."""
    data = copy.deepcopy(RELEASE)
    role = draw(st.sampled_from(["target", "drafter"]))
    _, contract = draw(mutated(data[role]["contract"]))
    data[role]["contract"] = contract
    return yaml_text(draw, data)


def assert_refusal(result, *paths: str) -> None:
    """Exit 0, or exit 1 / 2 with one line on stderr of at most MESSAGE_LIMIT characters beside ``paths``; never an
    exception other than the exit."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)[:2000]
    assert result.exit_code in (0, 1, 2), result.output[-2000:]
    if result.exit_code == 0:
        return
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[:2000]
    rest = lines[0]
    for path in paths:
        rest = rest.replace(path, "")
    assert len(rest) <= MESSAGE_LIMIT, lines[0]


def dry_run_in(directory: Path, raw: bytes, ckpt: Path):
    """``build r.yaml --dry-run`` in ``directory``, with the checkpoint as path:ckpt."""
    (directory / "ckpt").symlink_to(ckpt)
    (directory / "r.yaml").write_bytes(raw)
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        return CliRunner().invoke(main, ["build", "r.yaml", "--dry-run"])
    finally:
        os.chdir(cwd)


@SETTINGS
@given(raw=recipes())
def test_build_dry_run_on_mutated_recipes(tiny_checkpoint, raw):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        result = dry_run_in(directory, raw, tiny_checkpoint)
        assert_refusal(result, str(directory), str(tiny_checkpoint))
        assert sorted(p.name for p in directory.iterdir()) == ["ckpt", "r.yaml"]  # no bundle, no partial one


@settings(SETTINGS, max_examples=10)  # a plan of the 27B pair takes about a second
@given(raw=release_recipes())
def test_build_dry_run_on_mutated_contracts(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "r.yaml").write_bytes(raw)
        result = CliRunner().invoke(main, ["build", str(Path(tmp) / "r.yaml"), "--dry-run"])
        assert_refusal(result, tmp)
        assert [p.name for p in Path(tmp).iterdir()] == ["r.yaml"]


@settings(SETTINGS, max_examples=60)
@given(raw=recipes())
def test_load_recipe_returns_a_recipe_or_one_line(raw):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.yaml"
        path.write_bytes(raw)
        try:
            load_recipe(path)
        except InputError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(str(path)), message[:2000]
            assert len(message.replace(str(path), "")) <= MESSAGE_LIMIT, message


TARGET = target_manifest()
DRAFTER = drafter_manifest(TARGET)


def json_text(draw, data) -> bytes:
    text = json.dumps(data)
    if DEEP in text:
        depth = draw(st.sampled_from([10, 500, 100_000]))
        text = text.replace(f'"{DEEP}"', "[" * depth + "]" * depth)
    text = text.replace(f'"{ALIAS}"', '"*alias"')  # JSON has no aliases: a plain string
    raw = text.encode("utf-8", "surrogatepass")
    cut = draw(st.integers(0, 8))
    if cut == 0:  # a truncated or garbled copy
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif cut == 1:
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    return raw


@st.composite
def manifests(draw) -> tuple[dict, bytes]:
    base = draw(st.sampled_from([TARGET, DRAFTER]))
    _, data = draw(mutated(base))
    return base, json_text(draw, data)


@SETTINGS
@given(sample=manifests())
def test_inspect_on_mutated_manifests(sample):
    base, raw = sample
    with tempfile.TemporaryDirectory() as tmp:
        bundle = write_bundle(Path(tmp) / "b", raw, files=base)
        before = sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*"))
        result = CliRunner().invoke(main, ["inspect", str(bundle)])
        assert_refusal(result, str(bundle))
        assert sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*")) == before  # inspect writes nothing


@settings(SETTINGS, max_examples=150)
@given(sample=manifests())
def test_read_manifest_validates_or_refuses_in_one_line(sample):
    base, raw = sample
    with tempfile.TemporaryDirectory() as tmp:
        bundle = write_bundle(Path(tmp) / "b", raw, files={})
        try:
            manifest = read_manifest(bundle)
        except InputError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(str(bundle)), message[:2000]
            assert len(message.replace(str(bundle), "")) <= MESSAGE_LIMIT, message
        else:
            assert manifest.kind in ("target", "drafter")


def test_the_strategies_reach_every_outcome():
    """The mutations are not all refused for one reason: the unmutated samples pass, and a field of the wrong type
    is refused by name (the properties above would hold vacuously otherwise)."""
    with tempfile.TemporaryDirectory() as tmp:
        bundle = write_bundle(Path(tmp) / "b", TARGET)
        assert CliRunner().invoke(main, ["inspect", str(bundle)]).exit_code == 0
        broken = copy.deepcopy(TARGET)
        broken["architecture"]["hidden_size"] = "wide"
        shutil.rmtree(bundle)
        bundle = write_bundle(Path(tmp) / "b", broken)
        result = CliRunner().invoke(main, ["inspect", str(bundle)])
        assert result.exit_code == 2 and "architecture.hidden_size" in result.stderr
