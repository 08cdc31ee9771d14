"""`spec-convert`: a thin click layer over the library calls in convert/."""

from __future__ import annotations

import functools
import os
import signal
import sys
import warnings
from pathlib import Path

import click

from convert.errors import GateError, InputError, one_line

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_qwen3.yaml"
CLICK_MESSAGE_LIMIT = 200  # click's usage errors echo the option's value whole


def user_errors(func):
    """One line on stderr and the documented exit code for user-facing failures; no traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from convert.errors import PackageError

        try:
            return func(*args, **kwargs)
        except (InputError, GateError) as exc:
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)
        except PackageError as exc:
            click.echo(f"error: {one_line(f'package check failed: {exc}')}", err=True)
            sys.exit(GateError.exit_code)
        except KeyboardInterrupt:
            interrupted()

    return wrapper


def interrupted() -> None:
    """Exit 130 with the one line. A second Ctrl-C is ignored from here: a forked packaging worker hands its own
    KeyboardInterrupt back through its future, and the signal that reached this process may be handled only after it,
    during the exit, where it would end the process by the signal (-2) instead of exit 130."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo("interrupted: nothing was published", err=True)
    sys.exit(130)


class OneLineErrors(click.Group):
    """Click's usage errors (a missing argument, ``--tokens -5``) as one line on stderr, exit 2, like every other
    bad input: click would print the usage block and a blank line around it."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Abort:
            interrupted()
        except click.exceptions.NoArgsIsHelpError as exc:  # the help, as click prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            click.echo(f"error: {one_line(exc.format_message(), CLICK_MESSAGE_LIMIT)}{hint}", err=True)
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors)
@click.version_option(package_name="spec-convert")
def main() -> None:
    """Convert speculative-decoding checkpoints into gated Core AI and Core ML bundles."""
    # coremltools draws a tqdm bar per conversion pass; the stage log says what runs and for how long
    os.environ.setdefault("TQDM_DISABLE", "1")
    # torch makes a compile-cache folder in the system temp dir when torch._dynamo is first imported
    # (torchinductor_<user>); a command leaves nothing in the temp dir (tests/test_temporaries.py): it goes beside
    # the build cache
    from convert.paths import default_cache

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache() / "torchinductor"))
    # version notices that every run would print and that tests/test_build.py shows to be harmless here
    warnings.filterwarnings("ignore", message="coreai-torch has only been validated")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="bundle directory, relative to the working directory (overrides the recipe's `output`)")
@click.option("--dry-run", is_flag=True, help="print the plan (a summary, then every function's signature) without "
              "loading or downloading weights: an uncached hf:// source is read as config, tokenizer files and "
              "safetensors headers")
@click.option("--cache-dir", type=click.Path(path_type=Path),
              help="build cache (default $SPEC_CONVERT_CACHE, else ~/.cache/spec-convert)")
@click.option("--no-cache", is_flag=True, help="compute every stage again; read and write no cache")
@click.option("--strict", is_flag=True, help="fail (exit 1, nothing published) on any finding of the placement lint: "
              "an op, state, dtype or dim a program the ANE runs whole does not hold (docs/layouts.md)")
@click.option("--device", "torch_device", type=click.Choice(["auto", "cpu", "cuda", "mps"]), default="cpu",
              show_default=True, help="where the torch stages compute (auto: CUDA, else MPS, else the CPU); the plan's "
              "'torch stages' line says which stages use it (docs/benchmarks.md)")
@click.option("--jobs", type=click.IntRange(min=1), help="a parted target's (part, format) packaging jobs run at "
              "once, each in a process of its own, at most as many as target.max_host_memory_gb holds (default: as "
              "many as the cores above 50M parameters, one part after the other below; 1: one part after the "
              "other); the bundle is the same")
@user_errors
def build(recipe: Path, output: Path | None, dry_run: bool, cache_dir: Path | None, no_cache: bool,
          strict: bool, torch_device: str, jobs: int | None) -> None:
    """Build the bundle a recipe describes. Expensive stages are cached: an interrupted build resumes."""
    from convert.cache import BuildCache
    from convert.pipeline.build import build as run_build
    from convert.pipeline.plan import make_plan
    from convert.pipeline.plan_text import describe_plan
    from convert.pipeline.plan_text import dry_run as plan_dry_run
    from convert.torch_device import resolve

    device = resolve(torch_device)
    if dry_run:
        click.echo("\n".join(plan_dry_run(recipe, output, cache_dir, device)))
        return
    plan = make_plan(recipe, output, cache_dir, torch_device=device, package_jobs=jobs)
    click.echo("\n".join(describe_plan(plan)))
    manifest = run_build(plan, BuildCache(cache_dir, enabled=not no_cache), strict)
    click.echo(f"bundle: {plan.output} (export id {manifest.export_id[:16]})")


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--bundle", "-b", type=click.Path(path_type=Path), help="also run the bundle's .aimodel (artifact gate)")
@click.option("--report", type=click.Path(path_type=Path),
              help="also write the report as JSON to this path (default: none, the table only; a file there that is "
              "not a gate report is refused, never replaced; a bundle is never written to: its manifest hashes its "
              "files, and its own gate_report.json is the build's)")
@user_errors
def gate(recipe: Path, bundle: Path | None, report: Path | None) -> None:
    """Run the numeric gates of a recipe's target alone and print their table: exit 0 pass, 1 fail, 2 bad input
    (a recipe or bundle refused, a --report path holding something else).

    The shipped weights are rebuilt from the recipe's pinned source (quantization is deterministic); with
    --bundle they must hash to the bundle's, and its .aimodel is run on the Core AI runtime against them.
    """
    from convert.commands.gate import check_report_path, gate_bundle

    if report is not None:
        check_report_path(report)
    gate_bundle(recipe, bundle, report)
    click.echo(f"gate passed; report: {report}" if report is not None else "gate passed")


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--runtime", type=click.Choice(["torch", "device", "coreai"]), default="torch", show_default=True,
              help="torch (the default: needs no bundle and measures every held-out prompt at full length, where the "
              "Core AI runtime, fp16 emulated on Linux, runs one short prompt): the export modules with the shipped "
              "weights; device: "
              "the same in fp16 in the arithmetic of each side's device (docs/fp16.md); coreai: the bundle's .aimodel "
              "packages")
@click.option("--bundle", "-b", type=click.Path(path_type=Path), help="the built bundle (target/ and drafter/)")
@click.option("--tokens", type=click.IntRange(min=1),
              help="tokens generated per prompt (default: the recipe's drafter.accept.tokens)")
@click.option("--prompts", type=click.IntRange(min=1),
              help="held-out prompts (default: the recipe's drafter.accept.samples)")
@click.option("--json", "as_json", is_flag=True, help="print the measurements as JSON")
@user_errors
def accept(recipe: Path, runtime: str, bundle: Path | None, tokens: int | None, prompts: int | None,
           as_json: bool) -> None:
    """Greedy speculative decoding of a recipe's target with its drafter: tokens per round, acceptance per draft
    position, and the lossless check against plain greedy decoding (exit 1 when it fails).

    Also: the bytes each call reads (weights as shipped plus states) and the speedup the acceptance predicts
    under a bandwidth-bound cost model; prompt-lookup (n-gram) drafting on the same prompts and target as the
    zero-cost baseline; and for a quantized drafter the paired A/B against its fp16 self."""
    from convert.commands.accept import print_result, result_json, run_accept

    result = run_accept(recipe, bundle, runtime, tokens, prompts)
    if as_json:
        click.echo(result_json(result))
    else:
        print_result(result)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", required=True, help="the text to continue (encoded with the bundle's tokenizer)")
@click.option("-n", "tokens", type=click.IntRange(min=1), default=16, show_default=True, help="tokens to generate")
@click.option("--runtime", type=click.Choice(["coreai", "torch"]), default="coreai", show_default=True,
              help="coreai (the default: the smoke test runs what ships, the bundle alone): the bundle's .aimodel on "
                   "the Core AI runtime; torch: the export modules with the shipped weights (rebuilt from --recipe, "
                   "faster on Linux)")
@click.option("--recipe", "-r", type=click.Path(path_type=Path), help="the bundle's recipe (for --runtime torch)")
@click.option("--json", "as_json", is_flag=True, help="print the prompt and generated ids as JSON")
@user_errors
def generate(bundle: Path, prompt: str, tokens: int, runtime: str, recipe: Path | None, as_json: bool) -> None:
    """Greedy decoding of a bundle through its host contract (prefill chunks, decode steps): the smoke test of a
    bundle. Stops after N tokens or at the end-of-sequence id. The text (or --json) on stdout; what runs, and the
    tokens per second, on stderr."""
    import json

    from convert.commands.generate import generate as run_generate

    result = run_generate(bundle, prompt, tokens, runtime, recipe)
    click.echo(json.dumps(result.as_dict(), ensure_ascii=False) if as_json else result.text)


@main.command("check-pair")
@click.argument("drafter_bundle", type=click.Path(path_type=Path))
@click.argument("target_bundle", type=click.Path(path_type=Path))
@user_errors
def check_pair(drafter_bundle: Path, target_bundle: Path) -> None:
    """Refuse (exit 1) a drafter bundle that was not built for exactly this target bundle, naming the field."""
    from convert.pipeline.bundle import read_manifest
    from manifests import identity
    from manifests.schema import DrafterManifest, Manifest

    # the manifests alone: the target's files a drafter borrows are hashed by the pair check itself, naming the field
    drafter, target = read_manifest(drafter_bundle), read_manifest(target_bundle)
    if not isinstance(drafter, DrafterManifest):
        raise InputError(f"{drafter_bundle}: a target bundle, not a drafter's; the drafter bundle comes first")
    if not isinstance(target, Manifest):
        raise InputError(f"{target_bundle}: a drafter bundle, not a target's")
    problems = identity.pair_mismatches(drafter, target, target_bundle)
    if problems:
        for problem in problems:
            click.echo(f"mismatch: {problem}", err=True)
        raise GateError(f"check-pair: {drafter_bundle} does not belong to {target_bundle}: {problems[0]}")
    click.echo(f"pair ok: {drafter.name} was built for target export {target.export_id[:16]}")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--details", is_flag=True, help="the whole manifest: functions, host contract, every lint finding")
@click.option("--json", "as_json", is_flag=True, help="the manifest as JSON (a pair's as {\"target\": ..., "
              "\"drafter\": ...})")
@user_errors
def inspect(bundle: Path, details: bool, as_json: bool) -> None:
    """Summarise a bundle's manifest (a pair's target and drafter both): its gate's metrics, quantization and placement
    lint; exit 1 when a file it records is not there with its recorded size (files are not hashed here: `verify`
    hashes them all)."""
    from convert.commands.inspect import check_files, manifests_json, print_manifest, print_summary
    from convert.pipeline.bundle import parts, read_manifest

    read = {}
    for part in parts(bundle):
        manifest = read_manifest(part)
        if not as_json:
            (print_manifest if details else print_summary)(manifest)
        check_files(part, manifest, hashed_bytes=-1)
        read[part.name] = manifest
    if as_json:
        click.echo(manifests_json(read))


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@user_errors
def verify(bundle: Path) -> None:
    """Check every file of a bundle (a pair's target and drafter both) against its manifest: size and sha256 of each
    recorded file, files it does not record, the manifest's schema and export id, and a pair's drafter binding. Exit
    0 with a line per part, 1 naming the first difference (each one is listed on stderr), 2 when it is not a bundle."""
    from convert.commands.verify import verify as run_verify

    run_verify(bundle, click.echo)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@user_errors
def compile(bundle: Path) -> None:  # noqa: A001 - the command's name
    """Run the compile steps that were deferred (device AOT, coremlcompiler) and update the manifest."""
    from convert.commands.compile import compile_bundle
    from convert.pipeline.bundle import parts

    for part in parts(bundle):
        for line in compile_bundle(part):
            click.echo(line)


@main.command()
@click.option("--output", "-o", default="bundles/demo", show_default=True, help="bundle directory")
@user_errors
def demo(output: str) -> None:
    """Build the embedded default recipe and show greedy continuations side by side."""
    from convert.commands.demo import run_demo

    run_demo(DEFAULT_RECIPE, output)
