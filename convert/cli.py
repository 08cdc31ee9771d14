"""`spec-convert`: a thin click layer over the library calls in convert/."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import click

from convert.errors import GateError, InputError

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_qwen3.yaml"


def user_errors(func):
    """One line on stderr and the documented exit code for user-facing failures; no traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from convert.backends.base import PackageError

        try:
            return func(*args, **kwargs)
        except (InputError, GateError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except PackageError as exc:
            click.echo(f"error: package check failed: {exc}", err=True)
            sys.exit(GateError.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was published", err=True)
            sys.exit(130)

    return wrapper


@click.group()
@click.version_option(package_name="spec-convert")
def main() -> None:
    """Convert speculative-decoding checkpoints into gated Core AI and Core ML bundles."""
    # coremltools draws a tqdm bar per conversion pass; the stage log says what runs and for how long
    os.environ.setdefault("TQDM_DISABLE", "1")
    # version notices that every run would print and that tests/test_build.py shows to be harmless here
    warnings.filterwarnings("ignore", message="coreai-torch has only been validated")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--output", "-o", help="bundle directory (overrides the recipe's `output`)")
@click.option("--dry-run", is_flag=True, help="print the plan without loading weights")
@user_errors
def build(recipe: Path, output: str | None, dry_run: bool) -> None:
    """Build the bundle a recipe describes."""
    from convert.build import build as run_build
    from convert.build import describe_plan, make_plan

    plan = make_plan(recipe, output)
    click.echo("\n".join(describe_plan(plan)))
    if dry_run:
        return
    manifest = run_build(plan)
    click.echo(f"bundle: {plan.output} (export id {manifest.export_id[:16]})")


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--bundle", "-b", type=click.Path(path_type=Path), help="also run the bundle's .aimodel (artifact gate)")
@click.option("--report", "-r", type=click.Path(path_type=Path), default=Path("gate_report.json"), show_default=True,
              help="where the report goes")
@user_errors
def gate(recipe: Path, bundle: Path | None, report: Path) -> None:
    """Run the numeric gates of a recipe's target alone: exit 0 pass, 1 fail (with a table and a report).

    The shipped weights are rebuilt from the recipe's pinned source (quantization is deterministic); with
    --bundle they must hash to the bundle's, and its .aimodel is run on the Core AI runtime against them.
    """
    from convert.build import gate_bundle

    gate_bundle(recipe, bundle, report)
    click.echo(f"gate passed; report: {report}")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@user_errors
def inspect(bundle: Path) -> None:
    """Print a bundle's manifest readably."""
    from convert.inspect import print_manifest, read_manifest

    print_manifest(read_manifest(bundle))


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@user_errors
def compile(bundle: Path) -> None:  # noqa: A001 - the command's name
    """Run the compile steps that were deferred (device AOT, coremlcompiler) and update the manifest."""
    from convert.compile import compile_bundle

    for line in compile_bundle(bundle):
        click.echo(line)


@main.command()
@click.option("--output", "-o", default="bundles/demo", show_default=True, help="bundle directory")
@user_errors
def demo(output: str) -> None:
    """Build the embedded default recipe and show greedy continuations side by side."""
    from convert.demo import run_demo

    run_demo(DEFAULT_RECIPE, output)
