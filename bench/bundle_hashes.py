"""Every hash the manifests of built bundles record, to show that a change left the bundles' bytes alone.

    python -m bench.bundle_hashes recipes/tiny_qwen3.yaml ... --out DIR > hashes.json   # build each, uncached
    python -m bench.bundle_hashes --compare before.json after.json                      # exit 1 on any difference

Each recipe is built with ``--no-cache`` into ``DIR/<recipe stem>``; for every manifest.json in it, each value of a
``sha256`` or ``stable_hash`` field is recorded under its JSON path (packages' files, extra files, the identity
hashes of the tokenizer, lm_head and embeddings), the build time and toolchain left out, and so are the hashes the
manifest records of files whose bytes vary run to run (``RUN_TO_RUN``: ``records``, the gate report with its
timings; ``compile``, the device compile's outputs: the Core AI runtime's ODIX lowering of one .aimodel twice gave
two different .odix files, 2026-12-06). Neither is part of the export id.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RUN_TO_RUN = ("records", "compile")  # manifest keys whose hashes are of files that differ run to run


def hashes(value, path: str = "") -> dict[str, str]:
    found = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key in RUN_TO_RUN:
                continue
            if key in ("sha256", "stable_hash") or key.endswith("_sha256"):
                found[f"{path}.{key}"] = item
            else:
                found.update(hashes(item, f"{path}.{key}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.update(hashes(item, f"{path}[{index}]"))
    return found


def build_and_hash(recipe: Path, out: Path) -> dict[str, str]:
    bundle = out / recipe.stem
    subprocess.run([sys.executable, "-m", "convert", "build", str(recipe), "-o", str(bundle), "--no-cache"],
                   check=True, stdout=sys.stderr)  # stdout is this script's JSON
    found = {}
    for manifest in sorted(bundle.rglob("manifest.json")):
        name = manifest.parent.relative_to(bundle).as_posix()
        found.update({f"{name}{key}": value for key, value in hashes(json.loads(manifest.read_text())).items()})
    return found


def compare(before: dict, after: dict) -> int:
    differ = 0
    for recipe in sorted(set(before) | set(after)):
        a, b = before.get(recipe, {}), after.get(recipe, {})
        changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        print(f"{recipe}: {len(a)} hashes, {len(changed)} differ" + "".join(f"\n  {k}" for k in changed[:20]))
        differ += len(changed)
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, help="where the bundles are built")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    if not args.recipes or args.out is None:
        parser.error("give recipes and --out, or --compare BEFORE AFTER")
    print(json.dumps({r.stem: build_and_hash(r, args.out) for r in args.recipes}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
