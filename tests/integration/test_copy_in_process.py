"""The local copy in process: no init container; cachewarm's sitecustomize.py, first on the
pod's PYTHONPATH (a ConfigMap volume of four files, built here from the package under their
shipped names), starts the copy at the start of a python process, in a child process that
holds the pod's lock, against the GCS emulator behind its fidelity proxy. The process's own
code runs while the copy is under way; once its `import jax` (the real one) returns, JAX's
file cache read (the real LRUCache.get, as JAX's compile calls it) of an entry the copy
plans waits for that entry alone, which the copier fetches first when asked (before a
large filler set); of three processes started at once one copies and the others wait for
it, each entry downloaded once; a bucket out of reach, or one that never answers, costs
the process a cold start, never its run, and never more than the deadline and grace;
nothing reaches its stdout; the image's own sitecustomize runs exactly once, with or
without the reporter; where no child can hold the pod's lock, the copy runs in the
process, before its first line."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from google.cloud import storage
from test_copier import base, downloads, entry, env_for, fill, manifest, process_env

from cachewarm.reconcile import configmaps
from cachewarm.builders import localcopy as lc
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.processes import free_port

pytestmark = pytest.mark.integration

# One that imports jax, then reads keys (argv[2:]) through JAX's file cache of the copy's
# directory (argv[1]) as JAX's compile does (jax._src.compilation_cache makes the same
# LRUCache of the cache dir, max_size -1 by default, and calls its get): each key's MD5
# (hex), or None for a miss.
READS = ("import hashlib, json, sys, jax\n"
         "from jax._src.lru_cache import LRUCache\n"
         "_c = LRUCache(sys.argv[1], max_size=-1)\n"
         "print(json.dumps([(lambda v: v and hashlib.md5(v).hexdigest())(_c.get(k)) for k in sys.argv[2:]]),"
         " flush=True)\n")
# The same at its first line, before any import of jax.
LISTS_FIRST = "import json, os, sys; print(json.dumps(sorted(os.listdir(sys.argv[1]))))"
STOPPED = "still running past the deadline: stopped"


def boot_dir(where: Path) -> Path:
    """The boot volume as the kubelet lays out the operator's ConfigMap (configmaps.boot_files
    and boot_bytecode_files) through the pod's volume items (localcopy.boot_volume): the
    files in a hidden timestamped directory, `..data` a symlink to it, and each top-level
    entry (a file, or __pycache__) a symlink through `..data`, so a file's resolved
    directory is not the volume's."""
    where.mkdir()
    stamped = where / "..2026_11_24_04_00_00.000000001"
    stamped.mkdir()
    (where / "..data").symlink_to(stamped.name)
    volume = lc.boot_volume("c")["configMap"]
    assert volume["items"][:len(lc.BOOT_FILES)] == [{"key": k, "path": k} for k in lc.BOOT_FILES]
    keys = {**configmaps.boot_files(), **configmaps.boot_bytecode_files()}
    for item in volume["items"]:  # as the pod's volume maps the ConfigMap's keys
        path = stamped / item["path"]
        path.parent.mkdir(exist_ok=True)
        data = keys[item["key"]]
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    for top in {item["path"].split("/")[0] for item in volume["items"]}:
        (where / top).symlink_to(f"..data/{top}")
    return where


def python(boot: Path, settings: dict[str, str], code: str, *args: str, path: tuple[Path, ...] = ()
           ) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a pod's python process running `code`: the boot
    volume first on PYTHONPATH (then `path`, the image's own), the copy in process."""
    env = process_env({**settings, "CACHEWARM_COPY_IN_PROCESS": "1",
                       "PYTHONPATH": os.pathsep.join(str(p) for p in (boot, *path))})
    return [sys.executable, "-c", code, *args], env


def run(boot: Path, settings: dict[str, str], code: str, *args: str, path: tuple[Path, ...] = (),
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command, env = python(boot, settings, code, *args, path=path)
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out


class Lines:
    """A process's stdout read line by line in a thread, so that the test waits for the
    line it means; the timeout is only a failure guard (a process that never prints fails
    the test instead of hanging it)."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def next(self, what: str, timeout: float = 120) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout:.0f}s: {what}") from None
        assert line is not None, f"the output ended before {what}"
        return line.rstrip("\n")

    def rest(self, timeout: float = 120) -> list[str]:
        """Every line until the output ends."""
        out: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the output did not end within {timeout:.0f}s: {out}") from None
            if line is None:
                return out
            out.append(line.rstrip("\n"))


# Started at a program's first line: a thread that prints "waiting" once the main thread is
# inside sitecustomize's wait for an entry (`_until`, as _OnDemand.before, the hook on JAX's
# cache read, calls it for a planned entry not there yet), and nothing when it never gets
# there. The test holds the entry's download at the proxy until it reads this line, so a
# read returning only once its entry is there is shown by the order of events, not by a
# hang that must outlast anything.
WATCH = ("import sys as _s, threading as _t, time as _tm\n"
         "def _watch(main):\n"
         "    while main in _s._current_frames():\n"
         "        f = _s._current_frames().get(main)\n"
         "        while f is not None:\n"
         "            if f.f_code.co_name == '_until' and f.f_code.co_filename.endswith('sitecustomize.py') \\\n"
         "                    and f.f_back is not None and f.f_back.f_code.co_name == 'before':\n"
         "                print('waiting', flush=True)\n"
         "                return\n"
         "            f = f.f_back\n"
         "        _tm.sleep(0.005)\n"
         "_t.Thread(target=_watch, args=(_t.get_ident(),), daemon=True).start()\n")


def key(name: str) -> str:
    """The key JAX reads an entry by (its file name without `-cache`)."""
    return base(name).removesuffix("-cache")


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()  # noqa: S324 - what READS prints


def printed(stderr: str) -> list[dict[str, Any]]:
    """The copier's summary lines on stderr."""
    return [json.loads(line)["cachewarm-copier"] for line in stderr.splitlines()
            if line.startswith('{"cachewarm-copier": ')]


def test_jaxs_reads_get_every_planned_entry_and_the_processs_stdout_is_its_own(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """Right after `import jax`, JAX's reads of the copy's directory get every entry the
    manifests name (waited for one by one where the copy is still under way) and miss one
    the bucket holds but no manifest names; once over, beside the summary only the lock is
    left (the plan and the asks removed)."""
    bucket, objects = fill(storage_only)
    p0, p1, p2, p3, _ = sorted(objects)
    pool = manifest(storage_only, bucket, "h100", [p0, p1, p3])
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    out = run(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, manifests=pool,
                                                   summary=str(summary_file)),
              READS, str(dest), *(key(n) for n in (p3, p0, p2, p1)))
    # the program's line, nothing of ours
    assert out.stdout == json.dumps([md5_hex(objects[p3]), md5_hex(objects[p0]), None, md5_hex(objects[p1])]) + "\n"
    [summary] = printed(out.stderr)
    assert {k: summary[k] for k in ("source", "wanted", "copied", "failed", "cold", "errors")} == {
        "source": "manifest", "wanted": 3, "copied": 3, "failed": 0, "cold": False, "errors": []}
    assert json.loads(summary_file.read_text()) == summary
    for name in (p0, p1, p3):
        assert (dest / base(name)).read_bytes() == objects[name]
    # Beside the summary only the pod's lock: no temp file left.
    assert sorted(p.name for p in summary_file.parent.iterdir()) == ["local-copy.json", "local-copy.json.lock"]


# The program's first line: is jax installed (a find_spec that imports nothing, as
# libraries check), is the copy done (printed at once); then, right after `import jax`, is
# it done; then JAX's read of the key argv[3] (its MD5).
AROUND_JAX = WATCH + (
    "import importlib.util, json, os, sys; s = sys.argv[2]\n"
    "print(json.dumps([importlib.util.find_spec('jax') is not None, os.path.exists(s)]), flush=True)\n"
    "import jax; after = os.path.exists(s); import jax._src.monitoring as m, hashlib\n"
    "print(json.dumps({'after': after, "
    "'loaders': [type(jax.__loader__).__name__, type(jax.__spec__.loader).__name__], "
    "'hooks': [type(f).__name__ for f in sys.meta_path], "
    "'reporting': any(getattr(f, '__qualname__', '') == 'Tally.on_event' for f in m.get_event_listeners())}), "
    "flush=True)\n"
    "from jax._src.lru_cache import LRUCache\n"
    "print(hashlib.md5(LRUCache(sys.argv[1], max_size=-1).get(sys.argv[3])).hexdigest(), flush=True)\n")
HELD = "download"  # the proxy's hold on the copy's first download


@pytest.mark.parametrize("report", [False, True], ids=["without-reporter", "with-reporter"])
def test_the_program_starts_while_the_copy_runs_and_jax_reads_an_entry_once_it_is_there(
        report: bool, tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The copy overlaps the process's start: the download of one entry is held at the
    proxy, and the program's first line runs meanwhile (no summary yet), asking first
    whether jax is installed (a find_spec that must not take the hook away); `import jax`
    returns while the copy still runs (no summary: that entry is held), and JAX's read of
    that entry waits for it (seen from within it), let go only then, and gets its bytes.
    With the reporter, its own hook on jax's import runs too (both wrap jax's loader), and
    jax keeps its own loader."""
    bucket, objects = fill(storage_only)
    held = sorted(objects)[4]
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    settings = env_for(storage_bed, bucket, dest, summary=str(summary_file))
    if report:
        settings["CACHEWARM_REPORT_URL"] = f"http://127.0.0.1:{free_port()}/report"
    command, env = python(boot_dir(tmp_path / "boot"), settings, AROUND_JAX, str(dest), str(summary_file), key(held))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(held)}", "hold": HELD, "times": 1}])
    # stderr read to its end: the copier child's too (it may end after the program).
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        # installed; the first line ran before the copy's end
        assert json.loads(out.next("the program's first line")) == [True, False]
        line = json.loads(out.next("the program's line after `import jax`"))
        assert out.next("the process waiting for the entry in JAX's read") == "waiting"
        proxy.wait_held(HELD)  # the copy is under way: planned, that download held
        assert not summary_file.exists()
        proxy.release(HELD)
        assert out.next("JAX's read of the entry") == md5_hex(objects[held])
        assert out.rest() == [] and process.wait(timeout=60) == 0
        assert process.stderr is not None
        [summary] = printed(process.stderr.read())
    finally:
        proxy.clear_faults()
        process.kill()
    assert line["after"] is False and summary["copied"] == 5
    assert line["loaders"] == ["SourceFileLoader", "SourceFileLoader"]
    assert not {"_WaitForCopy", "_JaxWatch"} & set(line["hooks"]), line["hooks"]
    assert line["reporting"] is report


def test_a_process_forked_before_jax_waits_for_the_entry_too(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """A process that forks (a data loader, a multiprocessing worker) while the copy runs:
    the fork inherits the hook at `import jax` (the copier is not its child: it reads the
    plan and asks as its parent does): both are seen waiting in JAX's read of an entry
    whose download is held, and both get it right after."""
    bucket, objects = fill(storage_only)
    held = sorted(objects)[4]
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    program = ("import json, os, sys; pid = os.fork()\n" + WATCH +
               "import jax, hashlib; from jax._src.lru_cache import LRUCache\n"
               "got = hashlib.md5(LRUCache(sys.argv[1], max_size=-1).get(sys.argv[2])).hexdigest()\n"
               "print(json.dumps({'fork': pid == 0, 'got': got}), flush=True); pid and os.waitpid(pid, 0)")
    command, env = python(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
                          program, str(dest), key(held))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(held)}", "hold": HELD, "times": 1}])
    # stderr read to its end: the copier child's too (it may end after the program).
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        assert [out.next("both processes waiting in JAX's read") for _ in range(2)] == ["waiting"] * 2
        proxy.wait_held(HELD)
        assert not summary_file.exists()
        proxy.release(HELD)
        rest = out.rest()
        assert process.wait(timeout=60) == 0
        assert process.stderr is not None
        err = process.stderr.read()
    finally:
        proxy.clear_faults()
        process.kill()
    lines = sorted((json.loads(line) for line in rest), key=lambda line: line["fork"])
    assert lines == [{"fork": f, "got": md5_hex(objects[held])} for f in (False, True)]
    assert len(printed(err)) == 1


def test_the_entry_jax_reads_is_fetched_first_before_a_large_filler_set(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The plan holds the pod's one program's entry and 40 others (the programs a warmer
    wrote that this pod does not run), each smaller than it, so that the plan's order
    (smallest first) puts it last; one download at a time, and every filler's download held
    at the proxy. JAX's read of the pod's entry, right after `import jax`, gets it while
    the copier's one worker is still held in its first filler: asked for, it was fetched in
    a thread of its own, once, answered before any filler; the summary counts it on demand
    (`onDemand`, `onDemandEntries`), and the copy then ends whole."""
    import uuid

    bucket = f"copy-{uuid.uuid4().hex[:8]}"
    storage_only.create_bucket(bucket, location="us-central1")
    step = f"jax/{entry('jit_train_step', 'step')}"
    fillers = {f"jax/{entry(f'jit_filler{i}', str(i))}": os.urandom(1024) for i in range(40)}
    objects = {step: os.urandom(64 << 10), **fillers}
    for name, data in objects.items():
        storage_only.bucket(bucket).blob(name).upload_from_string(data)
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    settings = env_for(storage_bed, bucket, dest, summary=str(summary_file), workers="1")
    command, env = python(boot_dir(tmp_path / "boot"), settings, READS, str(dest), key(step))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    proxy.faults([{"method": "GET", "path": "/download/.*jit_filler", "hold": "fillers", "times": len(fillers),
                   "forward": True}])
    # The program ends once it has read its entry; the copier child goes on (stderr is read
    # to its end: the child's too, its summary last).
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        assert json.loads(out.next("JAX's read of the pod's entry")) == [md5_hex(objects[step])]
        proxy.wait_held("fillers")  # the worker is in its first filler, held
        assert proxy.holds()["fillers"]["arrived"] == 1 and not summary_file.exists()
        proxy.release("fillers")
        assert out.rest() == [] and process.wait(timeout=120) == 0
        assert process.stderr is not None
        [summary] = printed(process.stderr.read())
    finally:
        proxy.clear_faults()
        process.kill()
    assert (summary["onDemand"], summary["onDemandEntries"]) == (1, [base(step)]), summary
    assert (summary["copied"], summary["failed"], summary["cold"]) == (41, 0, False), summary
    answered = [r["path"].rsplit("/", 1)[-1] for r in proxy.log()
                if r["method"] == "GET" and r["path"].startswith("/download/") and r["status"] == 200]
    assert answered[0] == base(step) and answered.count(base(step)) == 1, answered
    for name, data in objects.items():
        assert (dest / base(name)).read_bytes() == data


def copier_child(parent: int) -> int:
    """The pid of `parent`'s copier child (its command line names cachewarm_copier; empty
    for a moment while it execs, so looked for again for up to 10 s)."""
    import time

    for _ in range(200):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if ppid == parent and b"cachewarm_copier" in (entry / "cmdline").read_bytes():
                        return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no copier child of {parent}")


def test_a_copier_killed_midway_is_followed_by_a_copy_in_the_process(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The copier child is killed (OOM, say) during its first download (its listing is
    done, its downloads held at the proxy): it leaves no summary and lets go of the pod's
    lock, and the process, at `import jax`, copies itself (once per pod: the summary is
    then its own)."""
    bucket, objects = fill(storage_only)
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    go = tmp_path / "go"
    program = ("import json, os, sys, time; print('started', flush=True)\n"
               "while not os.path.exists(sys.argv[3]): time.sleep(0.05)\n"
               "import jax; print(json.dumps({'done': os.path.exists(sys.argv[2]), "
               "'listed': sorted(os.listdir(sys.argv[1]))}), flush=True)")
    command, env = python(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
                          program, str(dest), str(summary_file), str(go))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    proxy.faults([{"method": "GET", "path": "/download/", "hold": HELD, "times": 5}])
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "started\n"
        copier = copier_child(process.pid)
        proxy.wait_held(HELD)  # the copier listed the bucket and is in its first download
        assert any(r["path"].endswith("/o") for r in proxy.log())
        os.kill(copier, signal.SIGKILL)
        proxy.clear_faults()
        go.touch()
        out, err = process.communicate(timeout=60)
    finally:
        proxy.clear_faults()
        process.kill()
    assert process.returncode == 0, err
    line = json.loads(out)
    assert line == {"done": True, "listed": sorted(base(n) for n in objects)}
    [summary] = printed(err)  # the process's own; the killed child wrote none
    assert summary["copied"] == 5 and json.loads(summary_file.read_text()) == summary
    # The killed child's plan and asks removed by the copy in process (it took the lock).
    assert sorted(p.name for p in summary_file.parent.iterdir()) == ["local-copy.json", "local-copy.json.lock"]


def test_where_no_child_can_hold_the_pods_lock_the_copy_runs_before_the_first_line(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The summary's directory cannot be made (a file stands in its way), so there is no
    lock file to hand a child: the process copies itself, before its own first line."""
    bucket, objects = fill(storage_only)
    (tmp_path / "pod").write_text("not a directory")
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    out = run(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
              LISTS_FIRST, str(dest))
    assert json.loads(out.stdout) == sorted(base(n) for n in objects)
    [summary] = printed(out.stderr)
    assert summary["copied"] == 5 and summary["errors"] and "summary file" in summary["errors"][0], summary


def test_processes_started_at_once_copy_once_and_each_starts_on_the_whole_copy(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """Three processes of one pod (containers, or torchrun's workers) start at once: one
    copies, the others read its plan and ask it, and copy nothing. The copy's first
    download is held at the proxy until all three are seen waiting in JAX's reads, then
    answers a 503 (tried again), so that a process not held by the lock would copy
    meanwhile, and download that entry too, or read it half done."""
    bucket, objects = fill(storage_only)
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    command, env = python(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
                          WATCH + READS, str(dest), *(key(n) for n in sorted(objects)))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    proxy.faults([{"method": "GET", "path": "/download/", "status": 503, "hold": HELD, "times": 1}])
    started: list[subprocess.Popen[str]] = []
    try:
        started = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for _ in range(3)]
        for p in started:
            assert p.stdout is not None and p.stdout.readline() == "waiting\n"
        proxy.wait_held(HELD)
        assert not summary_file.exists()
        proxy.release(HELD)
        results = [p.communicate(timeout=120) for p in started]
    finally:
        proxy.clear_faults()
        for p in started:
            p.kill()
    assert [p.returncode for p in started] == [0, 0, 0], results
    wanted = [md5_hex(objects[n]) for n in sorted(objects)]
    assert [json.loads(out) for out, _ in results] == [wanted] * 3
    assert [downloads(proxy, name) for name in sorted(objects)] == [1] * 5
    summaries = [s for _, err in results for s in printed(err)]
    assert len(summaries) == 1, summaries  # one process copied, the others found its summary
    [summary] = summaries
    assert (summary["copied"], summary["cold"]) == (5, False)
    assert json.loads(summary_file.read_text()) == summary
    for name, data in objects.items():
        assert (dest / base(name)).read_bytes() == data


def test_a_bucket_out_of_reach_is_a_cold_start_and_the_process_runs(tmp_path: Path) -> None:
    summary_file = tmp_path / "local-copy.json"
    settings = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}", "CACHEWARM_COPY_BUCKET": "gone",
                "CACHEWARM_COPY_DEST": str(tmp_path / "cache"), "CACHEWARM_COPY_SUMMARY": str(summary_file)}
    program = "import os, sys, jax; print('training', os.path.exists(sys.argv[1]))"  # waited for: done
    out = run(boot_dir(tmp_path / "boot"), settings, program, str(summary_file))
    assert out.stdout == "training True\n"
    [summary] = printed(out.stderr)
    assert summary["cold"] is True and summary["copied"] == 0 and summary["errors"], summary
    assert json.loads(summary_file.read_text()) == summary


class Drip:
    """A bucket that answers every request with a 200 and a long body, one byte every
    0.2 s: no read ever times out, so no deadline of the copier's own ends it."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.stop = threading.Event()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
            while not self.stop.wait(0.2):
                conn.sendall(b" ")

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.socket.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        threading.Thread(target=self._accept, daemon=True).start()
        try:
            yield self.url
        finally:
            self.stop.set()
            self.socket.close()


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """Connections accepted (the listen backlog), nothing ever answered."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"


@pytest.mark.parametrize(("bucket", "grace"), [(black_hole, "0"), (lambda: Drip().serving(), "1")],
                         ids=["black-hole", "drip"])
def test_a_copy_past_its_deadline_and_grace_is_stopped_and_the_process_runs(
        bucket: Any, grace: str, tmp_path: Path) -> None:
    """The copier child is stopped at its deadline (1 s) and grace (its watchdog), its
    summary says so, and the process, waiting for it at `import jax`, runs on, cold. A
    black-holed bucket: the copier's own bound on each request would end it too. A
    dripping bucket: the copy never ends by itself (nor the process's wait, without the
    bound: the test's timeout)."""
    summary_file = tmp_path / "local-copy.json"
    with bucket() as url:
        settings = {"STORAGE_EMULATOR_HOST": url, "CACHEWARM_COPY_BUCKET": "silent",
                    "CACHEWARM_COPY_DEST": str(tmp_path / "cache"), "CACHEWARM_COPY_SUMMARY": str(summary_file),
                    "CACHEWARM_COPY_DEADLINE_SECONDS": "1", "CACHEWARM_COPY_GRACE_SECONDS": grace}
        program = "import os, sys, jax; print('training', os.path.exists(sys.argv[1]))"
        out = run(boot_dir(tmp_path / "boot"), settings, program, str(summary_file), timeout=30)
    assert out.stdout == "training True\n"  # after the copier's stop
    [summary] = printed(out.stderr)
    assert summary["cold"] is True and summary["copied"] == 0, summary
    assert STOPPED in summary["errors"], summary
    assert json.loads(summary_file.read_text()) == summary


def test_a_pod_lock_never_let_go_holds_the_process_at_most_the_deadline_and_grace(tmp_path: Path) -> None:
    """Another process of the pod holds the lock and never lets go (here: this test): the
    process starts no copy of its own, waits at `import jax` for the deadline (1 s) and
    grace (5 s), then runs, cold, copies nothing, and leaves nothing behind that would take
    the lock once the holder lets go (the lock is then free to anyone). That the wait is
    bounded is shown by the order of events: the process goes on while this test still
    holds the lock (an unbounded wait never would: the read below would fail)."""
    import fcntl
    import time

    summary_file, go = tmp_path / "local-copy.json", tmp_path / "go"
    settings = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}", "CACHEWARM_COPY_BUCKET": "held",
                "CACHEWARM_COPY_DEST": str(tmp_path / "cache"), "CACHEWARM_COPY_SUMMARY": str(summary_file),
                "CACHEWARM_COPY_DEADLINE_SECONDS": "1", "CACHEWARM_COPY_GRACE_SECONDS": "5"}
    program = ("import os, sys, time; t = time.time(); import jax; print(round(time.time() - t, 1), flush=True)\n"
               "while not os.path.exists(sys.argv[1]): time.sleep(0.05)")
    command, env = python(boot_dir(tmp_path / "boot"), settings, program, str(go))
    with open(f"{summary_file}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = Lines(process.stdout)
        waited = float(out.next("the process going on past its wait, the lock still held"))
    for _ in range(20):  # let go above; for 1 s, while the process runs, nothing takes it
        with open(f"{summary_file}.lock") as again:
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if something of it took it
        time.sleep(0.05)
    go.touch()
    assert out.rest() == []
    assert process.stderr is not None
    err = process.stderr.read()
    assert process.wait(timeout=30) == 0, err
    # It did not give up early: at least the bound (plus jax's own import, which a loaded
    # machine only lengthens; no upper bound is asserted, the order of events above is it).
    assert waited >= 6.0, waited
    assert printed(err) == [] and not summary_file.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("report", [False, True], ids=["without-reporter", "with-reporter"])
def test_the_images_own_sitecustomize_runs_exactly_once(report: bool, tmp_path: Path) -> None:
    """Ours shadows the image's (later on PYTHONPATH) and runs it itself, once, whether the
    reporter starts (CACHEWARM_REPORT_URL) or not; from a boot volume laid out as the
    kubelet does (symlinks), which once made the reporter run ours again and again."""
    image = tmp_path / "image-lib"
    image.mkdir()
    (image / "sitecustomize.py").write_text("print('image sitecustomize')\n")
    # No bucket: the copy is a cold start at once (bad settings), this test is not about it.
    settings = {"CACHEWARM_COPY_DEST": str(tmp_path / "cache"), "CACHEWARM_COPY_SUMMARY": str(tmp_path / "local-copy.json")}
    if report:
        settings["CACHEWARM_REPORT_URL"] = f"http://127.0.0.1:{free_port()}/report"
    reporting = "import sys; print(any(type(f).__name__ == '_JaxWatch' for f in sys.meta_path))"
    out = run(boot_dir(tmp_path / "boot"), settings, reporting, path=(image,))
    assert out.stdout.splitlines() == ["image sitecustomize", str(report)]
    # The copier child's (the program does not import jax, so does not wait for it; the
    # harness reads stderr to its end, the child's too).
    [summary] = printed(out.stderr)
    assert summary["cold"] is True and "CACHEWARM_COPY_BUCKET" in summary["errors"][0], summary


def test_the_boot_code_runs_from_the_shipped_bytecode_and_an_edited_source_from_itself(tmp_path: Path) -> None:
    """A ConfigMap volume is read-only, so python cannot cache the bytecode of what it loads
    from there: the operator ships it (boot_bytecode_files, placed by boot_volume's items),
    and python's import (-v says so) takes all four modules from it, the reporter's too (the
    copier's in the copier child, which gets the process's -v). A
    source edited in the ConfigMap is compiled and run as it is, never as the bytecode of
    the operator's text (the pycs are checked-hash ones: with unchecked ones, this fails);
    bytecode python cannot read is compiled around."""
    boot = boot_dir(tmp_path / "boot")
    # The volume is read-only (and this test may run as root): python writes no bytecode.
    summary_file = tmp_path / "local-copy.json"
    settings = {"CACHEWARM_COPY_DEST": str(tmp_path / "cache"), "CACHEWARM_COPY_SUMMARY": str(summary_file),
                "CACHEWARM_REPORT_URL": f"http://127.0.0.1:{free_port()}/report", "PYTHONDONTWRITEBYTECODE": "1"}
    command, env = python(boot, settings, "print('training')")
    out = subprocess.run([command[0], "-v", *command[1:]], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "training\n", out.stderr[-2000:]
    tag = sys.implementation.cache_tag

    def from_bytecode(shipped: str, stderr: str) -> bool:
        return f"{boot}/__pycache__/{lc.bytecode_key(shipped, tag)} matches {boot}/{shipped}" in stderr
    for shipped in ("sitecustomize.py", "cachewarm_copier.py", "cachewarm_reporter.py"):
        assert from_bytecode(shipped, out.stderr), shipped
    # The warmer's file, which the reporter loads when it first reports, as it loads it.
    load = ("import importlib.util as u, sys; s = u.spec_from_file_location('_cachewarm_warmer', sys.argv[1]); "
            "s.loader.exec_module(u.module_from_spec(s))")
    out = subprocess.run([sys.executable, "-v", "-c", load, str(boot / "warm.py")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and from_bytecode("warm.py", out.stderr), out.stderr[-2000:]
    # An edit (the kubelet swaps ..data to a new directory; here the file in place).
    copier = boot / "..data" / "cachewarm_copier.py"
    edited = copier.read_text().replace('if __name__ == "__main__":', 'print("edited copier", file=sys.stderr)\n\n'
                                        'if __name__ == "__main__":')
    copier.unlink()
    copier.write_text(edited)
    summary_file.unlink()  # else the copy is done: no copier starts
    out = subprocess.run([command[0], "-v", *command[1:]], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "edited copier" in out.stderr, out.stderr[-2000:]
    assert not from_bytecode("cachewarm_copier.py", out.stderr)
    # Bytecode of another python under this one's name (a pre-release sharing its cache
    # tag), beside a source it was compiled from: python refuses its magic (-v says so) and
    # compiles the source, and the process runs, reporter and all.
    pyc = boot / "..data" / "__pycache__" / lc.bytecode_key("cachewarm_reporter.py", tag)
    pyc.write_bytes(bytes([pyc.read_bytes()[0] ^ 0xFF]) + pyc.read_bytes()[1:])
    out = subprocess.run([command[0], "-v", *command[1:]], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "training\n", out.stderr[-2000:]
    assert "bad magic number in 'cachewarm_reporter'" in out.stderr
    assert not from_bytecode("cachewarm_reporter.py", out.stderr) and from_bytecode("sitecustomize.py", out.stderr)
    assert f"code object from {boot}/cachewarm_reporter.py\n" in out.stderr


# Started at a program's first line: prints "waiting" once the main thread waits in
# sitecustomize's load_plan for the copier's plan (`_until` called from it), as WATCH does
# for an entry.
WATCH_PLAN = WATCH.replace("f.f_back.f_code.co_name == 'before'", "f.f_back.f_code.co_name == 'load_plan'")


def test_a_plan_left_by_a_killed_copier_is_not_read_before_the_new_copiers_sweep(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """A container restart after its copier was killed (the pod's emptyDir kept): the old
    plan and asks are still beside the summary, and the directory holds a file under a
    planned entry's name whose bytes are not the bucket's (the new copy's sweep removes it).
    The process that takes the pod's lock removes them before its copier starts, so JAX's
    read waits for the new plan (seen from within it, while the copier's listing is held at
    the proxy) and then gets the bucket's bytes; before, it read the old file at once."""
    bucket, objects = fill(storage_only)
    held = sorted(objects)[0]
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    dest.mkdir()
    (dest / base(held)).write_bytes(b"not the bucket's bytes")
    summary_file.parent.mkdir()
    Path(f"{summary_file}.plan").write_text(f"{base(held)}\n")
    Path(f"{summary_file}.want").mkdir()
    Path(f"{summary_file}.want", base(held)).touch()
    go = tmp_path / "go"
    program = WATCH_PLAN + (
        "import hashlib, os, sys, time; print('started', flush=True)\n"
        "while not os.path.exists(sys.argv[3]): time.sleep(0.01)\n"
        "import jax\n"
        "from jax._src.lru_cache import LRUCache\n"
        "print(hashlib.md5(LRUCache(sys.argv[1], max_size=-1).get(sys.argv[2])).hexdigest(), flush=True)\n")
    command, env = python(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
                          program, str(dest), key(held), str(go))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": f"/b/{bucket}/o$", "hold": "listing", "times": 1, "forward": True}])
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        assert out.next("the program's first line") == "started"
        proxy.wait_held("listing")  # the new copier is listing: its sweep and plan to come
        assert not Path(f"{summary_file}.plan").exists() and not Path(f"{summary_file}.want").exists()
        go.touch()
        assert out.next("the process waiting for the new plan in `import jax`") == "waiting"
        proxy.release("listing")
        assert out.next("JAX's read of the entry") == md5_hex(objects[held])
        assert out.rest() == [] and process.wait(timeout=60) == 0
    finally:
        proxy.clear_faults()
        process.kill()


# Prints "waiting" once the main thread waits for the whole copy (`_until` called from
# sitecustomize's `_wait`, the fallback where the hook cannot serve this jax).
WATCH_WHOLE = WATCH.replace("f.f_back.f_code.co_name == 'before'", "f.f_back.f_code.co_name == '_wait'")


def another_jax(where: Path) -> Path:
    """A `jax` of another layout: jax._src.lru_cache.LRUCache.get(self, key) and "-cache" as
    the hook knows them, but its compile reads the cache through a class of its own (a
    future jax that kept the module for something else). Not real JAX: no real version has
    this layout, and the real one's check is the other tests'."""
    src = where / "jax" / "_src"
    src.mkdir(parents=True)
    (where / "jax" / "__init__.py").write_text("from jax._src import compilation_cache, lru_cache\n")
    (src / "__init__.py").write_text("")
    (src / "lru_cache.py").write_text("_CACHE_SUFFIX = '-cache'\n"
                                      "class LRUCache:\n"
                                      "    def get(self, key):\n"
                                      "        return None\n")
    (src / "compilation_cache.py").write_text("class LRUCache:  # its own: the hook's wrap would never run\n"
                                              "    def get(self, key):\n"
                                              "        return None\n")
    return where


def test_a_jax_whose_compile_reads_through_another_class_waits_for_the_whole_copy(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The hook wraps jax._src.lru_cache.LRUCache.get only where jax._src.compilation_cache
    reads through that class; elsewhere `import jax` waits for the whole copy (seen from
    within the wait while the downloads are held), as for any layout it does not know."""
    bucket, objects = fill(storage_only)
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    go = tmp_path / "go"
    program = WATCH_WHOLE + (
        "import json, os, sys, time; print('started', flush=True)\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
        "import jax; print(json.dumps(os.path.exists(sys.argv[1])), flush=True)\n")
    command, env = python(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
                          program, str(summary_file), str(go), path=(another_jax(tmp_path / "image"),))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": "/download/", "hold": HELD, "times": len(objects), "forward": True}])
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        assert out.next("the program's first line") == "started"
        proxy.wait_held(HELD)  # planned (the plan is written before any download), downloads held
        assert Path(f"{summary_file}.plan").exists()
        go.touch()
        assert out.next("the process waiting for the whole copy at `import jax`") == "waiting"
        proxy.release(HELD)
        assert out.next("the program's line after `import jax`") == "true"
        assert out.rest() == [] and process.wait(timeout=60) == 0
    finally:
        proxy.clear_faults()
        process.kill()


def test_a_planned_entry_whose_download_fails_is_a_miss_at_once_not_at_the_copys_end(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """One planned entry's download fails (404: gone since the listing) while the rest of
    the copy is held at the proxy: the copier marks it failed beside the asks, and JAX's read
    of it returns a miss while the copy still runs (before: it waited for the copy's end)."""
    bucket, objects = fill(storage_only)
    *rest, failing = sorted(objects)
    dest, summary_file = tmp_path / "cache", tmp_path / "pod" / "local-copy.json"
    command, env = python(boot_dir(tmp_path / "boot"), env_for(storage_bed, bucket, dest, summary=str(summary_file)),
                          READS, str(dest), key(failing))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    # The others held until released, their retries too (a request the copier gives up on
    # after its timeout is tried again, and held again): the copy cannot end meanwhile.
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(failing)}", "status": 404, "times": 1},
                  *({"method": "GET", "path": f"/download/.*{base(n)}", "hold": HELD, "times": 8, "forward": True}
                    for n in rest)])
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(process.stdout)
        assert out.next("JAX's read of the failed entry") == "[null]"
        assert not summary_file.exists()  # the copy still runs: its other downloads are held
        proxy.release(HELD)
        assert out.rest() == [] and process.wait(timeout=60) == 0
        assert process.stderr is not None
        [summary] = printed(process.stderr.read())
    finally:
        proxy.clear_faults()
        process.kill()
    assert summary["failed"] == 1 and summary["copied"] == 4
