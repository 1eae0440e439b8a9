"""The copy on demand (issue 30): the copier's download queue (Downloads), from which an
entry a process of the pod asks for (a file of its name in the want directory) is started at
once in a thread of its own, each entry taken once; its plan file; and what the reporter
makes of a copy still under way (its plan's entries are the pod's cache, its summary comes
later). Real files and threads; the copier child against the GCS emulator and JAX's real
read are tests/integration/test_copy_in_process.py's."""

from __future__ import annotations

import http.server
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cachewarm.agents import copier, reporter

GUARD_SECONDS = 30.0  # a failure guard only: a wait that never ends fails instead of hanging


def wanted(name: str, size: int) -> copier.Wanted:
    base = f"jit_{name}-{name[0] * 64}-cache"
    return copier.Wanted(f"jax/{base}", copier.Entry(size, "A" * 22 + "==", "1"))


def test_an_entry_asked_for_before_the_downloads_start_is_started_in_a_thread_of_its_own_once(tmp_path: Path) -> None:
    """... at the process's priority, while the workers run at nice BACKGROUND_NICE (the
    rest of the copy yields the CPUs to the pod's start; Linux's nice value is a thread's)."""
    small, medium, large = wanted("a", 1), wanted("b", 2), wanted("c", 3)
    asks = tmp_path / "want"
    asks.mkdir()
    (asks / large.base).touch()
    (asks / f"jit_z-{'z' * 64}-cache").touch()  # not planned: nothing to fetch
    ran: list[tuple[str, tuple[str, int]]] = []
    lock = threading.Lock()

    def one(w: copier.Wanted) -> None:
        with lock:
            ran.append((w.base, (threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, 0))))

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert ours < copier.BACKGROUND_NICE
    queue = copier.Downloads([small, medium, large])
    queue.serve(one, 1, str(asks))
    assert Counter(base for base, _ in ran) == {small.base: 1, medium.base: 1, large.base: 1}
    assert dict(ran)[large.base] == ("cachewarm-asked", ours)
    assert dict(ran)[small.base] == dict(ran)[medium.base] == ("cachewarm-copy", copier.BACKGROUND_NICE)
    assert queue.asked == [large.base] and os.getpriority(os.PRIO_PROCESS, 0) == ours


def test_an_entry_asked_for_while_every_worker_is_busy_does_not_wait_for_them(tmp_path: Path) -> None:
    """The one worker is held in its first download until the asked entry has run: with the
    ask served only by the worker (a queue jump without a thread of its own), it would
    never be. An ask for the entry the worker holds, and one for a name asked twice, fetch
    nothing again."""
    first, other, asked = wanted("a", 1), wanted("b", 2), wanted("c", 3)
    asks = tmp_path / "want"
    asks.mkdir()
    in_first, asked_ran = threading.Event(), threading.Event()
    served_while_held: list[bool] = []
    ran: Counter[str] = Counter()
    lock = threading.Lock()

    def one(w: copier.Wanted) -> None:
        with lock:
            ran[w.base] += 1
        if w is first:
            in_first.set()
            served_while_held.append(asked_ran.wait(GUARD_SECONDS))
        elif w is asked:
            asked_ran.set()

    def ask() -> None:
        assert in_first.wait(GUARD_SECONDS)
        (asks / first.base).touch()  # in flight already
        (asks / asked.base).touch()

    asking = threading.Thread(target=ask)
    asking.start()
    queue = copier.Downloads([first, other, asked])
    queue.serve(one, 1, str(asks))
    asking.join()
    assert served_while_held == [True]
    assert ran == {first.base: 1, other.base: 1, asked.base: 1}
    assert queue.asked == [asked.base]


def test_without_a_want_directory_every_download_runs_in_the_plans_order_at_the_processs_priority() -> None:
    """(The init container's copy: nothing of the pod runs beside it.)"""
    entries = [wanted(n, i) for i, n in enumerate("abcde")]
    order: list[tuple[str, int]] = []
    queue = copier.Downloads(entries)
    queue.serve(lambda w: order.append((w.base, os.getpriority(os.PRIO_PROCESS, 0))), 1)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert order == [(w.base, ours) for w in entries] and queue.asked == []


def test_the_plan_is_written_whole_with_its_want_directory_and_dropped_with_it(tmp_path: Path) -> None:
    summary = str(tmp_path / "local-copy.json")
    copier.write_plan(summary, ["jit_a-x-cache", "jit_b-y-cache"])
    assert Path(copier.plan_path(summary)).read_text() == "jit_a-x-cache\njit_b-y-cache\n"
    assert Path(copier.want_dir(summary)).is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local-copy.json.plan", "local-copy.json.want"]
    (Path(copier.want_dir(summary)) / "jit_a-x-cache").touch()
    copier.drop_plan(summary)
    assert list(tmp_path.iterdir()) == []


def test_the_reporter_counts_the_entries_a_copy_still_brings_as_the_pods_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"jit_step-{'a' * 64}-cache").write_bytes(b"")
    plan = tmp_path / "local-copy.json.plan"
    plan.write_text(f"jit_step-{'a' * 64}-cache\njit_step-{'b' * 64}-cache\njit_eval-{'c' * 64}-cache\n")
    tally = reporter.Tally()
    tally.list_cache(str(cache), str(plan))
    assert tally.cached == {"jit_step": ["a" * 16, "b" * 16], "jit_eval": ["c" * 16]}
    tally.list_cache(str(cache), str(tmp_path / "none.plan"))  # over: the plan is gone, the directory is it
    assert tally.cached == {"jit_step": ["a" * 16]}


def test_a_report_sent_while_the_copy_runs_says_nothing_of_it_and_a_later_one_its_summary(tmp_path: Path) -> None:
    """No summary yet (the copy serves entries on demand and ends after the first compiles):
    no localCopy in the report, so neither cold nor failed; once the summary is there, the
    next report carries it."""
    summary = tmp_path / "local-copy.json"
    sender = reporter.Reporter(reporter.Tally(), {reporter.ENV_LOCAL_COPY: str(summary)}, tmp_path)
    assert "localCopy" not in sender.report()
    summary.write_text('{"copied": 2, "present": 0, "bytes": 10, "failed": 0, "cold": false, "seconds": 1.5, '
                       '"source": "manifest", "onDemand": 1}')
    assert sender.report()["localCopy"] == {"copied": 2, "present": 0, "bytes": 10, "failed": 0, "cold": False,
                                            "seconds": 1.5, "source": "manifest"}


def test_a_copy_that_ends_after_the_first_report_is_reported_as_soon_as_its_summary_appears(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the report thread's loop, to a real HTTP endpoint: the first report goes
    without localCopy; no compile follows (the steps run from the cache), yet the summary's
    arrival alone sends the next report, with it (before: the loop waited for a compile)."""
    monkeypatch.setattr(reporter, "FIRST_REPORT_SECONDS", 0.0)
    monkeypatch.setattr(reporter, "COPY_POLL_SECONDS", 0.05)
    got: queue.Queue[dict[str, Any]] = queue.Queue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            got.put(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        summary = tmp_path / "local-copy.json"
        tally = reporter.Tally()
        sender = reporter.Reporter(tally, {reporter.ENV_LOCAL_COPY: str(summary), reporter.ENV_REPORT_SECONDS: "1",
                                           reporter.ENV_REPORT_URL: f"http://127.0.0.1:{server.server_address[1]}/r"},
                                   tmp_path)
        tally.first.set()
        threading.Thread(target=sender.loop, daemon=True).start()
        first = got.get(timeout=GUARD_SECONDS)
        assert "localCopy" not in first
        summary.write_text('{"copied": 2, "present": 0, "bytes": 10, "failed": 0, "cold": false, "seconds": 1.5}')
        second = got.get(timeout=GUARD_SECONDS)
        assert second["localCopy"]["copied"] == 2 and second["sequence"] == first["sequence"] + 1
        assert not tally.changed.is_set()  # no compile since: the summary alone sent it
    finally:
        server.shutdown()


def test_a_copier_stopped_at_its_deadline_leaves_no_plan_nor_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """The watchdog's hard stop (os._exit): the plan and the asks go before the summary, as
    at a copy's end (else a container restart's processes would read by the old plan)."""
    summary = tmp_path / "local-copy.json"
    monkeypatch.setenv(copier.ENV_COPY_SUMMARY, str(summary))
    copier.write_plan(str(summary), [f"jit_a-{'a' * 64}-cache"])
    (tmp_path / "local-copy.json.want" / f"jit_a-{'a' * 64}-cache").touch()

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(SystemExit):
        copier._hard_stop(copier.new_summary("prefix"), 0.0, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local-copy.json"]


def test_a_process_of_another_user_can_ask(tmp_path: Path) -> None:
    """The want directory is made 1777 whatever the copier's umask (022 here): a process of
    another container of the pod, running as another user, can ask (here: nobody, 65534,
    in a child process; the test needs root to be another user)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    pod = Path(tempfile.mkdtemp())  # pytest's tmp_path is under a 0700 directory nobody cannot enter
    try:
        pod.chmod(0o755)
        summary = str(pod / "local-copy.json")
        old = os.umask(0o022)
        try:
            copier.write_plan(summary, ["jit_a-x-cache"])
        finally:
            os.umask(old)
        ask = Path(copier.want_dir(summary)) / "jit_a-x-cache"
        # touch, not this venv's python, which nobody may not run; the ask is made as the hook makes it
        out = subprocess.run(["touch", str(ask)], user=65534, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        assert ask.stat().st_uid == 65534
    finally:
        shutil.rmtree(pod)


def test_an_ask_is_never_made_through_a_link_another_container_left_in_the_want_directory(tmp_path: Path) -> None:
    # Attacker review: the ask was opened with O_CREAT alone, so a link planted in the (pod-wide,
    # 1777) want directory made the reading process create a file where the link pointed.
    import importlib.util

    spec = importlib.util.spec_from_file_location("cw_site_ask", copier.__file__.replace("copier.py", "sitecustomize.py"))
    assert spec is not None and spec.loader is not None
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    dest, summary = tmp_path / "copy", tmp_path / "pod" / "local-copy.json"
    dest.mkdir()
    summary.parent.mkdir()
    name = "jit_f-" + "a" * 64 + "-cache"
    Path(f"{summary}.plan").write_text(name + "\n")
    Path(f"{summary}.want").mkdir()
    target = tmp_path / "elsewhere"
    Path(f"{summary}.want", name).symlink_to(target)
    summary.write_text("{}")  # the copy is over: the wait ends at once

    class LRUCache:
        def __init__(self, path: Path) -> None:
            self.path = path

        def get(self, key: str) -> None:
            return None

    hook = site._OnDemand(f"{summary}.lock", str(summary), None, str(dest), LRUCache)
    hook.before(LRUCache(dest), name.removesuffix("-cache"))
    assert not target.exists() and not os.path.lexists(target)


def _site_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("cw_site_links", copier.__file__.replace("copier.py", "sitecustomize.py"))
    assert spec is not None and spec.loader is not None
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    return site


def test_a_stale_want_directory_that_is_a_link_is_removed_and_its_target_left_whole(tmp_path: Path) -> None:
    # Re-review: the lock holder emptied `<summary>.want` through a link another container of
    # the pod put there, deleting the target directory's files (a workspace, checkpoints).
    summary = tmp_path / "pod" / "local-copy.json"
    summary.parent.mkdir()
    theirs = tmp_path / "workspace"
    theirs.mkdir()
    (theirs / "checkpoint").write_text("keep")
    Path(f"{summary}.want").symlink_to(theirs)
    _site_module()._drop_stale_plan(str(summary))
    assert (theirs / "checkpoint").read_text() == "keep"
    assert not os.path.lexists(f"{summary}.want")
    # A real stale directory is still emptied and removed.
    Path(f"{summary}.want").mkdir()
    Path(f"{summary}.want", "jit_f-" + "a" * 64 + "-cache").touch()
    _site_module()._drop_stale_plan(str(summary))
    assert not os.path.lexists(f"{summary}.want")


def test_the_plans_want_directory_is_never_made_through_a_link(tmp_path: Path) -> None:
    # Re-review: makedirs(exist_ok) took a linked `.want` and chmod 1777 followed it.
    summary = tmp_path / "local-copy.json"
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    Path(copier.want_dir(str(summary))).symlink_to(theirs)
    copier.write_plan(str(summary), ["jit_f-" + "a" * 64 + "-cache"])
    assert oct(theirs.stat().st_mode & 0o7777) == oct(0o700)
    want = Path(copier.want_dir(str(summary)))
    assert want.is_dir() and not want.is_symlink() and want.stat().st_mode & 0o7777 == 0o1777
    # A failed marker is never created through a link either.
    target = tmp_path / "elsewhere"
    (want / ("jit_g-" + "b" * 64 + "-cache.failed")).symlink_to(target)
    copier.mark_failed(str(want), "jit_g-" + "b" * 64 + "-cache")
    assert not target.exists()
