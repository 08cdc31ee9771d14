"""The numeric gate as a build stage: its report kept in the build cache (``gate``) and, for a streamed gate, its
passes' windows as soon as each is computed (``GatePasses``), so that a build run again, or resumed in a later
session, starts after them (at 27B the gate takes hours)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from convert import cache as build_cache
from convert import progress
from convert.cache import BuildCache
from convert.pipeline.plan import Plan
from convert.progress import console, stage
from convert.torch_device import cache_key
from convert.verify import gates
from convert.verify.report import GateReport
from manifests.identity import REPORT_FILE

GATE_STAGE = "gate"
GATE_PASSES_STAGE = "gate-passes"
GATE_TOOLCHAIN = ("torch", "transformers", "tokenizers", "numpy")


def gate(plan: Plan, cache: BuildCache, source_files, compute: Callable[[GatePasses | None, tuple], GateReport],
         report_path: Path | None) -> GateReport:
    """The numeric gate (``compute(passes, settings)``: the target against the transformers reference on
    ``gates.recipe_gate``'s thresholds and data, computed once here); prints its table; fails
    closed (``GateError``) after writing the report to ``report_path`` when given. The report is kept in ``cache``
    under a key of everything it was computed from (the source files, the recipe's target section, the gate data and
    thresholds, the toolchain, the build's code) and restored from there when a build is run again: at 27B the gate
    takes hours, and a build resumed in a later session starts after it; a streamed gate stopped part way keeps its
    candidate's and reference's windows (``GatePasses``)."""
    settings = thresholds, data = gates.recipe_gate(plan)
    progress.phase("numeric gate")
    if not cache.enabled:
        report = compute(None, settings)
    else:
        entry_key = build_cache.key({
            "stage": GATE_STAGE, "code": build_cache.code_fingerprint(("convert.pipeline.build",)),
            "versions": build_cache.versions(GATE_TOOLCHAIN), "sources": {r.path: r.sha256 for r in source_files},
            "target": plan.recipe.target.model_dump(mode="json"), "data": data.identity.model_dump(),
            "thresholds": thresholds.model_dump(), **cache_key(plan.torch_device)})
        entry = cache.get(GATE_STAGE, entry_key)
        if entry is not None:
            with stage(f"numeric gate: restored from the cache (computed in {entry.meta['seconds']:.0f} s)"):
                report = GateReport.model_validate_json(entry.path(REPORT_FILE).read_text())
        else:
            passes = GatePasses(cache.root, entry_key)
            report = compute(passes, settings)
            cache.put(GATE_STAGE, entry_key, lambda d: _stored_report(d, report))
            passes.discard()  # the report holds what they were for (at 27B they are 8 GB of logits)
    print_gate(report, report_path)
    return report


@dataclass(frozen=True)
class GatePasses:
    """``gates.run_streamed_gates``'s ``keep``: the streamed gate's candidate, device-pass and reference windows, each a
    build cache entry (stage ``GATE_PASSES_STAGE``, under the gate's key) as soon as it is computed, restored from
    there when the gate runs again, their logits mapped from the entry's file. Picklable: the gate of a large target
    runs in a process of its own."""

    root: Path
    gate_key: str

    def __call__(self, name: str, compute: Callable[[], list]) -> list:
        cache = BuildCache(self.root)
        windows = cache.get_object(GATE_PASSES_STAGE, self._key(name), mmap=True)
        if windows is not None:
            console.print(f"  numeric gate: the {name}'s windows restored from the cache")
            return windows
        windows = compute()
        cache.put_object(GATE_PASSES_STAGE, self._key(name), windows, {"passes": name})
        return windows

    def discard(self) -> None:
        cache = BuildCache(self.root)
        for name in ("candidate", "device", "reference"):
            cache.remove(GATE_PASSES_STAGE, self._key(name))

    def _key(self, name: str) -> str:
        return build_cache.key({"gate": self.gate_key, "passes": name})


def _stored_report(directory: Path, report: GateReport) -> dict:
    report.write_json(directory / REPORT_FILE)
    return {"seconds": report.seconds}


def print_gate(report: GateReport, report_path: Path | None) -> None:
    """Print the gate's table; fail closed (``GateError``) after writing the report to ``report_path`` if given."""
    console.print(report.table())
    if report_path is not None and not report.passed:
        report.write_json(report_path)
    report.raise_if_failed()
