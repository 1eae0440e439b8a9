"""`python -m cachewarm_testbed up|down|status DIR`: the local control plane in the background.

`up` is idempotent: a healthy testbed in DIR is left running; a dead or half one is
stopped and started anew. It writes DIR/kubeconfig and DIR/env (`export NAME=value`
lines), so that `. DIR/env && kubectl get ns` works. `down` stops everything recorded in
DIR and removes DIR.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import click

from cachewarm_testbed.cluster import Testbed, local_images
from cachewarm_testbed.processes import StartError


@click.group()
def cli() -> None:
    """Start and stop the local control plane (etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler with simulated GKE nodes) and the GCS emulator on loopback, for
    development and demos."""


@cli.command()
@click.argument("workdir", type=click.Path(path_type=Path), default=Path(".dev"))
@click.option("--controller-manager/--no-controller-manager", default=True, show_default=True,
              help="Also run kube-controller-manager (Jobs, garbage collection, namespaces).")
@click.option("--nodes/--no-nodes", default=True, show_default=True,
              help="Also run kube-scheduler and the simulated GKE nodes (CPU, H100, v5e, v5p) whose stand-in "
                   "kubelet runs pods of the local images (warmer, demo/train:1, test/targets:1). "
                   "Needs the controller manager.")
def up(workdir: Path, controller_manager: bool, nodes: bool) -> None:
    """Start the testbed in WORKDIR (default .dev) unless it is already running."""
    existing = Testbed.load(workdir)
    if existing is not None:
        if existing.healthy():
            click.echo(f"testbed already running: {existing.server} (. {workdir}/env)")
            return
        click.echo("testbed state found but not healthy; restarting it")
        existing.stop()
    bed = Testbed(workdir)
    try:
        bed.start(controller_manager=controller_manager)
        if nodes and controller_manager:
            bed.start_node_agent(local_images())
    except StartError as exc:
        bed.stop()
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    lines = [f"export {k}={shlex.quote(v)}" for k, v in bed.env().items()]
    (workdir / "env").write_text("\n".join(lines) + "\n")
    click.echo(f"testbed running: apiserver {bed.server}, GCS emulator {bed.storage_emulator_host}")
    click.echo(f"use it with: . {workdir}/env && kubectl get ns")


@cli.command()
@click.argument("workdir", type=click.Path(path_type=Path), default=Path(".dev"))
def down(workdir: Path) -> None:
    """Stop the testbed recorded in WORKDIR and remove WORKDIR."""
    bed = Testbed.load(workdir)
    if bed is None:
        click.echo("no testbed running")
    else:
        bed.stop()
        click.echo("testbed stopped")
    shutil.rmtree(workdir, ignore_errors=True)


@cli.command()
@click.argument("workdir", type=click.Path(path_type=Path), default=Path(".dev"))
def status(workdir: Path) -> None:
    """Exit 0 when the testbed in WORKDIR is running and ready."""
    bed = Testbed.load(workdir)
    if bed is None or not bed.healthy():
        click.echo("not running")
        sys.exit(1)
    click.echo(f"running: {bed.server}")


if __name__ == "__main__":
    cli()
