"""``spec-convert gate``: a recipe's target gated on its own, and with ``--bundle`` the bundle's packages on the
Core AI runtime, after checking the weights rebuilt from the recipe are the bundle's."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from convert.cache import BuildCache
from convert.commands.inspect import open_target
from convert.errors import InputError
from convert.pipeline import build
from convert.pipeline.build import parts_loader, shipped_modules, tables_part
from convert.pipeline.plan import make_plan
from convert.progress import console, stage
from convert.runtime.chain import coreai_target, manifest_parts, module_chain
from convert.verify import gates
from convert.verify.report import GateReport
from convert.weights.target import TargetModules
from manifests import identity
from manifests.schema import Manifest


def check_report_path(path: Path) -> None:
    """Refuse a ``--report`` path that holds anything but a gate report (a report run again is replaced; nothing else
    is ever overwritten), before any work."""
    if not path.exists():
        return
    if path.is_file():
        try:
            GateReport.model_validate_json(path.read_text())
            return
        except (ValueError, UnicodeDecodeError):
            pass
    raise InputError(f"{path}: holds something that is not a gate report; give --report a new path (nothing was "
                     "written)")


def gate_bundle(recipe_path: Path, bundle: Path | None, report_path: Path | None = None) -> GateReport:
    """``spec-convert gate``: the statistical gate on modules rebuilt from the recipe, and with a bundle the
    artifact gate on its .aimodel, after checking the rebuilt weights are the bundle's (lm_head, embeddings). A
    parted target is gated layer by layer; its parts are chained on the runtime up to ``CHAINED_RUN_PARAMETERS``
    (above, the build's per-part replays are its artifact check). The table is printed; the report is written to
    ``report_path`` only when given (never into the bundle: its manifest hashes its files), pass or fail."""
    manifest = open_target(bundle, "gate --bundle", ("coreai",)) if bundle is not None else None
    plan = make_plan(recipe_path)
    names = [p.path for p in manifest.packages if p.format == "coreai"] if manifest else []
    if manifest is not None and bool(manifest.parts) != (len(plan.parts) > 1):
        raise InputError(f"{bundle}: ships {len(manifest.parts or []) or 'one package per format, not'} parts, and "
                         f"{recipe_path} plans {len(plan.parts)}; use the recipe the bundle was built from")
    with ExitStack() as stack:
        if len(plan.parts) > 1:
            loader = parts_loader(plan, BuildCache(), stack)
            report = gates.gate_streamed(plan, loader)
            modules = loader.load([tables_part(plan.args)])[0]
        else:
            modules, _ = shipped_modules(plan)
            report = gates.gate_target(plan, modules)
        if manifest is not None:
            weights_match(manifest, modules, bundle, recipe_path)
        if names and manifest.parts and plan.parameter_count <= build.CHAINED_RUN_PARAMETERS:
            parts = manifest_parts(manifest)
            reference = module_chain(parts, loader.load(parts), plan.recipe.target.taps)
            with stage(f"artifact gate: {len(names)} parts chained on the Core AI runtime"), \
                    coreai_target(bundle, manifest) as runtime:
                report.artifact = gates.lockstep_result(runtime, reference, loader.outline, ", ".join(names),
                                                        gates.PARTS_CHAINED)
        elif names and manifest.parts:
            console.print(f"  artifact gate not rerun: above {build.CHAINED_RUN_PARAMETERS:,} parameters the build "
                          "replays each part on the runtime (the bundle's gate_report.json)")
        elif names:
            with stage(f"artifact gate: {names[0]} on the Core AI runtime"):
                report.artifact = gates.artifact_gate(bundle / names[0], modules)
    console.print(report.table())
    if report_path is not None:
        report.write_json(report_path)
    report.raise_if_failed()
    return report


def weights_match(manifest: Manifest, modules: TargetModules, bundle: Path, recipe_path: Path) -> None:
    """Refuse modules rebuilt from ``recipe_path`` whose shipped tables are not the bundle's (lm_head, embeddings)."""
    for field, tensor in (("lm_head_sha256", modules.core.lm_head.weight),
                          ("embedding_sha256", modules.core.embed_tokens.weight)):
        if getattr(manifest.weights, field) != identity.tensor_sha256(tensor):
            raise InputError(f"{bundle}: weights.{field} differs from the weights {recipe_path} builds; use the "
                             "recipe the bundle was built from")
