"""The docs a person reads: their sizes, no path outside the repository, links that resolve, and the README's headline
figures for the release recipes equal to what ``spec-convert build RECIPE --dry-run`` plans."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 12_288  # bytes: what it is, set-up, install, quick start, headline tables, commands, links
BENCHMARKS_LIMIT = 15_360  # bytes: the current numbers by topic; the dated investigations live in docs/lab/
RELEASE_RECIPES = ("recipes/bonsai2_27b_dflash2.yaml", "recipes/dflash2_27b.yaml", "recipes/qwen3_mtp_27b.yaml")

# a machine's own paths: the checkout's parent, home directories, the temporary directory (spelt in pieces so that
# this file does not hold them itself)
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:" + "|".join(["work", "home", "tmp"]) + r")/")
OUTSIDE = "../" + "shared"
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def repository_files(*suffixes: str) -> list[Path]:
    """Tracked files and new ones git does not ignore, with one of ``suffixes``."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sorted({ROOT / name for name in listed if name.endswith(suffixes) and (ROOT / name).is_file()})


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_sizes():
    assert README.stat().st_size <= README_LIMIT, f"README.md is {README.stat().st_size:,} bytes: move detail to docs/"
    size = (DOCS / "benchmarks.md").stat().st_size
    assert size <= BENCHMARKS_LIMIT, f"docs/benchmarks.md is {size:,} bytes: move investigations to docs/lab/"


def test_no_path_outside_the_repository():
    found = []
    for path in repository_files(".md", ".py", ".yaml"):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE in line or MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "paths outside the repository (name the public source instead):\n" + "\n".join(found)


def test_relative_links_resolve():
    broken = []
    for page in markdown_pages():
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # https:, mailto:, an anchor
                continue
            name, _, anchor = target.partition("#")
            resolved = (page.parent / name).resolve()
            if not resolved.exists() or not resolved.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that resolve to no file or heading of the repository:\n" + "\n".join(broken)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated one
    numbered."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug if slug not in seen else f"{slug}-{seen[slug]}"] = 0
        seen[slug] = seen.get(slug, 0) + 1
    return set(seen)


def readme_release_table() -> dict[str, tuple[float, int]]:
    """The README's release-recipe rows: recipe -> (target weights per format in GiB, parts)."""
    rows: dict[str, tuple[float, int]] = {}
    header: list[str] | None = None
    for line in README.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip().strip("`").lower() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        weights = next((i for i, name in enumerate(header) if "weights" in name), None)
        parts = next((i for i, name in enumerate(header) if name == "parts"), None)
        if weights is None or parts is None or not cells[0].startswith("recipes/"):
            continue
        size = re.search(r"([\d.]+)\s*gib", cells[weights])
        count = re.search(r"\d+", cells[parts])
        assert size and count, f"README: the row of {cells[0]} has no GiB size or part count: {line}"
        rows[cells[0]] = (float(size.group(1)), int(count.group(0)))
    return rows


def dry_run(recipe: str, monkeypatch, cache: Path) -> str:
    """What ``spec-convert build RECIPE --dry-run`` prints, with an empty Hugging Face cache and no network: the
    release recipes are planned from their contracts, the same on every machine."""
    from convert.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, ["build", recipe, "--dry-run"])
    assert result.exit_code == 0, f"{recipe} --dry-run exited {result.exit_code}: {result.output[-2000:]}"
    return result.output


def planned_numbers(output: str, recipe: str) -> tuple[str | None, float | None, int]:
    """From a dry run's output: the target's shipped weights per format as printed in GiB (e.g. '6.38'; the detailed
    plan's line), else in GB (the summary's 'N GB of weights a format'), and the number of parts."""
    gib = re.search(r"shipped weights:?\s*([\d.]+)\s*GiB", output) or re.search(r"([\d.]+)\s*GiB per format", output)
    gb = re.search(r"([\d.]+)\s*GB of weights a format", output)
    count = re.search(r"\bparts:?\s*(\d+)", output) or re.search(r"\b(\d+) parts\b", output)
    assert (gib or gb) and count, f"{recipe}: the dry run prints no shipped weights or parts:\n{output[:2000]}"
    return (gib.group(1) if gib else None), (float(gb.group(1)) if gb else None), int(count.group(1))


def plan_object_numbers(recipe: str) -> tuple[str, int] | None:
    """The same two numbers from the plan's own objects (the path ``describe_contract`` takes), or None where those
    internals moved (the dry run's output is then the check)."""
    try:
        from convert.export.spec import size_text
        from convert.inputs.contract import as_config
        from convert.inputs.recipe import load_recipe
        from convert.models import family_for
        from convert.pipeline.partition import piece_sizes, plan_parts

        target = load_recipe(ROOT / recipe).target
        pinned = as_config(target.contract)
        args = family_for(pinned, recipe).Args.from_config(pinned, recipe)
        total = piece_sizes(args, target).total(args.vocab_size, args.tie_word_embeddings)
        parts = plan_parts(args, target)
    except (ImportError, AttributeError, TypeError):
        return None
    size = re.match(r"([\d.]+) GiB", size_text(total))
    return (size.group(1), len(parts)) if size else None


@pytest.mark.slow
def test_readme_release_figures_agree_with_the_dry_run(monkeypatch, tmp_path):
    table = readme_release_table()
    assert set(table) == set(RELEASE_RECIPES), f"README's release table lists {sorted(table)}"
    for recipe in RELEASE_RECIPES:
        gib, gb, parts = planned_numbers(dry_run(recipe, monkeypatch, tmp_path), recipe)
        readme_size, readme_parts = table[recipe]
        assert readme_parts == parts, f"README says {recipe} ships in {readme_parts} parts; its dry run plans {parts}"
        if gib is not None:
            assert readme_size == float(gib), f"README says {recipe} ships {readme_size} GiB; its dry run {gib} GiB"
        else:  # the summary's GB, to one decimal
            assert abs(readme_size * 2**30 / 1e9 - gb) <= 0.051, f"README: {recipe} {readme_size} GiB; dry run {gb} GB"
        from_plan = plan_object_numbers(recipe)
        if from_plan is not None:
            assert from_plan == (f"{readme_size:.2f}", readme_parts), f"{recipe}: the plan objects give {from_plan}"
