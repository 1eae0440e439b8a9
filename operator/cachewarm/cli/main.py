"""The `cachewarm` command line: `run` (the operator), `warm` (the warmer) and `inspect`
(what a cache holds)."""

from __future__ import annotations

import sys

import click
import pydantic

from cachewarm import __version__
from cachewarm.runtime.settings import Settings


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
    from cachewarm.runtime import main as operator_main  # kopf is heavy; import it only to run

    operator_main.run(settings)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
             add_help_option=False)
@click.pass_context
def warm(ctx: click.Context) -> None:
    """Precompile a training program into the cache (the warmer Job's entrypoint).

    `cachewarm warm targets MODULE:CALLABLE ...` or `cachewarm warm command -- ENTRYPOINT`;
    `cachewarm warm --help` for details. Needs jax; reads the cache env JAX_* like a pod.
    """
    from cachewarm.agents import warmer  # the same single file the warmer init container ships

    sys.exit(warmer.main(list(ctx.args)))


@cli.command(name="inspect")
@click.argument("cache", required=False, metavar="[NAMESPACE/NAME]")
@click.option("--bucket", "url", metavar="gs://BUCKET[/PREFIX]",
              help="Inspect a bucket (and prefix) directly instead of a CompilationCache.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def inspect_cache(cache: str | None, url: str | None, output: str) -> None:
    """Show what a cache holds, by program: entries, size, when written and last used
    (customTime), which warmer pools reported them, with the fingerprint (versions,
    devices, flags, image) their keys were computed with, and which training pods reported
    hitting them within the operator's report window (their reporters).

    NAMESPACE/NAME reads the CompilationCache (and its warmers' status) with $KUBECONFIG or
    the in-cluster ServiceAccount; --bucket reads only the bucket. GCS is read with
    Application Default Credentials (or $STORAGE_EMULATOR_HOST). Exit status 1 when the
    cache or bucket cannot be read, 2 for a usage error.
    """
    from cachewarm.cli import inspection
    from cachewarm.clients.gcs import GcsClient, GcsError
    from cachewarm.clients.kube import KubeClient, KubeError
    from cachewarm.api.model import InvalidSpec, parse_spec

    if bool(cache) == bool(url):
        raise click.UsageError("give either NAMESPACE/NAME or --bucket gs://BUCKET[/PREFIX]")
    pools: list[dict[str, object]] = []
    hits: list[dict[str, object]] = []
    try:
        if cache:
            namespace, _, name = cache.partition("/")
            if not namespace or not name or "/" in name:
                raise click.UsageError(f"expected NAMESPACE/NAME, got {cache!r}")
            body = KubeClient.from_environment().get_cache(namespace, name)
            if body is None:
                raise inspection.InspectError(f"CompilationCache {namespace}/{name} not found")
            storage = parse_spec(body.get("spec") or {}).storage.gcs
            bucket, prefix, url = storage.bucket, storage.object_prefix, storage.url
            pools = list(((body.get("status") or {}).get("warmup") or {}).get("pools") or [])
            hits = list(((body.get("status") or {}).get("usage") or {}).get("recentHits") or [])
        else:
            assert url is not None
            bucket, prefix = inspection.parse_url(url)
        objects = GcsClient().list_objects(bucket, prefix, glob=f"{prefix}*")
        progs = inspection.programs(objects, prefix, pools, hits)
    except (KubeError, GcsError, InvalidSpec, inspection.InspectError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    render = inspection.as_json if output == "json" else inspection.as_table
    click.echo(render(url, progs, pools), nl=False)


def main() -> None:
    cli()
