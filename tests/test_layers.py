"""The layout's layering rule, read from every import in the code (``ast``, function bodies included).

A module imports only its own package or a lower layer (``LAYERS``, lowest first; docs/development.md's layers say
the same), there are no import circles, and project imports sit at the top of their module: the CLI alone imports
the commands inside its functions (so that ``--help`` stays fast). Model families are leaves: a family imports the
primitives, the export specs, the inputs, the registry's shared pieces (``models/part.py``, ``models/layout.py``,
``models/drafting.py``), the manifest schema and a family it derives from, never the registry or a layer above.
``quant/`` imports nothing of ``convert``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("convert", "quant", "manifests")
LAYERS = (
    ("convert", "quant", "manifests", "convert.errors", "convert.progress", "convert.processes", "convert.fp16",
     "convert.fields", "convert.paths", "convert.torch_device"),
    ("convert.export", "convert.cache"),
    ("convert.inputs", "convert.backends"),
    ("convert.models",),
    ("convert.weights", "convert.runtime"),
    ("convert.verify",),
    ("convert.pipeline",),
    ("convert.commands", "convert.cli", "convert.__main__"),
)
# what a family may import besides its own folder's pieces: (family, the families it derives from)
FAMILY_BASES = {"qwen3": (), "qwen3_5": ("qwen3",), "mtp": ("qwen3", "qwen3_5"), "dflash2": ("qwen3",)}
FAMILY_MAY_IMPORT = ("convert.errors", "convert.fields", "convert.fp16", "convert.export", "convert.inputs",
                     "convert.models.part", "convert.models.layout", "convert.models.drafting", "manifests.schema")
LAZY_ALLOWED = ("convert.cli",)


def module_files() -> dict[str, Path]:
    files = {}
    for package in PROJECT:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    return files


MODULES = module_files()


def resolve(name: str) -> str | None:
    """The project module ``name`` names (a module, or a name inside one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, bool]]:
    """(imported project module, whether the import is inside a function) for each project import of ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name) if name.split(".")[0] in PROJECT else None
            if target and target != module:
                found.append((target, id(node) in inside))
    return found


def layer(module: str) -> int:
    """The row of the longest prefix in ``LAYERS`` that names ``module`` or a package above it."""
    rows = {prefix: index for index, row in enumerate(LAYERS) for prefix in row}
    named = [p for p in rows if module == p or module.startswith(p + ".") and p != "convert"] or \
        (["convert"] if module == "convert" else [])
    assert named, f"{module} is in no layer: add it to LAYERS (and to docs/development.md's file list)"
    return rows[max(named, key=len)]


def package(module: str) -> str:
    """The unit a module belongs to for 'its own package': a sub-package of convert (``convert.models``), a top
    package (``quant``), or, for a module at convert's top (``convert.cache``), the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "convert" else parts[0]


GRAPH = {module: imports(module) for module in MODULES}


def test_every_module_has_a_layer():
    assert len(MODULES) > 60
    for module in MODULES:
        layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    for target, _ in GRAPH[module]:
        if package(target) == package(module):
            continue
        assert layer(target) <= layer(module), f"{module} (layer {layer(module)}) imports {target} " \
                                               f"(layer {layer(target)}): an upward import"


def test_no_function_level_project_imports():
    lazy = [(module, target) for module, found in GRAPH.items() for target, inside in found
            if inside and module not in LAZY_ALLOWED]
    assert lazy == []


def test_no_import_circles():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target, _ in GRAPH[module]:
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("family", sorted(FAMILY_BASES))
def test_model_families_are_leaves(family):
    own = f"convert.models.{family}"
    allowed = FAMILY_MAY_IMPORT + tuple(f"convert.models.{base}" for base in FAMILY_BASES[family])
    mine = [m for m in MODULES if m == own or m.startswith(own + ".")]
    assert mine, f"no module for the family {family}"
    for module in mine:
        for target, _ in GRAPH[module]:
            if target == own or target.startswith(own + "."):
                continue
            assert any(target == a or target.startswith(a + ".") for a in allowed), f"{module} imports {target}"


def test_quant_imports_nothing_of_convert():
    for module in MODULES:
        if module.split(".")[0] == "quant":
            assert [t for t, _ in GRAPH[module] if t.startswith("convert")] == [], module


def test_the_walk_sees_imports_inside_functions():
    """The rule above is read from function bodies too: the CLI's lazy imports of the commands are found."""
    lazy = sorted({target for target, inside in GRAPH["convert.cli"] if inside})
    assert "convert.pipeline.build" in lazy and "convert.commands.accept" in lazy
    assert layer("convert.pipeline.build") > layer("convert.models")
