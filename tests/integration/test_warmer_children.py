"""The warmer's command mode with an entrypoint in a child process (python -c, a shell
wrapper, python -u) and in process (python -m), with real JAX compiles against the GCS
emulator: each warm has a fingerprint, counts and a manifest (issue 30). And a program
whose key changes in every process (tests/data/unstable_program.py: custom_partitioning):
the warmer names it, and the bucket holds one warm's entries of it, not one per warm."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage
from test_warmer import DATA, gcs_warm, read_manifest, warm

from cachewarm_testbed.cluster import Testbed

pytestmark = pytest.mark.integration

ENTRY = "import jax, jax.numpy as jnp\nprint(jax.jit(lambda x: x * 7)(jnp.ones(3)))\n"
POOL = "jax/.cachewarm/pools/ns/llama/cpu"


def forms(script: Path) -> dict[str, list[str]]:
    """The entrypoint forms a warmup.command takes, each running `script` (in tmp_path, the
    first on PYTHONPATH, as gcs_warm sets it)."""
    py = sys.executable  # its name starts with "python", as an image's does
    return {
        "-c": [py, "-c", f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"],
        "sh -c": ["sh", "-c", f"{py} {script}"],
        "-m": [py, "-m", script.stem],
        "-u": [py, "-u", str(script)],
    }


def bucket_with(gcs: storage.Client) -> str:
    bucket = f"children-{uuid.uuid4().hex[:10]}"
    gcs.create_bucket(bucket, location="us-central1")
    return bucket


def entries(gcs: storage.Client, bucket: str) -> dict[str, storage.Blob]:
    return {b.name.removeprefix("jax/"): b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")}


@pytest.mark.parametrize("form", ["-c", "sh -c", "-m", "-u"])
def test_an_entrypoint_in_any_form_is_counted_fingerprinted_and_named_in_the_manifest(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client, form: str
) -> None:
    """First warm: the child's compiles are counted (programs, written), its fingerprint is
    the warm's, and the manifest names the entries by the keys the child looked up. Second
    warm (the next Job): everything found, none written, the same keys in its own manifest."""
    bucket = bucket_with(storage_only)
    script = tmp_path / "entry_child.py"
    script.write_text(ENTRY)
    command = forms(script)[form]
    for job, expected in (("llama-cpu-0000000001", "writes"), ("llama-cpu-0000000002", "finds")):
        code, summary, log = gcs_warm(tmp_path, storage_bed, f"gs://{bucket}/jax", f"gs://{bucket}/{POOL}/{job}.json",
                                      "command", "--", *command)
        assert code == 0 and summary["errors"] == [], log
        assert summary["programs"] >= 1
        if expected == "writes":
            assert summary["entriesWritten"] == summary["programs"] and summary["entriesFound"] == 0
            # What each program took to compile, in the child too, by the key it was written under.
            [step] = [p for p in summary["compiledPrograms"] if p["program"] == "jit__lambda"]
            assert step["written"] and step["compileSeconds"] > 0 and step["key"] in summary["keys"]
        else:
            assert summary["entriesWritten"] == 0 and summary["entriesFound"] == summary["programs"]
            assert summary["compiledPrograms"] == []  # nothing compiled: the pool's status keeps the first's
        fp = summary["fingerprint"]
        assert (fp["platform"], fp["devices"], fp["cacheDir"]) == ("cpu", 1, f"gs://{bucket}/jax")
        on_gcs = entries(storage_only, bucket)
        assert sorted(summary["keys"]) == sorted(n.removesuffix("-cache").rsplit("-", 1)[1][:16] for n in on_gcs)
        manifest, _ = read_manifest(storage_only, bucket, f"{POOL}/{job}.json")
        assert sorted(e["name"] for e in manifest["entries"]) == sorted(on_gcs)
        assert manifest["fingerprint"] == fp and summary["manifestEntries"] == len(on_gcs)
        assert "unstablePrograms" not in summary  # a stable program, run again
    # Where it ran: -m and a lone script in this process; -c, sh -c and -u in a child.
    assert ("Counted child processes processes=1" in log) == (form in ("-c", "sh -c", "-u"))


def test_the_childs_pythonpath_keeps_the_images_behind_the_hook_and_its_sitecustomize_runs(tmp_path: Path) -> None:
    """A child sees the image's PYTHONPATH after the warmer's directory, and the image's own
    sitecustomize (which the hook shadows) still runs, once."""
    lib = tmp_path / "image-lib"
    lib.mkdir()
    (lib / "sitecustomize.py").write_text(  # the warmer's own python runs it too: by pid
        "import os\nos.environ['IMAGE_SITE_RAN'] = os.environ.get('IMAGE_SITE_RAN', '') + f' {os.getpid()}'\n")
    (lib / "image_module.py").write_text("VALUE = 'from the image'\n")
    script = tmp_path / "entry_path.py"
    script.write_text("import os, sys, image_module, jax, jax.numpy as jnp\n"
                      "print(jax.jit(lambda x: x * 9)(jnp.ones(3)))\n"
                      "print('PATH', os.environ['PYTHONPATH'], file=sys.stderr)\n"
                      "print('SITE', os.environ['IMAGE_SITE_RAN'].split().count(str(os.getpid())), image_module.VALUE,"
                      " file=sys.stderr)\n")
    code, summary, log = warm(tmp_path, "command", "--", "sh", "-c", f"{sys.executable} {script}",
                              cache=tmp_path / "c", env_extra={"PYTHONPATH": str(lib)})
    assert code == 0, log
    [path] = [line.split(" ", 1)[1] for line in log.splitlines() if line.startswith("PATH ")]
    hook, image = path.split(":")
    assert image == str(lib) and Path(hook).name == "site" and "cachewarm-children-" in hook
    assert not Path(hook).exists()  # the warmer's private directory goes with the warm
    assert "SITE 1 from the image" in log
    assert summary["programs"] >= 1 and summary["fingerprint"]["devices"] == 1
    assert summary["imagePythonPath"] == str(lib)


def test_a_child_that_ignores_pythonpath_is_not_counted_and_the_manifest_goes(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """python -E ignores PYTHONPATH, so it never imports the warmer's sitecustomize (as -S
    and -I, or a command that sets PYTHONPATH itself): nothing counts its compiles, so the
    warm names no entries and the pool's older manifest is removed, as before issue 30."""
    bucket = bucket_with(storage_only)
    script = tmp_path / "entry_nosite.py"
    script.write_text(ENTRY)
    name = f"{POOL}/llama-cpu-0000000001.json"
    code, summary, log = gcs_warm(tmp_path, storage_bed, f"gs://{bucket}/jax", f"gs://{bucket}/{name}",
                                  "command", "--", sys.executable, str(script))
    assert code == 0 and summary["manifestEntries"] >= 1, log
    code, summary, log = gcs_warm(tmp_path, storage_bed, f"gs://{bucket}/jax", f"gs://{bucket}/{name}",
                                  "command", "--", "sh", "-c", f"{sys.executable} -E {script}")
    assert code == 0, log
    assert "keys" not in summary and "fingerprint" not in summary and summary["programs"] == 0
    assert storage_only.bucket(bucket).get_blob(name) is None


def unstable_warm(tmp_path: Path, bed: Testbed, bucket: str, job: str, *command: str) -> dict[str, Any]:
    code, summary, log = gcs_warm(tmp_path, bed, f"gs://{bucket}/jax", f"gs://{bucket}/{POOL}/{job}.json",
                                  "command", "--", *(command or (sys.executable, str(DATA / "unstable_program.py"))))
    assert code == 0 and summary["errors"] == [], log
    return summary


def unstable_entries(gcs: storage.Client, bucket: str) -> list[str]:
    return sorted(n for n in entries(gcs, bucket) if n.startswith("jit_unstable_step-"))


def test_a_program_with_a_new_key_every_warm_is_named_and_its_older_entry_removed(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """Warm 1 writes jit_unstable_step's entry. Warm 2 (the next Job, same fingerprint)
    misses it and writes another: the summary names the program with both keys (older
    first). Nothing is removed (the older entry expires by the lifecycle rule once no warm
    refreshes it), nor the entry of the program no manifest of the pool names (another
    writer's). Warm 3 the same. The stable programs are not named."""
    bucket = bucket_with(storage_only)
    foreign = "jit_unstable_step-" + "e" * 64 + "-cache"
    storage_only.bucket(bucket).blob(f"jax/{foreign}").upload_from_string(b"not this pool's")
    first = unstable_warm(tmp_path, storage_bed, bucket, "llama-cpu-0000000001")
    assert "unstablePrograms" not in first and first["fingerprint"]["devices"] == 2
    [mine] = [n for n in unstable_entries(storage_only, bucket) if n != foreign]
    stable = {n for n in entries(storage_only, bucket) if not n.startswith("jit_unstable_step-")}
    assert stable  # the helper programs (convert, broadcast, ...) are stable
    seen = {mine}
    for job in ("llama-cpu-0000000002", "llama-cpu-0000000003"):
        again = unstable_warm(tmp_path, storage_bed, bucket, job)
        now = [n for n in unstable_entries(storage_only, bucket) if n != foreign and n not in seen]
        assert len(now) == 1 and mine in unstable_entries(storage_only, bucket)
        [item] = again["unstablePrograms"]
        assert item["program"] == "jit_unstable_step" and item["seen"] == "runs"
        assert item["keys"][-1] == now[0].removesuffix("-cache").rsplit("-", 1)[1][:16]
        assert mine.removesuffix("-cache").rsplit("-", 1)[1][:16] in item["keys"]
        assert "unstableRemoved" not in again
        assert foreign in entries(storage_only, bucket)
        seen.add(now[0])
        assert {n for n in entries(storage_only, bucket) if not n.startswith("jit_unstable_step-")} == stable
        assert again["entriesFound"] == len(stable)  # the stable ones hit
        mine = now[0]


def test_a_new_key_with_another_fingerprint_is_not_an_unstable_program(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """The same program on three devices (another fingerprint) computes other keys for every
    program: nothing is named and the two-device warm's entries stay."""
    bucket = bucket_with(storage_only)
    unstable_warm(tmp_path, storage_bed, bucket, "llama-cpu-0000000001")
    before = set(entries(storage_only, bucket))
    other = unstable_warm(tmp_path, storage_bed, bucket, "llama-cpu-0000000002", "sh", "-c",
                          f"XLA_FLAGS=--xla_force_host_platform_device_count=4 {sys.executable} "
                          f"{DATA / 'unstable_program.py'}")
    assert other["fingerprint"]["devices"] == 4
    assert "unstablePrograms" not in other and "unstableRemoved" not in other
    assert before <= set(entries(storage_only, bucket))


def test_two_processes_of_one_warm_with_two_keys_for_a_program_name_it(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """A wrapper that runs the program twice (as a launcher's workers would): the second
    process looks jit_unstable_step up under another key. Both entries were written by this
    warm: named (seen in processes), none removed; nor by the next warm."""
    bucket = bucket_with(storage_only)
    program = f"{sys.executable} {DATA / 'unstable_program.py'}"
    twice = unstable_warm(tmp_path, storage_bed, bucket, "llama-cpu-0000000001", "sh", "-c", f"{program}; {program}")
    two = unstable_entries(storage_only, bucket)
    assert len(two) == 2
    assert twice["unstablePrograms"] == [{"program": "jit_unstable_step", "seen": "processes",
                                          "keys": sorted(n.removesuffix("-cache").rsplit("-", 1)[1][:16] for n in two)}]
    assert "unstableRemoved" not in twice
    once = unstable_warm(tmp_path, storage_bed, bucket, "llama-cpu-0000000002")
    assert once["unstablePrograms"][0]["seen"] == "runs" and "unstableRemoved" not in once
    assert len(unstable_entries(storage_only, bucket)) == 3  # nothing deleted: the lifecycle rule expires them
