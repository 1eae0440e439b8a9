"""torch caches (issue 31), the pure parts of the agents: the warmer's archive of the
Inductor directory (its members, what it leaves out, the same bytes for the same
directory) and the copier's extraction of one into a pod's directory, which trusts no name
in it: absolute paths, "..", links, devices and FIFOs are refused, a link planted in the
destination is never followed, a file already there is kept, and bombs past the bytes or
member bounds stop. Real directories and real tar files throughout."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from cachewarm.agents import copier, warmer


def inductor_dir(root: Path) -> Path:
    """A directory shaped like Inductor's after a warm (`<2 chars>/c<hash>.cpp/.so`,
    fxgraph/, aotautograd/, locks/), with what the archive must leave out: locks, and the
    temporary names torch's write_atomic and Triton's cache leave (see warmer.TORCH_TEMP_NAME)."""
    d = root / "inductor"
    for rel, data in {"ab/cabc.cpp": b"cpp", "ab/cabc.so": b"\x7fELF so", "fxgraph/x1/entry": b"fx",
                      "aotautograd/y2/entry": b"aot", "locks/ab.lock": b"", "ab/cabc.so.lock": b"",
                      "ab/.1234.140213.tmp": b"temp", "fxgraph/x1/.77.1.tmp": b"temp",
                      "triton/tmp.pid_12_0f3e/k.json": b"temp", "triton/HASH/k.cubin.tmp.pid_12_0f3e": b"temp",
                      "fxgraph/x1/" + copier.TORCH_TEMP_PREFIX + "9-ab": b"temp"}.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    os.chmod(d / "ab/cabc.so", 0o700)
    os.symlink("/etc/passwd", d / "ab/link")
    os.mkfifo(d / "fxgraph/fifo")
    return d


def members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return tar.getmembers()


def test_the_archive_holds_the_directorys_files_and_folders_sorted_and_nothing_else(tmp_path: Path) -> None:
    d = inductor_dir(tmp_path)
    data, files = warmer.torch_archive(str(d))
    got = members(data)
    assert [m.name for m in got] == ["ab", "ab/cabc.cpp", "ab/cabc.so", "aotautograd", "aotautograd/y2",
                                     "aotautograd/y2/entry", "fxgraph", "fxgraph/x1", "fxgraph/x1/entry",
                                     "triton", "triton/HASH"]
    assert files == 4
    assert all(m.isdir() or m.isreg() for m in got)
    assert {(m.name, oct(m.mode)) for m in got if m.isreg()} == {(n, "0o644") for n in (
        "ab/cabc.cpp", "ab/cabc.so", "aotautograd/y2/entry", "fxgraph/x1/entry")}  # the .so was 0o700
    assert all(oct(m.mode) == "0o755" for m in got if m.isdir())
    assert all(m.uid == 0 and m.gid == 0 and m.uname == "" and m.gname == "" for m in got)
    so = next(m for m in got if m.name == "ab/cabc.so")
    assert so.mtime == int((d / "ab/cabc.so").stat().st_mtime)


def test_the_same_directory_gives_the_same_bytes(tmp_path: Path) -> None:
    d = inductor_dir(tmp_path)
    one, _ = warmer.torch_archive(str(d))
    (d / "locks/another.lock").write_bytes(b"x")  # left out: no difference
    two, _ = warmer.torch_archive(str(d))
    assert hashlib.sha256(one).digest() == hashlib.sha256(two).digest()
    assert one[3] == 0 and one[4:8] == b"\0\0\0\0"  # gzip's header: no file name, no time
    (d / "fxgraph/x1/entry").write_bytes(b"fx2")
    os.utime(d / "fxgraph/x1/entry", (0, 0))
    three, _ = warmer.torch_archive(str(d))
    assert three != one


def test_an_empty_directory_has_no_files(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks/x.lock").write_bytes(b"")
    data, files = warmer.torch_archive(str(tmp_path))
    assert files == 0 and members(data) == []


def test_member_names_are_checked() -> None:
    assert copier.torch_member_parts("ab/./c.so") == ["ab", "c.so"]
    for bad in ("/etc/passwd", "../x", "ab/../../x", "a\x00b", "", ".", "a\\..\\b"):
        assert copier.torch_member_parts(bad) is None, bad


def tar_of(*items: tuple[str, Any]) -> bytes:
    """A gzip'd tar of (name, bytes | ("type", a TarInfo type)) members, written as a hostile one would."""
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb") as zipped, tarfile.open(fileobj=zipped, mode="w",
                                                                        format=tarfile.PAX_FORMAT) as tar:
        for name, what in items:
            info = tarfile.TarInfo(name)
            if isinstance(what, bytes):
                info.size = len(what)
                tar.addfile(info, io.BytesIO(what))
            else:
                info.type = what = what[1]
                if what in (tarfile.SYMTYPE, ("type", tarfile.LNKTYPE)):
                    info.linkname = "/etc/passwd"
                tar.addfile(info)
    return raw.getvalue()


def extract(tmp_path: Path, data: bytes, dest: Path, max_bytes: int = 1 << 20, max_files: int = 1000,
            counts: dict[str, Any] | None = None) -> dict[str, Any]:
    archive = tmp_path / f"torch-inductor-{hashlib.sha256(data).hexdigest()}-cache"
    archive.write_bytes(data)
    counts = counts if counts is not None else {"files": 0, "bytes": 0, "kept": 0, "refused": 0, "members": 0}
    copier.extract_torch(str(archive), str(dest), counts, max_bytes, max_files)
    return counts


def test_a_warmers_archive_extracts_whole_with_modes_any_uid_can_write_beside(tmp_path: Path) -> None:
    data, _ = warmer.torch_archive(str(inductor_dir(tmp_path)))
    dest = tmp_path / "pod"
    old = os.umask(0)
    try:
        counts = extract(tmp_path, data, dest)
    finally:
        os.umask(old)
    assert counts == {"files": 4, "bytes": len(b"cpp\x7fELF sofxaot"), "kept": 0, "refused": 0, "members": 11}
    assert (dest / "ab/cabc.so").read_bytes() == b"\x7fELF so"
    assert stat.S_IMODE((dest / "ab/cabc.so").stat().st_mode) == 0o666
    assert stat.S_IMODE((dest / "fxgraph/x1").stat().st_mode) == 0o777
    assert (dest / "ab/cabc.so").stat().st_mtime == int((tmp_path / "inductor/ab/cabc.so").stat().st_mtime)
    assert warmer.torch_archive(str(dest))[0] == data  # seeded, then archived again: the same bytes


def test_bad_bounds_are_an_error_in_the_summary(tmp_path: Path) -> None:
    summary = copier.new_summary("manifest")
    got = copier.seed_torch(str(tmp_path), {"CACHEWARM_TORCH_DIR": str(tmp_path / "pod"),
                                            "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES": "4Gi"}, summary)
    assert "ValueError" in got["error"] and summary["errors"]


@pytest.mark.parametrize(("env", "said"), [
    ({"CACHEWARM_CACHE_URL": "s3://bucket/x"}, "must be a gs:// URL"),
    ({"CACHEWARM_CACHE_URL": "gs://b/x", "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES": "lots"}, "not a whole number"),
    ({"CACHEWARM_CACHE_URL": "gs://b/x", "TORCHINDUCTOR_CACHE_DIR": ""}, "TORCHINDUCTOR_CACHE_DIR is not set"),
])
def test_a_torch_warm_with_bad_settings_runs_nothing_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  env: dict[str, str], said: str) -> None:
    ran = tmp_path / "ran"
    monkeypatch.setenv("CACHEWARM_FRAMEWORK", "torch")
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(tmp_path / "summary"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = warmer.main(["command", "--", "touch", str(ran)])
    summary = json.loads((tmp_path / "summary").read_text())
    assert code == 1 and not ran.exists()
    assert any(said in e for e in summary["errors"]) and summary["entriesWritten"] == 0


def test_hostile_members_are_refused_and_nothing_lands_outside(tmp_path: Path) -> None:
    dest = tmp_path / "pod"
    data = tar_of(("/abs-file", b"x"), ("../escaped", b"x"), ("ab/../../escaped2", b"x"),
                  ("sym", ("type", tarfile.SYMTYPE)), ("hard", ("type", tarfile.LNKTYPE)), ("dev", ("type", tarfile.CHRTYPE)),
                  ("blk", ("type", tarfile.BLKTYPE)), ("fifo", ("type", tarfile.FIFOTYPE)), ("good/file", b"ok"))
    counts = extract(tmp_path, data, dest)
    assert counts["refused"] == 8 and counts["files"] == 1
    assert sorted(p.name for p in dest.rglob("*")) == ["file", "good"]
    assert not (tmp_path / "escaped").exists() and not Path("/abs-file").exists()


def test_a_link_planted_in_the_destination_is_never_followed(tmp_path: Path) -> None:
    dest, outside = tmp_path / "pod", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (outside / "target").write_bytes(b"theirs")
    os.symlink(outside, dest / "ab")  # a directory the archive fills, planted as a link
    os.symlink(outside / "target", dest / "top")  # a file the archive writes, planted as a link
    counts = extract(tmp_path, tar_of(("ab/c.so", b"ours"), ("top", b"ours")), dest)
    # The directory link refuses its member; the file link is removed (unlink never follows
    # it) and the member written in its place.
    assert counts["refused"] == 1 and counts["files"] == 1
    assert sorted(p.name for p in outside.iterdir()) == ["target"]
    assert (outside / "target").read_bytes() == b"theirs"
    assert not (dest / "top").is_symlink() and (dest / "top").read_bytes() == b"ours"


def test_a_file_already_there_of_the_members_size_is_kept_not_overwritten(tmp_path: Path) -> None:
    dest = tmp_path / "pod"
    (dest / "ab").mkdir(parents=True)
    (dest / "ab/c.so").write_bytes(b"the pod's")  # the member's size: Inductor's names are content hashes
    counts = extract(tmp_path, tar_of(("ab/c.so", b"archive's"), ("ab/d.so", b"new")), dest)
    assert (counts["kept"], counts["files"]) == (1, 1)
    assert (dest / "ab/c.so").read_bytes() == b"the pod's"


def test_a_truncated_file_left_by_a_stopped_copy_is_replaced_and_stopping_leaves_no_partial_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy killed mid-member (its watchdog's os._exit) must not leave a short file under
    the member's name: a restarted copier would keep it and torch would load it (SIGBUS). A
    short one already there (from a copier before this fix) is replaced."""
    dest = tmp_path / "pod"
    (dest / "ab").mkdir(parents=True)
    (dest / "ab/c.so").write_bytes(b"\x7fEL")  # cut short
    body = b"\x7fELF the whole shared object"
    counts = extract(tmp_path, tar_of(("ab/c.so", body)), dest)
    assert (counts["kept"], counts["files"]) == (0, 1) and (dest / "ab/c.so").read_bytes() == body

    class Killed(BaseException):
        pass

    real = os.utime

    def killed(*args: Any, **kwargs: Any) -> None:  # the process dies with the bytes written, before the end
        raise Killed

    real_unlink = os.unlink
    monkeypatch.setattr(os, "utime", killed)
    monkeypatch.setattr(os, "unlink", lambda *a, **k: None)  # os._exit: no clean-up runs either
    fresh = tmp_path / "fresh"
    with pytest.raises(Killed):
        extract(tmp_path, tar_of(("ab/d.so", body)), fresh)
    monkeypatch.setattr(os, "utime", real)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert not (fresh / "ab/d.so").exists()  # nothing under the member's name
    left = [p.name for p in (fresh / "ab").iterdir()]
    assert len(left) == 1 and left[0].startswith(".cachewarm.tmp-")  # a temp name, which nothing reads
    counts = extract(tmp_path, tar_of(("ab/d.so", body)), fresh)
    assert counts["files"] == 1 and (fresh / "ab/d.so").read_bytes() == body


def test_a_stale_temp_name_is_skipped_by_inductor_and_left_out_of_a_warmers_archive() -> None:
    name = copier.TORCH_TEMP_PREFIX + "12-abcdef"
    assert name.startswith(".")  # Inductor's FX graph lookup skips names starting with "."
    assert not warmer.torch_member_kept(f"fxgraph/x1/{name}", False)


def test_extraction_stops_at_the_copys_deadline_and_says_so(tmp_path: Path) -> None:
    entries, pod = tmp_path / "entries", tmp_path / "pod"
    entries.mkdir()
    data = tar_of(("fxgraph/e", b"fx"))
    (entries / f"torch-inductor-{hashlib.sha256(data).hexdigest()}-cache").write_bytes(data)
    summary = copier.new_summary("manifest")
    got = copier.seed_torch(str(entries), {"CACHEWARM_TORCH_DIR": str(pod)}, summary, deadline=0.0)
    assert got["stoppedAtDeadline"] == 1 and got["files"] == 0 and "deadline" in summary["errors"][0]
    assert not (pod / "fxgraph").exists()


def test_directories_the_copier_makes_are_0o777_whatever_the_umask(tmp_path: Path) -> None:
    data, _ = warmer.torch_archive(str(inductor_dir(tmp_path)))
    dest = tmp_path / "pod"
    old = os.umask(0o022)
    try:
        extract(tmp_path, data, dest)
    finally:
        os.umask(old)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o777
    assert stat.S_IMODE((dest / "fxgraph/x1").stat().st_mode) == 0o777
    assert not (dest.stat().st_mode & stat.S_ISVTX)


def test_an_archive_whose_bytes_are_not_its_name_is_refused_and_only_the_copys_names_are_read(tmp_path: Path) -> None:
    entries, pod = tmp_path / "entries", tmp_path / "pod"
    entries.mkdir()
    good, evil = tar_of(("fxgraph/good", b"ok")), tar_of(("fxgraph/evil", b"code"))
    good_name = f"torch-inductor-{hashlib.sha256(good).hexdigest()}-cache"
    (entries / good_name).write_bytes(good)
    (entries / f"torch-inductor-{'2' * 64}-cache").write_bytes(evil)  # a name that is not its bytes' hash
    stray = tar_of(("fxgraph/stray", b"x"))
    (entries / f"torch-inductor-{hashlib.sha256(stray).hexdigest()}-cache").write_bytes(stray)  # not the copy's
    summary = copier.new_summary("manifest")
    got = copier.seed_torch(str(entries), {"CACHEWARM_TORCH_DIR": str(pod)}, summary,
                            names=[good_name, f"torch-inductor-{'2' * 64}-cache"])
    assert got["archives"] == 1 and got["archivesRefused"] == 1
    assert sorted(p.name for p in (pod / "fxgraph").iterdir()) == ["good"]
    assert "not the SHA-256" in summary["errors"][0]


@pytest.mark.parametrize("bound", ["bytes", "files"])
def test_a_bomb_past_the_bounds_stops_with_whole_files_only(tmp_path: Path, bound: str) -> None:
    dest = tmp_path / "pod"
    big = b"\0" * 4000  # compresses to almost nothing
    data = tar_of(*((f"f{i}", big) for i in range(10)))
    with pytest.raises(copier.TorchBound):
        if bound == "bytes":
            extract(tmp_path, data, dest, max_bytes=10000)
        else:
            extract(tmp_path, data, dest, max_files=3)
    written = sorted(p.name for p in dest.iterdir())
    assert written == (["f0", "f1"] if bound == "bytes" else ["f0", "f1", "f2"])
    assert all(p.stat().st_size == 4000 for p in dest.iterdir())


def test_the_bytes_bound_is_each_archives_and_the_members_bound_the_copys(tmp_path: Path) -> None:
    """maxArchiveSize is the uncompressed bytes of one archive (as the warmer bounds it): two
    archives of 600 bytes each pass a bound of 1000, one of 1200 does not; members count
    across the copy's archives."""
    dest = tmp_path / "pod"
    counts = extract(tmp_path, tar_of(("a", b"\0" * 600)), dest, max_bytes=1000)
    extract(tmp_path, tar_of(("b", b"\0" * 600)), dest, max_bytes=1000, counts=counts)
    assert sorted(p.name for p in dest.iterdir()) == ["a", "b"] and counts["bytes"] == 1200
    with pytest.raises(copier.TorchBound):
        extract(tmp_path, tar_of(("c", b"\0" * 600), ("d", b"\0" * 600)), dest, max_bytes=1000, counts=counts)
    with pytest.raises(copier.TorchBound):
        extract(tmp_path, tar_of(("e", b"e"), ("f", b"f")), dest, max_bytes=1000, max_files=5, counts=counts)
    assert sorted(p.name for p in dest.iterdir()) == ["a", "b", "c", "e"]


def test_seed_torch_extracts_the_verified_archives_and_says_what_it_did(tmp_path: Path) -> None:
    entries, pod = tmp_path / "entries", tmp_path / "pod"
    entries.mkdir()
    data = tar_of(("fxgraph/e", b"fx"), ("../x", b"x"))
    (entries / f"torch-inductor-{hashlib.sha256(data).hexdigest()}-cache").write_bytes(data)
    (entries / f"jit_f-{'0' * 64}-cache").write_bytes(b"a JAX entry: not extracted")
    summary = copier.new_summary("manifest")
    got = copier.seed_torch(str(entries), {"CACHEWARM_TORCH_DIR": str(pod)}, summary)
    assert {k: v for k, v in got.items() if k != "seconds"} == {"archives": 1, "files": 1, "bytes": 2, "kept": 0,
                                                                "refused": 1}
    assert [p.name for p in pod.iterdir()] == ["fxgraph"] and summary["errors"] == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / f"torch-inductor-{hashlib.sha256(b'not a tar').hexdigest()}-cache").write_bytes(b"not a tar")
    got = copier.seed_torch(str(broken), {"CACHEWARM_TORCH_DIR": str(tmp_path / "pod2")}, summary)
    assert got["archives"] == 0 and "ReadError" in got["error"] and "torch archives" in summary["errors"][0]


def test_a_torch_process_that_compiled_between_two_looks_still_reports_at_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's counters are polled (no listener): a process that compiles and exits before
    the next look is still reported, at exit, from the counters as they are then."""
    from cachewarm.agents import reporter

    counts = {"fxGraphHits": 3, "fxGraphMisses": 0, "aotAutogradHits": 2, "compileSeconds": 1.5}
    monkeypatch.setattr(reporter, "_load_fingerprint", lambda here, name="fingerprint": (
        (lambda: dict(counts)) if name == "torch_counts" else (lambda: {"framework": "torch"})))
    sent: list[dict[str, Any]] = []

    def record(who: Any) -> bool:  # instead of the POST
        sent.append(who.report())
        return True

    one = reporter.Reporter(reporter.Tally(), {"CACHEWARM_REPORT_URL": "http://127.0.0.1:9/r"}, tmp_path)
    one.torch = True
    monkeypatch.setattr(one, "send", lambda timeout=0: record(one))
    one.at_exit()
    assert len(sent) == 1 and sent[0]["final"] is True and sent[0]["fingerprint"] == {"framework": "torch"}
    assert sent[0]["torch"] == {"fxGraphHits": 3, "fxGraphMisses": 0, "fxGraphBypasses": 0, "aotAutogradHits": 2,
                                "aotAutogradMisses": 0, "aotAutogradBypasses": 0, "compileSeconds": 1.5}
    assert sent[0]["counts"]["requests"] == 3 and sent[0]["counts"]["hits"] == 3 and sent[0]["counts"]["misses"] == 0
    assert sent[0]["counts"]["compileSecondsSpent"] == 1.5 and sent[0]["counts"]["compiles"] == 0
    counts.update(fxGraphHits=0, aotAutogradHits=0)  # nothing compiled: nothing sent
    sent.clear()
    other = reporter.Reporter(reporter.Tally(), {"CACHEWARM_REPORT_URL": "http://127.0.0.1:9/r"}, tmp_path)
    other.torch = True
    monkeypatch.setattr(other, "send", lambda timeout=0: record(other))
    other.at_exit()
    assert sent == []


def test_secret_looking_env_values_are_hashed_and_names_and_values_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    for name in [k for k in os.environ if k.startswith(warmer.TORCH_ENV_PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRITON_API_TOKEN", "hunter2")
    monkeypatch.setenv("TORCHINDUCTOR_REMOTE_Auth_HEADER", "Bearer abc")
    monkeypatch.setenv("TORCHDYNAMO_" + "N" * 150, "v" * 150)
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(
        __version__="2.15.0", cuda=types.SimpleNamespace(is_available=lambda: False)))
    env = warmer.torch_fingerprint()["inductorEnv"]
    assert env["TRITON_API_TOKEN"] == "sha256:" + hashlib.sha256(b"hunter2").hexdigest()[:12]
    assert env["TORCHINDUCTOR_REMOTE_Auth_HEADER"] == "sha256:" + hashlib.sha256(b"Bearer abc").hexdigest()[:12]
    assert env["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"  # not a secret's name: shown
    assert "hunter2" not in json.dumps(env) and "Bearer" not in json.dumps(env)
    assert all(len(k) <= 100 and len(v) <= 100 for k, v in env.items())
    assert ("TORCHDYNAMO_" + "N" * 150)[:100] in env


def test_a_torch_fingerprint_at_its_bounds_shrinks_to_whole_json_in_the_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(tmp_path / "summary"))
    fp = {"framework": "torch", "versions": {"torch": "2.15.0"}, "torchKey": "0" * 16,
          "inductorEnv": {f"TORCHINDUCTOR_{i:02d}" + "N" * 84: "v" * 100 for i in range(20)},
          "inductorChanged": {f"key_{i:02d}" + "k" * 90: "'" + "r" * 58 + "'" for i in range(20)}}
    summary = {"mode": "command", "keys": ["a" * 16], "keyCount": 1, "errors": [], "targets": [],
               "compiledPrograms": [{"program": "torch.compile", "seconds": 20.5, "key": "a" * 16}], "fingerprint": fp}
    assert len(json.dumps(summary)) > warmer.SUMMARY_LIMIT
    warmer.write_summary(summary)
    text = (tmp_path / "summary").read_text()
    got = json.loads(text)  # whole JSON, not cut
    assert len(text) <= warmer.SUMMARY_LIMIT
    assert got["keys"] == ["a" * 16] and got["compiledPrograms"] == summary["compiledPrograms"]
    assert got["fingerprint"]["fingerprintCut"] is True and got["fingerprint"]["torchKey"] == "0" * 16
    assert got["fingerprint"]["inductorChanged"] == {} and len(got["fingerprint"]["inductorEnv"]) > 5


def test_entries_whose_content_hash_starts_with_tmp_are_archived_and_only_real_temp_names_left_out() -> None:
    # FX graph and AOTAutograd entries are named by base32 content hashes: 1 in 32768 starts "tmp".
    for kept in ("fxgraph/tm/tmpqzk3x/entry", "aotautograd/tm/tmpabc", "fxgraph/x1/tmpq12", "ab/ctmp.so",
                 "ab/cabc.so.tmp123"):
        assert warmer.torch_member_kept(kept, False), kept
    assert warmer.torch_member_kept("fxgraph/tm/tmpqzk3x", True)
    for temp in ("ab/.1234.140213.tmp", "triton/tmp.pid_12_0f3e", "triton/tmp.pid_12_0f3e/k.json",
                 "triton/HASH/k.cubin.tmp.pid_12_0f3e", "locks/x", "ab/c.so.lock"):
        assert not warmer.torch_member_kept(temp, temp == "triton/tmp.pid_12_0f3e"), temp


@pytest.mark.parametrize(("argv", "command"), [
    (["--", "python", "train.py", "--", "--steps", "1"], ["python", "train.py", "--", "--steps", "1"]),
    (["torchrun", "--nproc-per-node=2", "train.py", "--", "x"], ["torchrun", "--nproc-per-node=2", "train.py", "--", "x"]),
    (["--", "--"], ["--"]),
    ([], []),
])
def test_only_the_leading_separator_is_taken_from_the_entrypoint(argv: list[str], command: list[str]) -> None:
    assert warmer.entrypoint(argv) == command


def torch_summary_at_bounds(seconds_key: str = "compileSeconds", programs: int = 1, wide: str = "\u00e9"
                            ) -> dict[str, Any]:
    """A torch warmer's summary with every field at its bound, the text fields made of `wide`
    (non-ASCII: JSON writes each such character as six)."""
    fp = {"framework": "torch", "versions": {"torch": "2.15.0" + wide * 40, "triton": "3.9.0"}, "platform": "cuda",
          "platformVersion": wide * 200, "deviceKind": wide * 200, "devices": 8, "error": wide * 200,
          "cacheDir": "/c" + "x" * 198, "inductorConfigHash": "0" * 12, "torchKey": "0" * 16,
          "inductorEnv": {f"TORCHINDUCTOR_{i:02d}" + wide * 84: wide * 100 for i in range(20)},
          "inductorChanged": {f"key_{i:02d}" + wide * 90: "'" + wide * 58 + "'" for i in range(20)}}
    return {"mode": "command", "processIndex": 0, "cacheDir": "gs://b/" + "p" * 200, "programs": 3, "entriesFound": 0,
            "entriesWritten": 1, "bytesWritten": 5, "entriesRefreshed": 0, "refreshFailed": 0, "notCached": 0,
            "compileSeconds": 25.9, "keys": ["a" * 16], "keyCount": 1,
            "compiledPrograms": [{"program": "torch.compile", seconds_key: 25.9 - i, "key": f"{i:016x}"}
                                 for i in range(programs)],
            "targets": [{"target": wide * 300, "seconds": 1.0}] * 50, "errors": [wide * 500] * 5,
            "torch": {"fxGraphHits": 0, "fxGraphMisses": 3, "fxGraphBypasses": 0, "aotAutogradHits": 0,
                      "aotAutogradMisses": 2, "aotAutogradBypasses": 0, "compileSeconds": 25.9, "counted": True,
                      "files": 100000, "archiveBytes": 1 << 32, "uncompressedBytes": 1 << 32},
            "manifestEntries": 1, "manifestGeneration": "1" * 20, "packError": wide * 300, "manifestError": wide * 300,
            "imagePythonPath": wide * 1000, "fingerprint": fp}


@pytest.mark.parametrize(("seconds_key", "programs", "wide"), [
    ("compileSeconds", 1, "\u00e9"), ("compileSeconds", 16, "\u00e9"), ("seconds", 16, "\u00e9"),
    ("compileSeconds", 1, "e"), ("compileSeconds", 16, "e")])
def test_a_torch_summary_at_every_bound_is_whole_json_within_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        seconds_key: str, programs: int, wide: str) -> None:
    """write_summary never raises on a torch summary (its compiledPrograms cut through
    compiled_rest) and never writes cut JSON: the operator records the manifest from it."""
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(tmp_path / "summary"))
    summary = torch_summary_at_bounds(seconds_key, programs, wide)
    assert len(json.dumps(summary)) > 3 * warmer.SUMMARY_LIMIT
    warmer.write_summary(summary)
    text = (tmp_path / "summary").read_text()
    got = json.loads(text)
    assert len(text) <= warmer.SUMMARY_LIMIT
    assert got["manifestGeneration"] == "1" * 20 and got["entriesWritten"] == 1 and got["keyCount"] == 1
    assert got["keys"] == ["a" * 16] or got["keysTruncated"] is True


def test_a_torch_warms_compiled_program_has_the_key_the_summary_cuts_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What torch_upload puts in compiledPrograms is cut by write_summary (compiled_rest reads
    compileSeconds): a warm whose summary is over the limit still writes one."""
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(tmp_path / "summary"))
    inductor = tmp_path / "inductor"
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab/c.so").write_bytes(b"so")
    monkeypatch.delenv("CACHEWARM_MANIFEST", raising=False)
    monkeypatch.setattr(warmer, "upload_torch_archive", lambda url, local, sha, md5, size: (
        {"name": f"torch-inductor-{sha}-cache", "size": size, "md5": md5, "generation": "7"}, True, {}))
    summary = {**torch_summary_at_bounds(), "compiledPrograms": [], "keys": []}
    errors: list[str] = []
    assert warmer.torch_upload(str(inductor), "gs://b/p", 1 << 20, summary, errors) == (False, False)
    [program] = summary["compiledPrograms"]
    assert program["compileSeconds"] == 25.9 and "seconds" not in program
    summary["compiledPrograms"] = [program] * 8  # past COMPILED_KEPT_BEFORE_KEYS: cut with compiled_rest
    warmer.write_summary(summary)
    assert len(json.loads((tmp_path / "summary").read_text())["compiledPrograms"]) <= 8


def test_an_uncounted_warm_reports_no_compile_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A child entrypoint (torchrun) is not counted: its wall time is no compile's seconds, so
    neither compileSeconds nor compiledPrograms is in the summary (torch.counted says why)."""
    inductor = tmp_path / "inductor"
    for name, value in {"CACHEWARM_FRAMEWORK": "torch", "CACHEWARM_CACHE_URL": "gs://b/torch",
                        "CACHEWARM_SUMMARY_FILE": str(tmp_path / "summary"),
                        "TORCHINDUCTOR_CACHE_DIR": str(inductor)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CACHEWARM_MANIFEST", raising=False)
    monkeypatch.setattr(warmer, "upload_torch_archive", lambda url, local, sha, md5, size: (
        {"name": f"torch-inductor-{sha}-cache", "size": size, "md5": md5, "generation": "7"}, True, {}))
    argv_file = tmp_path / "argv"
    code = warmer.main(["command", "--", "sh", "-c", f'sleep 0.2; mkdir -p {inductor}/ab && echo so > {inductor}/ab/c.so'
                        f' && echo "$@" > {argv_file}', "sh", "--", "x"])
    summary = json.loads((tmp_path / "summary").read_text())
    assert code == 0, summary["errors"]
    assert summary["torch"]["counted"] is False and "compile seconds are unknown" in summary["torch"]["note"]
    assert "compileSeconds" not in summary and "compiledPrograms" not in summary
    assert summary["keys"] and summary["entriesWritten"] == 1
    assert argv_file.read_text().split() == ["--", "x"]  # the entrypoint's own "--" reached it


def test_a_directory_over_max_archive_size_uncompressed_is_refused_before_an_archive_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """maxArchiveSize bounds the uncompressed bytes of one archive: zeros that gzip to almost
    nothing are refused all the same, before anything is built or uploaded."""
    inductor = tmp_path / "inductor"
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab/c.so").write_bytes(b"\0" * 5000)
    built: list[int] = []
    monkeypatch.setattr(warmer, "torch_archive_into", lambda *a, **k: built.append(1) or 0)
    monkeypatch.setattr(warmer, "upload_torch_archive", lambda *a: pytest.fail("uploaded"))
    summary: dict[str, Any] = {"torch": {}}
    errors: list[str] = []
    assert warmer.torch_upload(str(inductor), "gs://b/p", 4999, summary, errors) == (False, True)
    assert built == [] and any("5000 bytes, over maxArchiveSize (4999 bytes, uncompressed)" in e for e in errors)
    assert summary["torch"]["uncompressedBytes"] == 5000


def test_the_warmer_streams_the_archive_to_a_file_hashing_it_as_written(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d = inductor_dir(tmp_path)
    data, files = warmer.torch_archive(str(d))
    seen: dict[str, Any] = {}

    def upload(url: str, local: str, sha: str, md5: str, size: int) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        seen.update(bytes=Path(local).read_bytes(), sha=sha, md5=md5, size=size)
        return {"name": f"torch-inductor-{sha}-cache", "size": size, "md5": md5, "generation": "7"}, True, {}

    monkeypatch.setattr(warmer, "upload_torch_archive", upload)
    monkeypatch.delenv("CACHEWARM_MANIFEST", raising=False)
    summary: dict[str, Any] = {"torch": {}}
    assert warmer.torch_upload(str(d), "gs://b/p", 1 << 20, summary, []) == (False, False)
    assert seen["bytes"] == data and seen["sha"] == hashlib.sha256(data).hexdigest() and seen["size"] == len(data)
    assert seen["md5"] == warmer._md5_base64(data) and summary["torch"]["files"] == files
    assert summary["torch"]["archiveBytes"] == len(data) and summary["bytesWritten"] == len(data)


def fake_torch(monkeypatch: pytest.MonkeyPatch, initialized: bool) -> list[str]:
    """A stand-in torch in sys.modules whose torch.cuda records what is asked of it."""
    import sys
    import types

    asked: list[str] = []

    def ask(name: str, value: Any) -> Any:
        return lambda *a: asked.append(name) or value

    cuda = types.SimpleNamespace(is_initialized=lambda: initialized, is_available=ask("is_available", True),
                                 device_count=ask("device_count", 8), get_device_name=ask("get_device_name", "H100"))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        __version__="2.15.0", cuda=cuda, version=types.SimpleNamespace(cuda="12.8", hip=None)))
    return asked


@pytest.mark.parametrize(("warmer_process", "initialized", "platform"), [
    (False, False, "cpu"), (False, True, "cuda"), (True, False, "cuda")])
def test_the_fingerprint_asks_cuda_only_where_it_is_initialized_or_in_the_warmer(
        monkeypatch: pytest.MonkeyPatch, warmer_process: bool, initialized: bool, platform: str) -> None:
    """is_available() and device_count() run cuInit: a reporter's thread must not, in a
    process that has not initialized CUDA (a fork after it fails)."""
    asked = fake_torch(monkeypatch, initialized)
    fp = warmer.torch_fingerprint(warmer=warmer_process)
    assert fp["platform"] == platform
    if platform == "cpu":
        assert asked == [] and fp["deviceKind"] == "cpu" and fp["devices"] == 1
    else:
        assert "is_available" in asked and fp["deviceKind"] == "H100" and fp["devices"] == 8


def test_reading_torchs_counters_inserts_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's counters are a defaultdict that torch's threads iterate; the reporter's poll
    reads them from another thread, so reading must never insert."""
    import collections
    import sys
    import types

    counters: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    counters["inductor"]["fxgraph_cache_hit"] = 3
    utils = types.SimpleNamespace(counters=counters, compilation_time_metrics={"_compile.compile_inner": [1.5]})
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", utils)
    got = warmer.torch_counts()
    assert got["fxGraphHits"] == 3 and got["aotAutogradMisses"] == 0 and got["compileSeconds"] == 1.5
    assert list(counters) == ["inductor"] and dict(counters["inductor"]) == {"fxgraph_cache_hit": 3}


class Bucket:
    """A stand-in for the copier's GCS client in prefix mode: it lists the archives it holds
    (GCS's fields) and writes one into the destination at each download, counted."""

    def __init__(self, *archives: bytes) -> None:
        self.held = {f"torch/torch-inductor-{hashlib.sha256(a).hexdigest()}-cache": a for a in archives}
        self.downloads: list[str] = []
        self.deadline = 0.0

    def list(self, bucket: str, prefix: str) -> list[dict[str, str]]:
        return [{"name": name, "size": str(len(data)), "md5Hash": warmer._md5_base64(data), "generation": "5"}
                for name, data in self.held.items()]

    def download(self, bucket: str, wanted: copier.Wanted, dest: str) -> tuple[int, bool]:
        self.downloads.append(wanted.base)
        (Path(dest) / wanted.base).write_bytes(self.held[wanted.name])
        return wanted.entry.size, False


def copy_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: Bucket) -> dict[str, Any]:
    monkeypatch.setattr(copier, "Client", lambda *a, **k: client)
    env = {"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_PREFIX": "torch", "CACHEWARM_COPY_DEST": str(tmp_path / "e"),
           "CACHEWARM_TORCH_DIR": str(tmp_path / "inductor"), "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}
    return copier.copy(env, copier.new_summary("prefix"))


def test_an_extracted_archive_is_unlinked_and_a_restarted_copy_neither_fetches_nor_counts_it_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod keeps the extraction, not the archive too; an init container run again in the
    same pod (its volumes kept) finds the archive's mark: present, not downloaded again, not
    extracted again, not a failure, not cold."""
    archive = tar_of(("fxgraph/e", b"fx"), ("ab/c.so", b"so"))
    name = f"torch-inductor-{hashlib.sha256(archive).hexdigest()}-cache"
    client = Bucket(archive)
    first = copy_with(tmp_path, monkeypatch, client)
    assert first["copied"] == 1 and first["torch"]["archives"] == 1 and first["torch"]["files"] == 2
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == [copier.torch_mark(name)]  # the archive unlinked
    assert (tmp_path / "inductor/ab/c.so").read_bytes() == b"so"
    again = copy_with(tmp_path, monkeypatch, client)
    assert client.downloads == [name]  # once
    assert (again["copied"], again["present"], again["failed"], again["removedForeign"], again["errors"],
            again["cold"]) == (0, 1, 0, 0, [], False)
    assert again["torch"]["extractedBefore"] == 1 and again["torch"]["files"] == 0
    assert (tmp_path / "e" / copier.torch_mark(name)).exists()


def test_a_torch_copy_whose_extraction_failed_is_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The archive came (copied, verified) but none of it could be extracted: the pod starts
    without what it should have had, as after a failed copy (coldPods, LocalCopyCold)."""
    broken = b"not a tar at all"
    summary = copy_with(tmp_path, monkeypatch, Bucket(broken))
    assert summary["copied"] == 1 and summary["torch"]["files"] == 0 and "ReadError" in summary["torch"]["error"]
    assert summary["cold"] is True and any("torch archives" in e for e in summary["errors"])
    name = f"torch-inductor-{hashlib.sha256(broken).hexdigest()}-cache"
    assert (tmp_path / "e" / name).exists() and not (tmp_path / "e" / copier.torch_mark(name)).exists()


def test_one_archive_that_fails_does_not_stop_the_next_and_the_copy_is_not_cold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tar_of(("fxgraph/e", b"fx"))
    summary = copy_with(tmp_path, monkeypatch, Bucket(b"\0" * 10, good))  # the broken one is named 01d448af...: extracted first
    assert summary["torch"]["archives"] == 1 and summary["torch"]["files"] == 1 and summary["torch"]["error"]
    assert summary["cold"] is False
    for counts, cold in (({"files": 0, "kept": 0, "error": "x"}, True), ({"files": 0, "kept": 3, "error": "x"}, False),
                         ({"files": 0, "kept": 0, "archivesRefused": 1}, True), ({"files": 0, "kept": 0}, False)):
        assert copier.torch_cold(counts) is cold, counts


def test_the_warmers_spool_file_is_in_the_directory_under_a_name_no_archive_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = inductor_dir(tmp_path)
    before, _ = warmer.torch_archive(str(d))
    spooled: list[str] = []

    def upload(url: str, local: str, sha: str, md5: str, size: int) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        spooled.append(local)
        assert warmer.torch_archive(str(d))[0] == before  # the spool, there now, is not in an archive
        return {"name": f"torch-inductor-{sha}-cache", "size": size, "md5": md5, "generation": "7"}, True, {}

    monkeypatch.setattr(warmer, "upload_torch_archive", upload)
    monkeypatch.delenv("CACHEWARM_MANIFEST", raising=False)
    warmer.torch_upload(str(d), "gs://b/p", 1 << 20, {"torch": {}}, [])
    assert os.path.dirname(spooled[0]) == str(d) and not os.path.exists(spooled[0])  # removed after


def test_a_directory_a_stopped_copy_left_0o700_is_made_0o777_by_the_next(tmp_path: Path) -> None:
    """A copy stopped between its mkdir and its fchmod left a directory of the umask's mode:
    the next copy (same uid) still opens it to every uid of the pod (re-review)."""
    data, _ = warmer.torch_archive(str(inductor_dir(tmp_path)))
    dest = tmp_path / "pod"
    (dest / "fxgraph").mkdir(parents=True)
    (dest / "fxgraph").chmod(0o700)
    extract(tmp_path, data, dest)
    assert stat.S_IMODE((dest / "fxgraph").stat().st_mode) == 0o777


def test_an_archive_extracted_but_not_marked_does_not_stop_the_next(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Marking an extracted archive can fail (a full or read-only copy directory): the
    archive stays extracted and the next one is extracted too (re-review: it skipped them)."""
    entries, pod = tmp_path / "entries", tmp_path / "pod"
    entries.mkdir()
    for name in ("a", "b"):
        data = tar_of((f"fxgraph/{name}", name.encode()))
        (entries / f"torch-inductor-{hashlib.sha256(data).hexdigest()}-cache").write_bytes(data)

    def cannot_mark(dest: str, name: str) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(copier, "_extracted", cannot_mark)
    summary = copier.new_summary("manifest")
    got = copier.seed_torch(str(entries), {"CACHEWARM_TORCH_DIR": str(pod)}, summary)
    assert got["archives"] == 2 and sorted(p.name for p in (pod / "fxgraph").iterdir()) == ["a", "b"], got
    assert "not marked" in summary["errors"][0]


def test_the_last_cut_of_a_summary_drops_errors_before_the_fingerprint() -> None:
    """The operator records a warm's fingerprint (KeysMatch reads it): a summary over the
    limit loses its errors and the like first, whichever is larger (re-review)."""
    fp = {"framework": "torch", "platform": "\u00e9" * 310}
    got = json.loads(warmer.summary_at_last({
        "mode": "command", "processIndex": 0, "entriesWritten": 1, "manifestGeneration": "1", "fingerprint": fp,
        "errors": ["\u00e9" * 100] * 3, "packError": "\u00e9" * 200}))
    assert got["fingerprint"] == fp and "errors" not in got and got["summaryCut"] is True
