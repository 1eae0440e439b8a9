"""The `cachewarm` command line: `run` (the operator) and `warm` (the warmer)."""

from __future__ import annotations

import sys

import click
import pydantic

from cachewarm import __version__
from cachewarm.settings import Settings


def _settings_help() -> str:
    lines = ["Settings come from environment variables:\n"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        lines.append(f"  CACHEWARM_{name.upper()}  {field.description} (default: {default!r})\n")
    return "\b\n" + "".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cachewarm")
def cli() -> None:
    """cachewarm keeps JAX/XLA persistent compilation caches on GCS warm across a
    Kubernetes cluster, from one CompilationCache resource."""


@cli.command(epilog=_settings_help())
def run() -> None:
    """Run the operator: reconcile CompilationCaches (buckets, lifecycle, soft delete).

    Talks to the cluster from its in-cluster ServiceAccount or $KUBECONFIG, and to GCS
    with Application Default Credentials (or $STORAGE_EMULATOR_HOST).
    """
    try:
        settings = Settings.from_env()
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"CACHEWARM_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors()
        )
        click.echo(f"error: invalid settings: {problems}", err=True)
        sys.exit(2)
    from cachewarm import main as operator_main  # kopf is heavy; import it only to run

    operator_main.run(settings)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
             add_help_option=False)
@click.pass_context
def warm(ctx: click.Context) -> None:
    """Precompile a training program into the cache (the warmer Job's entrypoint).

    `cachewarm warm targets MODULE:CALLABLE ...` or `cachewarm warm command -- ENTRYPOINT`;
    `cachewarm warm --help` for details. Needs jax; reads the cache env JAX_* like a pod.
    """
    from cachewarm import warmer  # the same single file the warmer init container ships

    sys.exit(warmer.main(list(ctx.args)))


def main() -> None:
    cli()
