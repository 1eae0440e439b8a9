"""The warmer as the Job runs it: `python warm.py ...` in the image's working directory,
with the cache env, reporting a JSON summary in the termination-message file."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from cachewarm_testbed.cluster import Testbed

pytestmark = pytest.mark.integration

WARMER = Path(__file__).resolve().parents[2] / "operator" / "cachewarm" / "agents" / "warmer.py"
DATA = Path(__file__).resolve().parents[1] / "data"


def warm(tmp_path: Path, *args: str, cache: Path | None = None, min_compile: str = "0",
         env_extra: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> tuple[int, dict[str, Any], str]:
    summary = tmp_path / "termination-log"
    env = {**{k: v for k, v in os.environ.items() if k not in unset}, **(env_extra or {}),
           "CACHEWARM_SUMMARY_FILE": str(summary),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": min_compile,
           "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    # Run as a lone file, the way the init container ships it.
    lone = tmp_path / "warm.py"
    lone.write_text(WARMER.read_text())
    out = subprocess.run([sys.executable, str(lone), *args], cwd=DATA, env=env, capture_output=True,
                         text=True, timeout=300)
    return out.returncode, json.loads(summary.read_text()), out.stderr


def test_targets_are_compiled_into_the_cache_then_found(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code, first, log = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0, log
    assert first["entriesWritten"] == 1 and first["entriesFound"] == 0 and first["errors"] == []
    assert first["bytesWritten"] == sum(p.stat().st_size for p in cache.glob("*-cache"))
    assert "Compiled target=warm_targets:slow_targets" in log
    code, again, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0
    assert again["entriesWritten"] == 0 and again["entriesFound"] == 1


def test_the_summary_names_by_key_the_entries_the_warm_wrote_and_then_found(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code, first, log = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0, log
    on_disk = sorted(p.name.removesuffix("-cache").rsplit("-", 1)[1][:16] for p in cache.glob("*-cache"))
    assert first["keys"] == on_disk and first["keyCount"] == len(on_disk) == 1
    code, again, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0 and again["entriesFound"] == 1
    assert again["keys"] == on_disk  # found, not written: still what pods will read


def test_the_fingerprint_names_what_the_keys_depend_on(tmp_path: Path) -> None:
    """Versions, platform, device count and the flags JAX hashes: a device-count flag
    changes the devices (and so the keys) but not the flags' hash, a dump flag changes
    neither (JAX leaves both out of its flags), an optimization flag changes the hash."""
    import jax

    def fingerprint(flags: str) -> dict[str, Any]:
        code, summary, log = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=tmp_path / "cache",
                                  env_extra={"XLA_FLAGS": flags})
        assert code == 0, log
        return dict(summary["fingerprint"])

    plain = fingerprint("")
    assert plain["jax"] == jax.__version__ and plain["versions"]["jaxlib"] == jax.__version__
    assert (plain["platform"], plain["deviceKind"], plain["devices"], plain["processes"]) == ("cpu", "cpu", 1, 1)
    assert plain["cacheDir"] == str(tmp_path / "cache") and plain["flagCount"] == 0
    two = fingerprint("--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/dump")
    assert two["devices"] == 2 and (two["flagsHash"], two["flagCount"]) == (plain["flagsHash"], 0)
    tuned = fingerprint("--xla_cpu_enable_fast_math=true")
    assert tuned["flagsHash"] != plain["flagsHash"] and tuned["flagCount"] == 1 and tuned["devices"] == 1


def test_failing_target_exits_1_with_the_error(tmp_path: Path) -> None:
    code, summary, _ = warm(tmp_path, "targets", "warm_targets:broken_targets", cache=tmp_path / "c")
    assert code == 1
    assert "TypeError" in summary["errors"][0]


@pytest.mark.parametrize("target", ["warm_targets:no_targets", "warm_targets:missing", "nosuchmodule:x"])
def test_nothing_compiled_is_a_failure(tmp_path: Path, target: str) -> None:
    code, summary, _ = warm(tmp_path, "targets", target, cache=tmp_path / "c")
    assert code in (1, 2)
    assert summary["programs"] == 0 and summary["errors"]


def test_without_cache_dir_nothing_is_cached_and_it_says_so(tmp_path: Path) -> None:
    code, summary, log = warm(tmp_path, "targets", "warm_targets:slow_targets")
    assert code == 2
    assert "JAX_COMPILATION_CACHE_DIR is not set" in log
    assert summary["errors"] == ["nothing was compiled or found in the cache"]


def test_programs_below_the_write_threshold_are_a_failure_not_a_success(tmp_path: Path) -> None:
    code, summary, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=tmp_path / "c", min_compile="1e9")
    assert code == 2
    assert summary["programs"] == 1 and summary["notCached"] == 1
    assert "none was written to or found in the cache" in summary["errors"][0]


def test_command_mode_runs_a_python_entrypoint_in_process(tmp_path: Path) -> None:
    script = tmp_path / "entry.py"
    script.write_text("import sys, jax, jax.numpy as jnp\n"
                      "print(jax.jit(lambda x: x * 2)(jnp.ones(3)))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    code, summary, _ = warm(tmp_path, "command", "--", "python", str(script), "0", cache=tmp_path / "c")
    assert code == 0 and summary["mode"] == "command"
    assert summary["programs"] >= 1 and summary["entriesWritten"] >= 1
    code, summary, _ = warm(tmp_path, "command", "--", "python", str(script), "3", cache=tmp_path / "c")
    assert code == 1
    assert summary["errors"] == ["entrypoint exited with status 3"]


def test_the_summary_carries_the_pythonpath_the_warmer_started_with(tmp_path: Path) -> None:
    """What the image's ENV set (the Job sets none of its own): as it was, "" without one,
    even after an entrypoint run in process changed it."""
    lib = tmp_path / "image-lib"
    lib.mkdir()
    (lib / "image_targets.py").write_text("from warm_targets import quick_targets\n")
    path = f"{lib}:/opt/image/site"
    code, summary, log = warm(tmp_path, "targets", "image_targets:quick_targets", cache=tmp_path / "c",
                              env_extra={"PYTHONPATH": path})
    assert code == 0, log  # the target came from the PYTHONPATH, as in the image
    assert summary["imagePythonPath"] == path
    code, summary, log = warm(tmp_path, "targets", "warm_targets:quick_targets", cache=tmp_path / "c",
                              unset=("PYTHONPATH",))
    assert code == 0, log
    assert summary["imagePythonPath"] == ""
    script = tmp_path / "entry.py"
    script.write_text("import os, jax, jax.numpy as jnp\n"
                      "os.environ['PYTHONPATH'] = '/set/by/the/entrypoint'\n"
                      "print(jax.jit(lambda x: x * 5)(jnp.ones(3)))\n")
    code, summary, log = warm(tmp_path, "command", "--", "python", str(script), cache=tmp_path / "c",
                              env_extra={"PYTHONPATH": path})
    assert code == 0, log
    assert summary["imagePythonPath"] == path
    code, summary, log = warm(tmp_path, "targets", "warm_targets:quick_targets", cache=tmp_path / "c",
                              env_extra={"PYTHONPATH": "/p" * 500 + "x"})
    assert code == 0, log
    assert "imagePythonPath" not in summary  # over 1000 characters: left out, never cut


def test_an_entrypoint_in_an_uncounted_child_process_reports_no_keys(tmp_path: Path) -> None:
    """When the warmer cannot see which entries a child process looked up (python -E skips
    its hook: test_warmer_children.py), it names none (the operator then falls back to "the
    bucket holds entries") rather than only those it saw written, which would make a
    re-warm of a full cache look empty."""
    script = tmp_path / "entry.py"
    script.write_text("import jax, jax.numpy as jnp\nprint(jax.jit(lambda x: x * 3)(jnp.ones(3)))\n")
    for _ in range(2):  # writes, then finds everything already cached
        code, summary, log = warm(tmp_path, "command", "--", "sh", "-c", f"{sys.executable} -E {script}",
                                  cache=tmp_path / "c")
        assert code == 0, log
        assert "keys" not in summary and "keyCount" not in summary


# --- the pool's manifest (CACHEWARM_MANIFEST), against the GCS emulator --------------------

TWO_PROGRAMS = '''
import jax
import jax.numpy as jnp


def targets():
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    for n in (8, 16):
        yield f, (jax.ShapeDtypeStruct((4, n), jnp.float32), jax.ShapeDtypeStruct((n, n), jnp.float32))
'''
OLD_PROGRAM = "jit_old_program-" + "f" * 64 + "-cache"


def gcs_warm(tmp_path: Path, bed: Testbed, url: str, manifest: str, *args: str,
             extra: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    env = {k: v for k, v in bed.env().items() if k != "KUBECONFIG"}
    return warm(tmp_path, *args, env_extra={**env, "JAX_COMPILATION_CACHE_DIR": url, "CACHEWARM_MANIFEST": manifest,
                                            "PYTHONPATH": str(tmp_path), **(extra or {})})


def read_manifest(gcs: storage.Client, bucket: str, name: str) -> tuple[dict[str, Any], str | None]:
    blob = gcs.bucket(bucket).get_blob(name)
    assert blob is not None, f"no manifest at gs://{bucket}/{name}"
    return json.loads(blob.download_as_bytes()), blob.content_type


def test_a_targets_warm_writes_the_entries_it_relied_on_to_the_pools_manifest(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """The manifest names exactly the entries the summary's keys name (not another
    program's entry under the prefix), with their size, md5Hash and generation as GCS has
    them (version 2); the summary's manifestGeneration is the written manifest object's
    generation, at the URL given (one per warmer Job: <pool>/<job>.json, and the pool read
    from it); a stale manifest at it (a retry of the same Job) is replaced; a re-warm (the
    next Job) that finds them names them again in its own object, and the first Job's
    manifest stays at the generation the operator recorded (a pod pinned to it still reads it)."""
    bucket = f"manifest-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    first = name = "jax/.cachewarm/pools/ns/llama/cpu/llama-cpu-0123456789.json"
    storage_only.bucket(bucket).blob(f"jax/{OLD_PROGRAM}").upload_from_string(b"an older program's entry")
    storage_only.bucket(bucket).blob(name).upload_from_string(b'{"version": 1, "entries": [{"name": "stale"}]}')
    (tmp_path / "two_programs.py").write_text(TWO_PROGRAMS)
    recorded: list[str] = []  # each warm's manifestGeneration, as the operator records it
    for attempt, name in (("writes", first), ("finds", "jax/.cachewarm/pools/ns/llama/cpu/llama-cpu-9876543210.json")):
        # The manifest's writtenTime falls within this warm's run (whole seconds, as written).
        began = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        code, summary, log = gcs_warm(tmp_path, storage_bed, f"gs://{bucket}/jax", f"gs://{bucket}/{name}",
                                      "targets", "two_programs:targets")
        ended = dt.datetime.now(dt.timezone.utc)
        assert code == 0, log
        assert (summary["entriesWritten"], summary["entriesFound"]) == ((2, 0) if attempt == "writes" else (0, 2))
        assert len(summary["keys"]) == 2 and summary["manifestEntries"] == 2 and "manifestError" not in summary
        blobs = {b.name.removeprefix("jax/"): b for b in storage_only.list_blobs(bucket, prefix="jax/")
                 if b.name.endswith("-cache")}
        relied = {n: b for n, b in blobs.items() if n.removesuffix("-cache").rsplit("-", 1)[1][:16] in summary["keys"]}
        assert len(relied) == 2 and OLD_PROGRAM not in relied
        manifest, content_type = read_manifest(storage_only, bucket, name)
        assert content_type == "application/json"
        # GCS's own values, read here through another client (the emulator gives md5Hash and
        # generation as GCS does: base64, and a decimal string in JSON).
        assert manifest["entries"] == [{"name": n, "size": relied[n].size, "md5": relied[n].md5_hash,
                                        "generation": str(relied[n].generation), "packed": True} for n in sorted(relied)]
        # Both small: in the Job's pack too (issue 30; tests/integration/test_copier_packs.py).
        assert manifest["pack"]["name"] == name.removesuffix(".json") + ".cachewarm-pack" and summary["packEntries"] == 2
        assert all(b.size > 0 and b.md5_hash for b in relied.values())
        assert (manifest["version"], manifest["pool"]) == (2, "cpu")
        written_blob = storage_only.bucket(bucket).get_blob(name)
        assert written_blob is not None and summary["manifestGeneration"] == str(written_blob.generation)
        recorded.append(summary["manifestGeneration"])
        assert "manifestLeftOut" not in summary
        assert manifest["fingerprint"] == summary["fingerprint"]
        written = dt.datetime.strptime(manifest["writtenTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        assert began <= written <= ended, (began, written, ended)
    # The first Job's manifest is still the live object at the generation recorded, after
    # the second Job's warm: nothing rewrote it. (The emulator serves a non-current
    # generation, where a bucket without object versioning has none, so the live object's
    # generation is what is checked.)
    kept = storage_only.bucket(bucket).get_blob(first)
    assert kept is not None and str(kept.generation) == recorded[0]


def test_a_warm_that_cannot_name_its_entries_removes_the_pools_manifest(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """A python entrypoint run in process names its entries: a manifest. Then the same
    program run in a child process the warmer cannot count (sh -c, python -E): it cannot tell which entries it used, so
    the manifest, which would name an older run's entries, goes and pods copy the prefix."""
    bucket = f"manifest-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    name = "jax/.cachewarm/pools/ns/llama/cpu/llama-cpu-0123456789.json"
    url, manifest = f"gs://{bucket}/jax", f"gs://{bucket}/{name}"
    script = tmp_path / "entry.py"
    script.write_text("import jax, jax.numpy as jnp\nprint(jax.jit(lambda x: x * 3)(jnp.ones(3)))\n")
    code, summary, log = gcs_warm(tmp_path, storage_bed, url, manifest, "command", "--", "python", str(script))
    assert code == 0, log
    assert summary["manifestEntries"] == len(summary["keys"]) >= 1
    assert len(read_manifest(storage_only, bucket, name)[0]["entries"]) == summary["manifestEntries"]
    assert summary["manifestGeneration"] == str(storage_only.bucket(bucket).get_blob(name).generation)
    code, summary, log = gcs_warm(tmp_path, storage_bed, url, manifest, "command", "--", "sh", "-c",
                                  f"{sys.executable} -E {script}")
    assert code == 0, log
    assert "keys" not in summary and "manifestEntries" not in summary and "manifestError" not in summary
    assert "manifestGeneration" not in summary  # none written: nothing for the operator to record
    assert storage_only.bucket(bucket).get_blob(name) is None
    assert "Removed the manifest" in log
    # Nothing to remove is no error either.
    code, summary, log = gcs_warm(tmp_path, storage_bed, url, manifest, "command", "--", "sh", "-c",
                                  f"{sys.executable} -E {script}")
    assert code == 0 and "manifestError" not in summary, log


def test_a_manifest_that_cannot_be_written_is_reported_and_the_warm_stands(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    bucket = f"manifest-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    code, summary, log = gcs_warm(tmp_path, storage_bed, f"gs://{bucket}/jax", "gs://no-such-bucket-cw/m/cpu.json",
                                  "targets", "warm_targets:quick_targets")
    assert code == 0, log
    assert summary["errors"] == [] and summary["entriesWritten"] == 1 and len(summary["keys"]) == 1
    assert "manifestEntries" not in summary and "manifestGeneration" not in summary
    assert summary["manifestError"].startswith("could not write the manifest gs://no-such-bucket-cw/m/cpu.json")
    assert "Could not write the manifest" in log


def test_an_entry_whose_digests_cannot_be_read_is_left_out_and_a_rewritten_manifest_is_not_reported(
    storage_bed: Testbed, storage_only: storage.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warmer's own calls, in this process against the emulator: an entry GCS does not
    list (gone, or without md5Hash or generation) is left out of the manifest, counted; a
    manifest object that does not hold the bytes just written (rewritten meanwhile) gives no
    generation, so the operator records none."""
    from cachewarm.agents import warmer  # noqa: PLC0415

    for key, value in storage_bed.env().items():
        if key != "KUBECONFIG":
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(warmer, "_FILESYSTEM", None)
    bucket = f"manifest-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    there, gone = "jit_a-" + "a" * 64 + "-cache", "jit_b-" + "b" * 64 + "-cache"
    storage_only.bucket(bucket).blob(f"jax/{there}").upload_from_string(b"entry")
    name = "jax/.cachewarm/pools/ns/llama/cpu/llama-cpu-0123456789.json"
    out = warmer.write_manifest(f"gs://{bucket}/{name}", [there, gone], None, f"gs://{bucket}/jax")
    blob = storage_only.bucket(bucket).get_blob(name)
    assert blob is not None
    assert out == {"manifestEntries": 1, "manifestGeneration": str(blob.generation), "manifestLeftOut": 1}
    assert [e["name"] for e in json.loads(blob.download_as_bytes())["entries"]] == [there]
    blob.upload_from_string(b'{"version": 2, "entries": []}')  # someone else's bytes now
    with pytest.raises(ValueError, match="does not hold the manifest just written"):
        warmer.written_generation(f"{bucket}/{name}", b'{"version":2,"entries":[]} ')


MULTI_HOST_TARGETS = '''
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def targets():
    # One program over both processes' devices: only possible in one distributed runtime.
    assert jax.process_count() == 2, jax.process_count()
    mesh = Mesh(jax.devices(), ("x",))
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    yield f, (jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
              jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P())))
'''

# What a training entrypoint does on a multi-host pool: it initializes the runtime itself
# (jax reads JAX_COORDINATOR_ADDRESS from the env; the count and id are passed).
MULTI_HOST_ENTRYPOINT = '''
import os
import socket
import jax
import jax.numpy as jnp

jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                           process_id=int(os.environ["JAX_PROCESS_ID"]))
assert jax.process_count() == 2, jax.process_count()
print(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(8)).sum())
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def warm_two_hosts(tmp_path: Path, *args: str) -> list[tuple[int, dict[str, Any], str]]:
    """The warmer file as the two pods of an Indexed Job run it: same cache directory,
    JAX_COORDINATOR_ADDRESS of process 0, JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=0/1."""
    lone = tmp_path / "warm.py"
    lone.write_text(WARMER.read_text())
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for index in (0, 1):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
               "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(index),
               "CACHEWARM_SUMMARY_FILE": str(tmp_path / f"termination-log-{index}")}
        procs.append(subprocess.Popen([sys.executable, str(lone), *args], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for index, proc in enumerate(procs):
        try:
            _, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
        summary_file = tmp_path / f"termination-log-{index}"
        out.append((proc.returncode, json.loads(summary_file.read_text()) if summary_file.exists() else {}, stderr))
    return out


def test_two_processes_form_one_runtime_and_count_each_entry_once(tmp_path: Path) -> None:
    (tmp_path / "mh_targets.py").write_text(MULTI_HOST_TARGETS)
    results = warm_two_hosts(tmp_path, "targets", "mh_targets:targets")
    for code, summary, log in results:
        assert code == 0, log
        assert summary["errors"] == [] and summary["programs"] >= 1
    (_, first, log0), (_, second, _) = results
    assert "Joined the JAX distributed runtime process=0 processes=2" in log0
    assert (first["processIndex"], second["processIndex"]) == (0, 1)
    entries = sorted((tmp_path / "cache").glob("*-cache"))
    # Process 0 wrote them, and only its summary counts them.
    assert first["entriesWritten"] == len(entries) >= 1
    assert first["bytesWritten"] == sum(p.stat().st_size for p in entries)
    assert second["entriesWritten"] == 0 and second["bytesWritten"] == 0
    # Every process reports the PYTHONPATH it started with, not process 0 alone.
    assert first["imagePythonPath"] == second["imagePythonPath"] == os.environ.get("PYTHONPATH", "")


def test_command_mode_leaves_distributed_init_to_the_entrypoint(tmp_path: Path) -> None:
    (tmp_path / "train_mh.py").write_text(MULTI_HOST_ENTRYPOINT)
    results = warm_two_hosts(tmp_path, "command", "--", "python", "train_mh.py")
    for code, summary, log in results:
        # A second initialize() (the warmer's, then the entrypoint's) would fail here.
        assert code == 0, log
        assert summary["errors"] == [] and summary["mode"] == "command"
    (_, first, _), (_, second, log1) = results
    assert "Joined the JAX distributed runtime" not in log1
    assert (first["processIndex"], second["processIndex"]) == (0, 1)
    assert first["entriesWritten"] >= 1 and second["entriesWritten"] == 0


def test_a_gs_cache_needs_gcsfs_only_where_epath_would_use_it(tmp_path: Path) -> None:
    """etils.epath reaches gs:// through tensorflow's gfile where tensorflow is installed
    (a TF training image without gcsfs caches fine): the warmer asks epath, so it blames
    gcsfs only where epath would need it. Here tensorflow is a stand-in package whose
    gfile answers `exists`; gcsfs is hidden in both runs."""
    stub = tmp_path / "tf"
    (stub / "tensorflow" / "io").mkdir(parents=True)
    (stub / "tensorflow" / "__init__.py").write_text("from . import io\n")
    (stub / "tensorflow" / "io" / "__init__.py").write_text("from . import gfile\n")
    (stub / "tensorflow" / "io" / "gfile.py").write_text("def exists(path):\n    return False\n")
    probe = ("import sys; sys.modules['gcsfs'] = None; sys.path.insert(0, sys.argv[1]); import warmer; "
             "print(warmer.missing_libraries('gs://a-bucket/jax'))")

    def lacking(*path: Path) -> str:
        out = subprocess.run([sys.executable, "-c", probe, str(WARMER.parent)], capture_output=True, text=True,
                             timeout=120, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                               "PYTHONPATH": os.pathsep.join(map(str, path)),
                                               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()
    assert lacking() == "['gcsfs']"
    assert lacking(stub) == "[]"
