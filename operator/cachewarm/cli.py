"""The `cachewarm` command line: `run` (the operator)."""

from __future__ import annotations

import click

from cachewarm import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cachewarm")
def cli() -> None:
    """cachewarm keeps JAX/XLA persistent compilation caches on GCS warm across a
    Kubernetes cluster, from one CompilationCache resource."""


def main() -> None:
    cli()
