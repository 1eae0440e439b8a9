"""Packs (issue 30): the warmer's format and choice of members, and what a copier takes from
a pack: only members under a planned entry's name (names never come from the pack, so no
path, no "..") whose bytes are that entry's size and MD5 as the trusted manifest records
them; a pack refused, corrupt, not a pack or without a member leaves those entries to be
downloaded one by one. The pack's bytes are handed over by a stand-in for Client.read (its
generation, size and MD5 check is the download's, tested with the copier's other reads);
the files are written into a real directory."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from cachewarm.agents import copier, warmer
from cachewarm.agents.copier import CopyError, Entry, Pack, Wanted

FOLDER = "jax/.cachewarm/pools/team-a/llama/h100"
MANIFEST = f"{FOLDER}/llama-h100-1a2b3c.json"
PACK = f"{FOLDER}/llama-h100-1a2b3c.cachewarm-pack"


def name(program: str) -> str:
    return f"{program}-{hashlib.sha256(program.encode()).hexdigest()}-cache"


def md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - GCS's md5Hash


STEP, EVAL, INIT = name("jit_step"), name("jit_eval"), name("jit_init")
BODIES = {STEP: b"step" * 100, EVAL: b"eval" * 50, INIT: b"init" * 10}


def wanted(entry_name: str, data: bytes) -> Wanted:
    return Wanted(f"jax/{entry_name}", Entry(len(data), md5(data), "7"))


def test_a_pack_reads_back_as_its_members_in_order() -> None:
    data = warmer.pack_bytes(BODIES.items())
    assert data.startswith(b"cachewarm-pack 1\n") and warmer.PACK_MAGIC == copier.PACK_MAGIC
    assert [(n, bytes(b)) for n, b in copier.pack_members(data)] == list(BODIES.items())
    assert list(copier.pack_members(warmer.pack_bytes([]))) == []
    assert warmer.PACK_SUFFIX == copier.PACK_SUFFIX and warmer.PACK_BYTES == copier.MAX_PACK_BYTES


@pytest.mark.parametrize("bad", ["../" + STEP, f"a/{STEP}", f"{STEP} x", "..", "jit_step-cache", STEP + "\n"])
def test_the_warmer_packs_nothing_under_a_name_that_is_not_an_entrys(bad: str) -> None:
    with pytest.raises(ValueError, match="not an entry name"):
        warmer.pack_bytes([(STEP, b"x"), (bad, b"y")])


@pytest.mark.parametrize(("data", "why"), [
    (b"PK\x03\x04" + b"x" * 20, "not a cachewarm pack"),
    (b"cachewarm-pack 1\n" + b"a" * 600, "header at byte 17"),
    (b"cachewarm-pack 1\n" + STEP.encode() + b" 12\nshort", "runs past the pack's end"),
    (b"cachewarm-pack 1\n" + STEP.encode() + b" -1\n", "header at byte 17"),
    (b"cachewarm-pack 1\n" + STEP.encode() + b"\n", "header at byte 17"),
], ids=["another-format", "header-too-long", "past-the-end", "negative-size", "no-size"])
def test_bytes_that_are_not_a_pack_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        list(copier.pack_members(data))


def test_the_warmer_packs_the_small_entries_smallest_first_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmer, "PACK_ENTRY_BYTES", 100)
    monkeypatch.setattr(warmer, "PACK_BYTES", 150)
    recorded = [{"name": n, "size": s} for n, s in (("e", 101), ("d", 60), ("c", 50), ("b", 50), ("a", 40))]
    # 40 + 50 + 50 = 140; 60 more would pass 150; 101 is over the entry bound.
    assert [e["name"] for e in warmer.pack_candidates(recorded)] == ["a", "b", "c"]
    assert warmer.pack_object("b/x/pools/ns/c/p/job-1.json") == "b/x/pools/ns/c/p/job-1.cachewarm-pack"


def manifest_doc(pack: Any = None, packed: tuple[str, ...] = ()) -> bytes:
    entries = [{"name": n, "size": len(b), "md5": md5(b), "generation": "7", **({"packed": True} if n in packed else {})}
               for n, b in BODIES.items()]
    return json.dumps({"version": 2, "entries": entries, **({"pack": pack} if pack is not None else {})}).encode()


GOOD_PACK = {"name": PACK, "size": 1000, "md5": md5(b"p"), "generation": "9"}


def test_a_manifest_names_its_pack_and_its_members() -> None:
    parsed = copier.parse_manifest(manifest_doc(GOOD_PACK, (STEP, EVAL)), MANIFEST)
    assert parsed.pack == Pack(PACK, Entry(1000, md5(b"p"), "9"))
    assert parsed.packed == {STEP, EVAL} and set(parsed.entries) == set(BODIES) and parsed.pack_error == ""
    # An older manifest (no pack) reads as before; "packed" without a pack means nothing.
    old = copier.parse_manifest(manifest_doc(None, (STEP,)), MANIFEST)
    assert (old.pack, old.packed, old.pack_error) == (None, frozenset(), "")
    assert old.entries == copier.manifest_entries(manifest_doc())


@pytest.mark.parametrize(("pack", "why"), [
    ({**GOOD_PACK, "name": "jax/elsewhere/x.cachewarm-pack"}, "not a pack in the manifest's folder"),
    ({**GOOD_PACK, "name": f"{FOLDER}/../../x.cachewarm-pack"}, "not a pack in the manifest's folder"),
    ({**GOOD_PACK, "name": f"{FOLDER}/sub/x.cachewarm-pack"}, "not a pack in the manifest's folder"),
    ({**GOOD_PACK, "name": f"{FOLDER}/{STEP}"}, "not a pack in the manifest's folder"),
    ({**GOOD_PACK, "name": 7}, "not a pack in the manifest's folder"),
    ("a string", "not a pack in the manifest's folder"),
    ({**GOOD_PACK, "md5": "nope"}, "no valid size, md5 and generation"),
    ({**GOOD_PACK, "generation": 9}, "no valid size, md5 and generation"),
    ({**GOOD_PACK, "size": (64 << 20) + 1}, "larger than"),
], ids=["other-folder", "dot-dot", "sub-folder", "an-entry", "not-a-string", "not-an-object", "md5", "generation",
        "too-large"])
def test_a_pack_a_manifest_names_wrongly_is_refused_and_its_entries_stay(pack: Any, why: str) -> None:
    parsed = copier.parse_manifest(manifest_doc(pack, (STEP, EVAL)), MANIFEST)
    assert parsed.pack is None and parsed.packed == frozenset() and why in parsed.pack_error
    assert set(parsed.entries) == set(BODIES)


def test_a_pack_serves_two_or_more_of_the_downloads() -> None:
    pack, other = Pack(PACK, Entry(10, md5(b"p"), "9")), Pack(PACK + "2", Entry(10, md5(b"q"), "9"))
    step, eval_, init = (wanted(n, b) for n, b in BODIES.items())
    groups, alone = copier.by_pack({STEP: pack, EVAL: pack, INIT: other}, [step, eval_, init])
    assert groups == {pack: [step, eval_]} and alone == [init]  # one member alone: fewer bytes on its own
    assert copier.by_pack({}, [step, eval_]) == ({}, [step, eval_])


def test_a_copy_whose_every_entry_is_in_a_pack_lists_nothing() -> None:
    pack = Pack(PACK, Entry(10, md5(b"p"), "9"))
    names = {n: Entry(len(b), md5(b), "7") for n, b in BODIES.items()}
    assert copier.packed_listing(names, {n: pack for n in BODIES}, "jax/") == [{"name": f"jax/{n}"} for n in sorted(BODIES)]
    assert copier.packed_listing(names, {STEP: pack, EVAL: pack}, "jax/") == []  # INIT alone: list
    assert copier.packed_listing(None, {STEP: pack}, "jax/") == [] and copier.packed_listing({}, {}, "jax/") == []


class Reads:
    """Client.read's stand-in: the pack's bytes (or an error), and the partial file names."""

    def __init__(self, data: bytes | Exception) -> None:
        self.data, self.calls, self.count = data, [], 0

    def read(self, bucket: str, object_name: str, limit: int, generation: str, md5_: str) -> bytes:
        self.calls.append((bucket, object_name, limit, generation, md5_))
        if isinstance(self.data, Exception):
            raise self.data
        return self.data

    def partial_name(self) -> str:
        self.count += 1
        return f"{copier.PARTIAL}test-{self.count}"


def unpack(tmp_path: Path, data: bytes | Exception, members: list[Wanted]
           ) -> tuple[list[Wanted], dict[str, Any], list[tuple[str, int, bool]], Reads]:
    reads = Reads(data)
    summary: dict[str, Any] = {"errors": [], "packs": 0, "packBytes": 0, "fromPack": 0, "packFallback": 0,
                               "packIgnored": 0, "packsGone": 0}
    done: list[tuple[str, int, bool]] = []
    pack = Pack(PACK, Entry(len(data) if isinstance(data, bytes) else 1, "MD5", "9"))
    rest = copier.unpack(reads, "bkt", str(tmp_path / "dest"), pack, members, summary,  # type: ignore[arg-type]
                         lambda w, size, replaced: done.append((w.base, size, replaced)), threading.Lock())
    return rest, summary, done, reads


def test_the_planned_members_are_written_from_the_pack_checked_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / EVAL).write_bytes(b"tampered")  # replaced, as a download replaces it
    data = warmer.pack_bytes(BODIES.items())
    members = [wanted(STEP, BODIES[STEP]), wanted(EVAL, BODIES[EVAL])]  # INIT not planned (present, or no manifest's)
    rest, summary, done, reads = unpack(tmp_path, data, members)
    assert reads.calls == [("bkt", PACK, len(data), "9", "MD5")]  # one request, pinned, its size and MD5
    assert rest == [] and sorted(done) == [(EVAL, len(BODIES[EVAL]), True), (STEP, len(BODIES[STEP]), False)]
    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == {STEP: BODIES[STEP], EVAL: BODIES[EVAL]}
    assert (summary["packs"], summary["packBytes"], summary["fromPack"], summary["packIgnored"],
            summary["packFallback"], summary["errors"]) == (1, len(data), 2, 1, 0, [])


def test_pack_members_under_other_names_are_ignored_and_never_leave_the_destination(tmp_path: Path) -> None:
    """The pack's names are only looked up among the planned entries' names: a path, "..",
    an absolute path or another program's entry is never a file name."""
    (tmp_path / "dest").mkdir()
    hostile = [(f"../{STEP}", b"escape"), (f"/tmp/{STEP}", b"absolute"), ("..", b"up"), (f"sub/{STEP}", b"down"),
               (INIT, BODIES[INIT]), (STEP, BODIES[STEP])]
    data = copier.PACK_MAGIC + b"".join(f"{n} {len(b)}\n".encode() + b for n, b in hostile)
    rest, summary, done, _ = unpack(tmp_path, data, [wanted(STEP, BODIES[STEP])])
    assert rest == [] and [d[0] for d in done] == [STEP] and summary["packIgnored"] == 5
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dest", STEP]


def test_a_member_whose_bytes_are_not_the_manifests_is_downloaded_on_its_own(tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    data = warmer.pack_bytes([(STEP, b"S" * len(BODIES[STEP])), (EVAL, BODIES[EVAL])])  # its size, other bytes
    members = [wanted(STEP, BODIES[STEP]), wanted(EVAL, BODIES[EVAL]), wanted(INIT, BODIES[INIT])]
    rest, summary, done, _ = unpack(tmp_path, data, members)
    assert [w.base for w in rest] == [STEP, INIT]  # wrong bytes; not in the pack
    assert [d[0] for d in done] == [EVAL] and sorted(p.name for p in (tmp_path / "dest").iterdir()) == [EVAL]
    assert summary["packFallback"] == 2 and "did not give 2 of its entries" in summary["errors"][0]


@pytest.mark.parametrize("data", [CopyError("HTTP 404 for the pack", 404), CopyError("HTTP 403 for the pack", 403),
                                  b"not a pack at all"], ids=["gone", "unreadable", "not-a-pack"])
def test_a_pack_that_cannot_be_read_leaves_every_member_to_be_downloaded(tmp_path: Path, data: Any) -> None:
    """... an error, but for a pack that is gone (404: expired, as its entries do, which the
    copy then looks for in the bucket's listing): packsGone, not an error."""
    (tmp_path / "dest").mkdir()
    members = [wanted(STEP, BODIES[STEP]), wanted(EVAL, BODIES[EVAL])]
    rest, summary, done, _ = unpack(tmp_path, data, members)
    assert rest == members and done == [] and list((tmp_path / "dest").iterdir()) == []
    gone = isinstance(data, CopyError) and data.status == 404
    assert summary["packFallback"] == 2 and summary["packsGone"] == int(gone)
    assert summary["errors"] == [] if gone else PACK in summary["errors"][0]
    assert summary["packs"] == (0 if isinstance(data, Exception) else 1)
