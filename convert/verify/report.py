"""The gate's report: what the numeric gate measured (``convert.verify.gates``), as ``gate_report.json`` holds it.

``GateReport``: the evaluation data's identity, every metric against its bar, the block-vs-chain flips, the
candidates not run here, and the second candidate's (``DevicePass``, with its range verdict ``RangeReport``) and the
artifact gate's (``ArtifactResult``) results; its table, its JSON, and what a manifest records of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, computed_field
from rich.table import Table

from convert.errors import GateError
from convert.fp16 import Peaks, limits
from convert.inputs.thresholds import GateThresholds
from manifests.schema import Rescale

# What an artifact gate ran (ArtifactResult.scope): a whole target's run (a parted target's: ``gates.PARTS_CHAINED``,
# ``gates.PARTS_REPLAYED``)
WHOLE_RUN = "the .aimodel in lockstep with the torch modules: prefill, decodes, a verify after a rollback"


class EvalIdentity(BaseModel):
    """What the gate evaluated on; goes into the report and the manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: str
    corpus_sha256: str
    n: int
    length: int
    seed: int


class Metric(BaseModel):
    name: str
    value: float
    threshold: float | None  # None: reported, not gated
    bound: Literal["max", "min"] | None
    passed: bool

    @classmethod
    def gated(cls, name: str, value: float, threshold: float, bound: Literal["max", "min"]) -> Metric:
        """A NaN value fails either way (both comparisons are false)."""
        passed = value <= threshold if bound == "max" else value >= threshold
        return cls(name=name, value=value, threshold=threshold, bound=bound, passed=bool(passed))

    def failure(self) -> str:
        """The failed metric as the failure line names it: its value and the bound it broke."""
        return f"{self.name} {self.value:.4g} {'>' if self.bound == 'max' else '<'} {self.threshold:.4g}"

    def cells(self) -> tuple[str, str, str]:
        """The table's threshold, value and result cells."""
        threshold = "-" if self.threshold is None else f"{'<=' if self.bound == 'max' else '>='} {self.threshold:.4g}"
        result = "info" if self.threshold is None else ("pass" if self.passed else "[red]FAIL[/red]")
        return threshold, f"{self.value:.6g}", result


class Flip(BaseModel):
    """A probe position where ``verify`` and the ``decode`` chain chose different ids."""

    sample: int
    position: int
    block_id: int
    chain_id: int
    gap: float  # logits: the larger of the two computations' gaps between the two ids
    near_tie: bool


class NotRun(BaseModel):
    what: str
    reason: str


# What the range verdict judges: every product's input and output port and every module's output (a decoder layer's:
# the residual stream after it); other stored intermediates are not (a silu's exp may rightly overflow to inf), but
# one past fp16 shows at the input of the product that reads it.
JUDGED_KINDS = ("input", "port", "output")
TIGHTEST_SHOWN = 8


class RangeEntry(BaseModel):
    """One tensor's largest magnitude in the device pass against its limit (``tensor``: the module that computed it,
    by its qualified name; ``kind``: ``input``, ``port`` or ``output``, ``convert.fp16.Peaks``)."""

    tensor: str
    kind: str
    peak: float
    limit: float
    nonfinite: int = 0

    @computed_field
    @property
    def headroom(self) -> float:
        """limit / peak (above 1: inside the limit)."""
        return self.limit / self.peak if self.peak > 0 else float("inf")

    @property
    def over(self) -> bool:
        return self.nonfinite > 0 or self.peak > self.limit

    def phrase(self) -> str:
        what = f"{self.tensor} ({self.kind})"
        if self.nonfinite:
            return (f"{what}: {self.nonfinite} values past fp16 (inf or NaN; the largest finite {self.peak:.6g}, "
                    f"limit {self.limit:.6g})")
        return f"{what}: peak {self.peak:.6g} > limit {self.limit:.6g}"


class RangeReport(BaseModel):
    """The range verdict of a device pass: every judged tensor's peak against its limit (a product's port: 32,768 on
    the ANE, fp16's 65,504 on the GPU; a product's input and a module's output: 65,504), in the order computed."""

    device: str
    limits: dict[str, float]
    checked: int
    over: list[RangeEntry]
    tightest: list[RangeEntry]

    @computed_field
    @property
    def passed(self) -> bool:
        return not self.over

    def over_phrase(self) -> str:
        """The first tensor over its limit, and how many more (a failed verdict's words)."""
        more = len(self.over) - 1
        return f"{self.over[0].phrase()}{f' (and {more} more)' if more else ''}"

    @classmethod
    def of(cls, device: str, peaks: Peaks) -> RangeReport:
        bounds = limits(device)
        entries = [RangeEntry(tensor=name, kind=kind, peak=peak, limit=bounds[kind],
                              nonfinite=peaks.nonfinite.get((name, kind), 0))
                   for (name, kind), peak in peaks.peaks.items() if kind in JUDGED_KINDS]
        return cls(device=device, limits=bounds, checked=len(entries), over=[e for e in entries if e.over],
                   tightest=sorted(entries, key=lambda e: e.headroom)[:TIGHTEST_SHOWN])


class DevicePass(BaseModel):
    """The gate's second candidate: the shipped fp16 modules computed in the arithmetic of the device the recipe's
    layout targets (``convert.fp16.DeviceArithmetic``) on the first ``windows`` windows, against the same fp32
    reference, with its own bars and a range verdict."""

    device: str
    windows: int
    metrics: list[Metric]
    range: RangeReport
    seconds: float

    @computed_field
    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics) and self.range.passed

    def failures(self) -> list[str]:
        failed = [f"device pass ({self.device}) {m.failure()}" for m in self.metrics if not m.passed]
        if self.range.over:
            failed.append(f"range ({self.device}): {self.range.over_phrase()}")
        return failed


class ArtifactResult(BaseModel):
    """The shipped ``.aimodel`` on the Core AI runtime in lockstep with the modules (``checks.run_coreai``), or a
    parted target's packages (``artifact_of_parts``); ``scope`` says which run it was."""

    package: str
    passed: bool
    scope: str = WHOLE_RUN
    error: str | None = None
    runtime_calls: int = 0
    argmax_compared: int = 0
    argmax_near_ties: int = 0
    max_output_delta: float = 0.0
    reference_compared: int = 0
    reference_near_ties: int = 0
    greedy_ids: list[int] = []  # the package's greedy run (``checks.check_calls``), when it made one
    seconds: float


class GateReport(BaseModel):
    thresholds: GateThresholds
    data: EvalIdentity
    candidate: str
    greedy_tokens: int
    metrics: list[Metric]
    flips: list[Flip]
    artifact: ArtifactResult | None = None
    device: DevicePass | None = None
    rescale: Rescale | None = None
    not_run: list[NotRun]
    seconds: float

    @computed_field
    @property
    def passed(self) -> bool:
        return (all(m.passed for m in self.metrics) and (self.artifact is None or self.artifact.passed)
                and (self.device is None or self.device.passed))

    def failures(self) -> list[str]:
        """One phrase per failed check: metric, value, the bound it broke."""
        failed = [m.failure() for m in self.metrics if not m.passed]
        if self.device is not None:
            failed += self.device.failures()
        if self.artifact is not None and not self.artifact.passed:
            failed.append(f"artifact {self.artifact.package}: {self.artifact.error}")
        return failed

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise GateError(f"numeric gate failed: {'; '.join(self.failures())}")

    def table(self) -> Table:
        table = Table(title=f"numeric gate: {'PASS' if self.passed else 'FAIL'} ({self.data.corpus}, "
                            f"{self.data.n} x {self.data.length} tokens, seed {self.data.seed})")
        for column in ("metric", "threshold", "value", "result"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for m in self.metrics:
            table.add_row(m.name, *m.cells())
        if self.rescale is not None:
            r = self.rescale
            mlp = f", MLP / {max(r.mlp_scales.values()):g} in {len(r.mlp_scales)} layers" if r.mlp_scales else ""
            table.add_row(f"range scales ({r.device}, {r.windows} windows, fp32 peaks)", f"{r.headroom:g}x headroom",
                          f"residual x {r.residual_scale:g}{mlp}",
                          "folded" if r.residual_scale != 1 or r.mlp_scales else "none needed")
        if self.device is not None:
            self._device_rows(table, self.device)
        if self.artifact is None:
            table.add_row("artifact (.aimodel on Core AI)", "argmax equal", "not run", "-")
        else:
            a = self.artifact
            value = f"{a.argmax_compared} ids, {a.argmax_near_ties} near ties" if a.passed else "differs"
            if a.passed and a.reference_compared:
                value += f"; fp32 reference: {a.reference_compared} ids, {a.reference_near_ties} near ties"
            table.add_row(f"artifact {a.package}", "argmax equal", value, "pass" if a.passed else "[red]FAIL[/red]")
        return table

    @staticmethod
    def _device_rows(table: Table, device: DevicePass) -> None:
        where = f"device pass ({device.device}, {device.windows} windows)"
        for m in device.metrics:
            if m.threshold is not None:  # the reported ones are in gate_report.json
                table.add_row(f"{where}: {m.name}", *m.cells())
        r = device.range
        if r.passed:
            tight = r.tightest[0] if r.tightest else None
            value = (f"{r.checked} tensors; least headroom {tight.headroom:.3g}x at {tight.tensor} ({tight.kind}, "
                     f"peak {tight.peak:.4g})") if tight else "nothing computed"
        else:
            value = r.over[0].phrase() + (f" (+{len(r.over) - 1})" if len(r.over) > 1 else "")
        limits = ", ".join(f"{k} {v:.6g}" for k, v in r.limits.items())
        table.add_row(f"{where}: range", f"within {limits}", value, "pass" if r.passed else "[red]FAIL[/red]")

    def write_json(self, path: Path) -> Path:
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path

    def manifest_entry(self) -> dict:
        """What a published bundle records: pass, data identity, thresholds and every metric's value."""
        return {
            "passed": self.passed,
            "data": self.data.model_dump(),
            "thresholds": self.thresholds.model_dump(),
            "metrics": {m.name: m.value for m in self.metrics},
            "artifact": None if self.artifact is None else self.artifact.model_dump(exclude={"seconds", "greedy_ids"}),
            "device": None if self.device is None else {
                "device": self.device.device, "windows": self.device.windows, "passed": self.device.passed,
                "metrics": {m.name: m.value for m in self.device.metrics},
                "range": self.device.range.model_dump(exclude={"tightest"})},
        }

