"""Packs (issue 30) against the GCS emulator behind its fidelity proxy: the warmer's own
calls (in this process, as test_warmer's manifest test) write the pack of a manifest's
small entries and the manifest naming it; the copier, run as the init container runs it,
reads the pack in one request and the large entry alone, each entry checked against the
manifest. A pack rewritten or gone since the manifest: every entry is downloaded on its own
and the summary says so; a pack gone with its entries (both expired): one listing, the
missing entries notInBucket, not a cold start. A manifest from before packs reads as it did."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from google.cloud import storage
from test_copier import env_for, run_copier

from cachewarm.agents import warmer
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl

pytestmark = pytest.mark.integration

FOLDER = "jax/.cachewarm/pools/team-a/llama/h100"


def entry(i: int) -> str:
    return f"jit_p{i}-{str(i) * 64}-cache"


@pytest.fixture
def warmed(storage_bed: Testbed, storage_only: storage.Client, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[str, dict[str, bytes], str, dict[str, object]]:
    """A bucket with six small entries and one over the pack's bound under jax/, and the
    manifest of all seven as the warmer writes it: (bucket, entries, `<manifest>#<generation>`,
    write_manifest's answer)."""
    for key, value in storage_bed.env().items():
        if key != "KUBECONFIG":
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(warmer, "_FILESYSTEM", None)
    bucket = f"pack-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    objects = {entry(i): os.urandom(1000 * (i + 1)) for i in range(6)}
    objects[entry(9)] = os.urandom(warmer.PACK_ENTRY_BYTES + 1)
    for name, data in objects.items():
        storage_only.bucket(bucket).blob(f"jax/{name}").upload_from_string(data)
    manifest = f"{FOLDER}/llama-h100-0123456789.json"
    out = warmer.write_manifest(f"gs://{bucket}/{manifest}", list(objects), {"jaxlib": "0.0"}, f"gs://{bucket}/jax")
    return bucket, objects, f"{manifest}#{out['manifestGeneration']}", out


def media_gets(proxy: ProxyControl) -> list[str]:
    return [r["path"].rsplit("/", 1)[-1] for r in proxy.log() if r["method"] == "GET"
            and r["path"].startswith("/download/") and r["status"] == 200]


def test_the_warmers_pack_gives_a_copier_the_small_entries_in_one_request(
        warmed: tuple[str, dict[str, bytes], str, dict[str, object]], storage_bed: Testbed,
        storage_only: storage.Client, tmp_path: Path) -> None:
    bucket, objects, pinned, out = warmed
    small = sorted(n for n in objects if len(objects[n]) <= warmer.PACK_ENTRY_BYTES)
    manifest_name = pinned.split("#")[0]
    doc = json.loads(storage_only.bucket(bucket).blob(manifest_name).download_as_bytes())
    pack = storage_only.bucket(bucket).get_blob(doc["pack"]["name"])
    assert pack is not None and pack.name == manifest_name.removesuffix(".json") + ".cachewarm-pack"
    assert doc["pack"] == {"name": pack.name, "size": pack.size, "md5": pack.md5_hash, "generation": str(pack.generation)}
    assert sorted(e["name"] for e in doc["entries"] if e.get("packed")) == small and len(doc["entries"]) == 7
    assert out["packEntries"] == 6 and out["packBytes"] == pack.size and "packError" not in out
    # Written with a customTime (a lifecycle rule naming the suffix expires it as entries);
    # not a JAX entry to anything that looks for "-cache", nor a manifest (".json").
    assert pack.custom_time is not None and not pack.name.endswith(("-cache", ".json"))
    assert [b.name for b in storage_only.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")] == \
        sorted(f"jax/{n}" for n in objects)

    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    dest = tmp_path / "cache"
    summary = run_copier(env_for(storage_bed, bucket, dest, manifests=pinned))
    assert {k: summary[k] for k in ("copied", "failed", "errors", "cold", "packs", "fromPack", "packFallback",
                                    "packIgnored", "packBytes")} == {
        "copied": 7, "failed": 0, "errors": [], "cold": False, "packs": 1, "fromPack": 6, "packFallback": 0,
        "packIgnored": 0, "packBytes": pack.size}
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == objects
    # Media: the manifest, the pack, the large entry; no small entry on its own (with the
    # manifest's metadata and one listing page: 5 requests for 7 entries, where the same
    # manifest without a pack takes 10, as below). Only media GETs are compared: gcsfs (the
    # warmer's client, in this process) may still have a metadata or listing request of its
    # own in flight when write_manifest returns (its info() asks both ways at once).
    assert sorted(media_gets(proxy)) == sorted([manifest_name.rsplit("/", 1)[1], pack.name.rsplit("/", 1)[1], entry(9)])

    # A manifest of the small entries only: all in its pack, so no listing either; 3 requests.
    only = f"{FOLDER}/llama-h100-small.json"
    small_out = warmer.write_manifest(f"gs://{bucket}/{only}", small, None, f"gs://{bucket}/jax")
    proxy.clear_log()
    summary = run_copier(env_for(storage_bed, bucket, tmp_path / "small", manifests=f"{only}#{small_out['manifestGeneration']}"))
    assert (summary["copied"], summary["fromPack"], summary["errors"]) == (6, 6, [])
    assert sorted(media_gets(proxy)) == sorted([only.rsplit("/", 1)[1], "llama-h100-small.cachewarm-pack"])
    # Not listed: GCS's listing would have shown the large entry, which this manifest lacks.
    assert summary["leftOut"] == {"notAnEntry": 0, "notInManifest": 0, "notInBucket": 0, "overBudget": 0,
                                  "unverifiable": 0}

    # The same manifest as a warmer before packs wrote it: every entry on its own, as before.
    doc.pop("pack")
    doc["entries"] = [{k: v for k, v in e.items() if k != "packed"} for e in doc["entries"]]
    old = storage_only.bucket(bucket).blob(f"{FOLDER}/old.json")
    old.upload_from_string(json.dumps(doc))
    proxy.clear_log()
    summary = run_copier(env_for(storage_bed, bucket, tmp_path / "old", manifests=f"{old.name}#{old.generation}"))
    assert (summary["copied"], summary["errors"], "packs" in summary, "fromPack" in summary) == (7, [], False, False)
    assert summary["leftOut"]["notAnEntry"] == 0  # listed (matchGlob: the manifests' folder is not in the answer)
    assert len(media_gets(proxy)) == 8  # the manifest and each entry, as before
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == objects


@pytest.mark.parametrize("how", ["rewritten", "deleted"])
def test_a_pack_rewritten_or_gone_since_its_manifest_leaves_each_entry_to_be_downloaded(
        how: str, warmed: tuple[str, dict[str, bytes], str, dict[str, object]], storage_bed: Testbed,
        storage_only: storage.Client, tmp_path: Path) -> None:
    bucket, objects, pinned, _ = warmed
    pack = storage_only.bucket(bucket).blob(pinned.split("#")[0].removesuffix(".json") + ".cachewarm-pack")
    if how == "deleted":
        pack.delete()
    else:  # the same length, other bytes: not the generation and MD5 the manifest names
        data = pack.download_as_bytes()
        pack.upload_from_string(data[:-1] + bytes([data[-1] ^ 1]))
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=pinned))
    assert (summary["copied"], summary["failed"], summary["cold"], summary["fromPack"], summary["packFallback"],
            summary["packs"]) == (7, 0, False, 0, 6, 0)
    if how == "deleted":  # expired as its entries do: said, not an error (the start is not the worse for it)
        assert summary["packsGone"] == 1 and summary["errors"] == []
    else:
        assert any(pack.name in e for e in summary["errors"]) and any("read one by one" in e for e in summary["errors"])
        assert summary["packsGone"] == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == objects


def test_an_entry_changed_since_it_was_listed_stays_out_of_the_pack_and_a_failed_pack_leaves_the_manifest(
        warmed: tuple[str, dict[str, bytes], str, dict[str, object]], storage_only: storage.Client,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, objects, _, _ = warmed
    recorded, _ = warmer.entry_digests(f"gs://{bucket}/jax", list(objects))
    changed = {**recorded[0], "md5": "AAAAAAAAAAAAAAAAAAAAAA=="}  # what the listing said before a rewrite
    pack = warmer.write_pack(f"{bucket}/{FOLDER}/job-2.json", [changed, *recorded[1:]], f"gs://{bucket}/jax")
    assert sorted(pack["members"]) == sorted(e["name"] for e in recorded[1:] if e["size"] <= warmer.PACK_ENTRY_BYTES)
    assert recorded[0]["name"] not in pack["members"]

    # A pack that cannot be written: the manifest is written all the same, without one.
    def refuse(*_: object) -> dict[str, object]:
        raise PermissionError("Forbidden")
    monkeypatch.setattr(warmer, "write_pack", refuse)
    out = warmer.write_manifest(f"gs://{bucket}/{FOLDER}/job-3.json", list(objects), None, f"gs://{bucket}/jax")
    assert out["manifestEntries"] == 7 and "packEntries" not in out and "Forbidden" in str(out["packError"])
    doc = json.loads(storage_only.bucket(bucket).blob(f"{FOLDER}/job-3.json").download_as_bytes())
    assert "pack" not in doc and not any("packed" in e for e in doc["entries"])


def test_a_pack_gone_with_its_entries_is_one_listing_and_not_a_cold_start(
        storage_bed: Testbed, storage_only: storage.Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every entry in the pack (no listing needed while it is there), then the pack and two
    of its three entries expire (the lifecycle rule's deleteAfterDays; the manifest does not
    expire): the pack's 404 is counted packsGone, not an error; the bucket is listed once,
    the two it lacks are notInBucket and not asked for (before: a 404 per entry, each a
    failure, the start cold), and the one it holds is downloaded."""
    bucket, objects, manifest, out = packed_then_gone(storage_bed, storage_only, monkeypatch)
    for name in (entry(0), entry(1)):
        storage_only.bucket(bucket).blob(f"jax/{name}").delete()
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    summary = run_copier(env_for(storage_bed, bucket, tmp_path / "cache",
                                 manifests=f"{manifest}#{out['manifestGeneration']}"))
    assert {k: summary[k] for k in ("copied", "failed", "cold", "errors", "packsGone", "packFallback", "wanted")} == {
        "copied": 1, "failed": 0, "cold": False, "errors": [], "packsGone": 1, "packFallback": 3, "wanted": 1}
    assert summary["leftOut"]["notInBucket"] == 2
    listings = [r for r in proxy.log() if r["method"] == "GET" and r["path"].endswith(f"/b/{bucket}/o")]
    assert len(listings) == 1 and media_gets(proxy) == [manifest.rsplit("/", 1)[1], entry(2)]
    assert {p.name: p.read_bytes() for p in (tmp_path / "cache").iterdir()} == {entry(2): objects[entry(2)]}


def test_a_gone_pack_whose_listing_is_refused_leaves_each_entry_to_be_read_on_its_own(
        storage_bed: Testbed, storage_only: storage.Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The pack is gone and the listing that would sort out its expired entries is refused
    (403: a reader's identity without list rights): every entry is still read on its own, as
    before packs, and the listing's failure is said (re-review: it skipped them all)."""
    bucket, objects, manifest, out = packed_then_gone(storage_bed, storage_only, monkeypatch)
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    proxy.faults([{"method": "GET", "path": f"/b/{bucket}/o$", "status": 403, "times": 100}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, tmp_path / "cache",
                                     manifests=f"{manifest}#{out['manifestGeneration']}"))
    finally:
        proxy.clear_faults()
    assert (summary["copied"], summary["failed"], summary["cold"], summary["packsGone"]) == (3, 0, False, 1), summary
    assert any("listing what the packs did not give" in e for e in summary["errors"]), summary["errors"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "cache").iterdir()} == objects


def packed_then_gone(storage_bed: Testbed, storage_only: storage.Client, monkeypatch: pytest.MonkeyPatch,
                     ) -> tuple[str, dict[str, bytes], str, dict[str, object]]:
    """A bucket of three small entries, the warmer's manifest and pack of them (as a warm
    writes them), then the pack deleted (expired): (bucket, entries, manifest, write_manifest's answer)."""
    for key, value in storage_bed.env().items():
        if key != "KUBECONFIG":
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(warmer, "_FILESYSTEM", None)
    bucket = f"gone-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    objects = {entry(i): os.urandom(1000 * (i + 1)) for i in range(3)}
    for name, data in objects.items():
        storage_only.bucket(bucket).blob(f"jax/{name}").upload_from_string(data)
    manifest = f"{FOLDER}/llama-h100-0123456789.json"
    out = warmer.write_manifest(f"gs://{bucket}/{manifest}", list(objects), {"jaxlib": "0.0"}, f"gs://{bucket}/jax")
    assert out["packEntries"] == 3
    storage_only.bucket(bucket).blob(manifest.removesuffix(".json") + ".cachewarm-pack").delete()
    return bucket, objects, manifest, out
