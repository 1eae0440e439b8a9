"""The `cachewarm` command line: `run` (the operator), `warm` (the warmer), `inspect`
(what a cache holds) and `grant` (the label a bucket owner adds)."""

from __future__ import annotations

import re
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
    hitting them within the operator's report window (their reporters); then the programs
    those pods still compiled, each with its cause (status.usage.missedPrograms).

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
    missed: list[dict[str, object]] = []
    usage: dict[str, object] = {}
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
            missed = list(((body.get("status") or {}).get("usage") or {}).get("missedPrograms") or [])
            usage = dict((body.get("status") or {}).get("usage") or {})
        else:
            assert url is not None
            bucket, prefix = inspection.parse_url(url)
        objects = GcsClient().list_objects(bucket, prefix, glob=f"{prefix}*")
        progs = inspection.programs(objects, prefix, pools, hits)
    except (KubeError, GcsError, InvalidSpec, inspection.InspectError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    render = inspection.as_json if output == "json" else inspection.as_table
    click.echo(render(url, progs, pools, missed, usage), nl=False)


@cli.command(name="grant")
@click.argument("url", metavar="gs://BUCKET[/PREFIX]")
@click.option("-n", "--namespace", required=True, help="Namespace whose CompilationCaches may use the bucket.")
@click.option("--instance", default="default", show_default=True,
              help="The operator's CACHEWARM_INSTANCE (one per cluster sharing the bucket).")
def grant(url: str, namespace: str, instance: str) -> None:
    """Print the bucket label by which a bucket's owner lets cachewarm act for the
    CompilationCaches of NAMESPACE at PREFIX and under it (no PREFIX: the whole bucket),
    and the gcloud command that adds it. Writes nothing: the owner runs the command with
    their own rights on the bucket (docs/bucket-and-data-safety.md#bucket-consent)."""
    from cachewarm.builders.bucket import grant_label
    from cachewarm.cli import inspection

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
        raise click.BadParameter(f"{namespace!r} is not a namespace name (lowercase letters, digits and '-', "
                                 "at most 63)", param_hint="--namespace")
    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", instance):
        raise click.BadParameter(f"{instance!r} is not an operator instance name (CACHEWARM_INSTANCE)",
                                 param_hint="--instance")
    try:
        bucket, prefix = inspection.parse_url(url)
    except inspection.InspectError as exc:
        raise click.BadParameter(str(exc), param_hint="URL") from None
    key, value = grant_label(namespace, prefix.rstrip("/"), instance)
    click.echo(f"{key}={value}")
    click.echo(f"gcloud storage buckets update gs://{bucket} --update-labels={key}={value}")


def main() -> None:
    cli()
