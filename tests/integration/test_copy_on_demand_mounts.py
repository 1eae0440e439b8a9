"""The copy on demand as a pod lays it out: JAX reads the copy through one mount of the
pod's copy volume (/cachewarm-cache, read-only) while the copier writes another mount of
the same volume (/cachewarm-copy). Here a read-only bind mount of the copier's directory,
in a mount namespace of the process's own (`unshare`, as root: the suite runs as root), is
the directory JAX reads; its path is not the copier's, and no symlink leads from one to the
other. The hook must still know it for the copy's (attacker review: it compared paths, so
in every real pod it neither asked for an entry nor waited for one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from google.cloud import storage
from test_copier import base, entry, env_for
from test_copy_in_process import READS, Lines, boot_dir, key, md5_hex, printed, python

from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl

pytestmark = pytest.mark.integration

# Mount the copier's directory ($1) read-only at $2 in a mount namespace of its own, then run the rest.
SECOND_MOUNT = 'mkdir -p "$1" && mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a bind mount in a mount namespace of its own needs root and unshare (the suite and CI "
                           "run as root)")
def test_an_entry_read_through_another_mount_of_the_copy_is_asked_for_and_waited_for(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The pod's one entry is last in the plan (20 smaller fillers first), one download at a
    time, every filler held at the proxy: JAX's read through the second mount gets the
    entry while the worker is held, so it was asked for and fetched on demand."""
    bucket = f"copy-{uuid.uuid4().hex[:8]}"
    storage_only.create_bucket(bucket, location="us-central1")
    step = f"jax/{entry('jit_train_step', 'mounts')}"
    fillers = {f"jax/{entry(f'jit_filler{i}', f'm{i}')}": os.urandom(1024) for i in range(20)}
    objects = {step: os.urandom(64 << 10), **fillers}
    for name, data in objects.items():
        storage_only.bucket(bucket).blob(name).upload_from_string(data)
    dest, reads, summary_file = tmp_path / "copy", tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    reads.mkdir()
    settings = env_for(storage_bed, bucket, dest, summary=str(summary_file), workers="1")
    command, env = python(boot_dir(tmp_path / "boot"), settings, READS, str(reads), key(step))
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", SECOND_MOUNT, "sh", str(dest),
               str(reads), *command]
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    proxy.faults([{"method": "GET", "path": "/download/.*jit_filler", "hold": "fillers", "times": len(fillers),
                   "forward": True}])
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        assert json.loads(out.next("JAX's read of the pod's entry through the second mount")) == [md5_hex(objects[step])]
        proxy.wait_held("fillers")
        assert proxy.holds()["fillers"]["arrived"] == 1 and not summary_file.exists()
        proxy.release("fillers")
        assert out.rest() == [] and process.wait(timeout=120) == 0
        assert process.stderr is not None
        [summary] = printed(process.stderr.read())
    finally:
        proxy.clear_faults()
        process.kill()
    assert (summary["onDemand"], summary["onDemandEntries"]) == (1, [base(step)]), summary
    assert (summary["copied"], summary["failed"], summary["cold"]) == (21, 0, False), summary
    assert not os.path.ismount(reads)  # the mount was the process's own namespace's
