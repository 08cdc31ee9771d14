"""`spec-convert compile BUNDLE`: finish the compile steps a build had to defer (e.g. on Linux).

Compile results live under ``compiled/`` of the bundle; the manifest's ``packages[].compile`` is
rewritten in place (atomically), every file of the outputs hashed (``CompileStep.files``, what ``verify`` checks).
The export id does not cover compile status, so it is unchanged.
"""

from __future__ import annotations

from pathlib import Path

from convert import backends
from convert.pipeline.bundle import COMPILED, MANIFEST, compiled_files, read_manifest, write_atomically
from manifests.schema import CompileStep


def compile_bundle(bundle: Path) -> list[str]:
    manifest = read_manifest(bundle)
    lines = []
    for package in manifest.packages:
        if all(step.status == "done" for step in package.compile):
            lines.append(f"{package.path}: already compiled")
            continue
        records = backends.load(package.format).compile(bundle / package.path, bundle / COMPILED)
        package.compile = [CompileStep(**vars(r), files=compiled_files(bundle, r.outputs)) for r in records]
        lines.extend(f"{package.path}: {r.kind} {r.status}" + (f" ({r.reason})" if r.reason else "") for r in records)
    write_atomically(bundle / MANIFEST, manifest.model_dump_json(indent=2) + "\n")
    return lines
