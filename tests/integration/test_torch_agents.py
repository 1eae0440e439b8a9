"""torch caches (issue 31), the agents end to end against the GCS emulator behind its
fidelity proxy, with a real torch (the python at $CACHEWARM_TORCH_PYTHON: torch 2.15.0,
CPU, Inductor's C++ backend) and the demo's torch.compile'd training program: the warmer in
torch command mode uploads the Inductor directory as one archive and writes the manifest
naming it; the copier (as the init container runs it, and as the child sitecustomize
starts in process) seeds a fresh directory from that manifest; the program run again on it
compiles nothing (0 FX graph and 0 AOTAutograd misses, torch's own counters) and its
reporter says so, with the warmer's fingerprint; an Inductor setting in the env misses and
its fingerprint names it. A cold compile costs ~25 s of CPU here: the warm runs once per
module."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from cachewarm.agents import warmer
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "operator" / "cachewarm" / "agents"
PROGRAM = REPO / "demo" / "torch" / "train_torch.py"
TORCH_PYTHON = os.environ.get("CACHEWARM_TORCH_PYTHON", "")
if not TORCH_PYTHON:
    pytest.skip("CACHEWARM_TORCH_PYTHON is not set (a python with torch: the Makefile sets it)",
                allow_module_level=True)
FOLDER = "torch/.cachewarm/pools/ml/demo/cpu"


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TORCH_PYTHON, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def base_env(extra: dict[str, str]) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("CACHEWARM_", "TORCH", "TRITON_", "PYTHON", "JAX_", "STORAGE_EMULATOR_HOST", "TMPDIR"))}
    return {**clean, **extra}


class Reports:
    """An HTTP endpoint taking the reporter's reports (as test_reporter's)."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        got = self.got

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                got.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/report"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def warmed(storage_bed: Testbed, storage_only: storage.Client, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    """One cold warm of the demo program in torch command mode into a fresh bucket, its
    Inductor directory at the same path the pods get (then emptied, as a pod's is)."""
    tmp = tmp_path_factory.mktemp("torch-warm")
    bucket = f"torch-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    app = tmp / "app"
    app.mkdir()
    shutil.copy(PROGRAM, app / "train_torch.py")
    shutil.copy(AGENTS / "warmer.py", tmp / "warm.py")
    inductor = tmp / "cachewarm-torch"
    manifest = f"{FOLDER}/demo-cpu-1.json"
    env = base_env({"STORAGE_EMULATOR_HOST": storage_bed.storage_emulator_host,
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                    "CACHEWARM_FRAMEWORK": "torch", "CACHEWARM_CACHE_URL": f"gs://{bucket}/torch",
                    "CACHEWARM_MANIFEST": f"gs://{bucket}/{manifest}", "CACHEWARM_SUMMARY_FILE": str(tmp / "summary"),
                    "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES": str(1 << 30),  # the precompiled header is ~160 MB
                    "TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(inductor / "triton"),
                    # A temp dir of its own, as a container has: Inductor builds its precompiled
                    # header under it unless the warmer links it into the directory it archives
                    # (this host's shared /tmp would hold one from another run: kinder than a pod).
                    "TMPDIR": str(tmp / "warmer-tmp")})
    (tmp / "warmer-tmp").mkdir()
    out = run([str(tmp / "warm.py"), "command", "--", "python", "train_torch.py", "--steps", "1"], env, app)
    summary = json.loads((tmp / "summary").read_text())
    headers = sorted(p.name for p in (inductor / "precompiled_headers").glob("*.gch"))
    shutil.rmtree(inductor)
    return {"code": out.returncode, "log": out.stderr[-4000:], "summary": summary, "bucket": bucket, "tmp": tmp, "env": env,
            "app": app, "inductor": inductor, "manifest": f"{manifest}#{summary.get('manifestGeneration')}",
            "headers": headers}


def test_the_warm_uploads_its_directory_as_one_archive_and_the_manifest_names_it(
        warmed: dict[str, Any], storage_only: storage.Client) -> None:
    assert warmed["code"] == 0, warmed["log"]
    summary = warmed["summary"]
    assert summary["errors"] == [] and summary["entriesWritten"] == 1
    torch = summary["torch"]
    assert torch["counted"] is True and torch["fxGraphMisses"] == 3 and torch["aotAutogradMisses"] == 2
    assert torch["compileSeconds"] > 0 and summary["compileSeconds"] == torch["compileSeconds"]
    blobs = [b for b in storage_only.list_blobs(warmed["bucket"], prefix="torch/torch-inductor-")]
    assert len(blobs) == 1
    data = blobs[0].download_as_bytes()
    assert blobs[0].name == f"torch/torch-inductor-{hashlib.sha256(data).hexdigest()}-cache"
    assert summary["bytesWritten"] == torch["archiveBytes"] == len(data) and torch["files"] > 10
    assert summary["keys"] == [hashlib.sha256(data).hexdigest()[:16]]
    assert summary["compiledPrograms"] == [{"program": "torch.compile", "compileSeconds": torch["compileSeconds"],
                                            "key": summary["keys"][0]}]
    name = warmed["manifest"].split("#")[0]
    doc = json.loads(storage_only.bucket(warmed["bucket"]).blob(name).download_as_bytes())
    assert [e["name"] for e in doc["entries"]] == [blobs[0].name.split("/")[-1]]
    fp = summary["fingerprint"]
    assert fp["framework"] == "torch" and fp["versions"]["torch"].startswith("2.") and fp["platform"] == "cpu"
    assert fp["inductorEnv"] == {} and fp["cacheDir"] == str(warmed["inductor"]) and doc["fingerprint"] == fp


def warm_again(warmed: dict[str, Any], tmp: Path, inductor: Path, *args: str, limit: int = 1 << 30
               ) -> tuple[int, dict[str, Any], str]:
    """The warmer once more, into the warm's bucket (another manifest), with `inductor` as
    its TORCHINDUCTOR_CACHE_DIR."""
    env = base_env({**warmed["env"], "CACHEWARM_SUMMARY_FILE": str(tmp / "summary"),
                    "CACHEWARM_MANIFEST": f"gs://{warmed['bucket']}/{FOLDER}/demo-cpu-{uuid.uuid4().hex[:6]}.json",
                    "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES": str(limit),
                    "TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(inductor / "triton"),
                    "TMPDIR": tempfile.mkdtemp(dir=tmp)})  # another Job's pod: its own /tmp
    out = run([str(warmed["tmp"] / "warm.py"), *args], env, warmed["app"])
    return out.returncode, json.loads((tmp / "summary").read_text()), out.stderr[-3000:]


def test_a_targets_warm_on_a_seeded_directory_finds_every_graph_and_the_same_archive(
        warmed: dict[str, Any], tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """targets mode calls the callable (the demo's `warm`: its compiled step and eval on
    example inputs); seeded from the first warm's archive it compiles nothing, and the
    directory archives to the same bytes: that object is already there, not written again."""
    assert warmed["code"] == 0, warmed["log"]
    inductor = tmp_path / "inductor"
    out = run(["-I", "-S", str(AGENTS / "copier.py")], base_env(copier_env(storage_bed, warmed, tmp_path / "e", inductor)),
              tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    code, summary, log = warm_again(warmed, tmp_path, inductor, "targets", "train_torch:warm")
    assert code == 0, log
    assert summary["targets"][0]["target"] == "train_torch:warm" and summary["errors"] == []
    assert summary["torch"]["fxGraphHits"] == 3 and summary["torch"]["fxGraphMisses"] == 0
    assert summary["entriesFound"] == 3 and summary["programs"] == 3
    assert summary["entriesWritten"] == 0 and summary["keys"] == warmed["summary"]["keys"]
    assert len(list(storage_only.list_blobs(warmed["bucket"], prefix="torch/torch-inductor-"))) == 1


def test_a_child_entrypoint_is_uncounted_and_an_empty_or_too_large_directory_is_not_uploaded(
        warmed: dict[str, Any], tmp_path: Path, storage_only: storage.Client) -> None:
    assert warmed["code"] == 0, warmed["log"]
    code, summary, log = warm_again(warmed, tmp_path, tmp_path / "empty", "command", "--", "sh", "-c", "true")
    assert code == 2, log
    assert summary["torch"]["counted"] is False and "child process" in summary["torch"]["note"]
    assert "compileSeconds" not in summary and "compiledPrograms" not in summary  # no wall time as compile seconds
    assert any("nothing was compiled" in e for e in summary["errors"]) and "keys" not in summary
    big = tmp_path / "big"
    code, summary, log = warm_again(warmed, tmp_path, big, "command", "--", "sh", "-c",
                                    f"mkdir -p {big}/ab && head -c 5000 /dev/zero > {big}/ab/c.so", limit=1000)
    assert code == 1, log
    # maxArchiveSize bounds the uncompressed bytes: 5000 zeros gzip to far less than 1000 bytes
    assert any("over maxArchiveSize" in e for e in summary["errors"]) and summary["entriesWritten"] == 0
    assert len(list(storage_only.list_blobs(warmed["bucket"], prefix="torch/torch-inductor-"))) == 1


def copier_env(bed: Testbed, warmed: dict[str, Any], dest: Path, torch_dir: Path) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": bed.storage_emulator_host, "CACHEWARM_COPY_BUCKET": warmed["bucket"],
            "CACHEWARM_COPY_PREFIX": "torch", "CACHEWARM_COPY_DEST": str(dest),
            "CACHEWARM_COPY_MANIFESTS": warmed["manifest"], "CACHEWARM_TORCH_DIR": str(torch_dir),
            "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES": str(1 << 30)}


def site(where: Path) -> Path:
    """The pod's shipped directory: sitecustomize, the copier, the reporter, the warmer."""
    where.mkdir(exist_ok=True)
    for source, name in (("sitecustomize.py", "sitecustomize.py"), ("copier.py", "cachewarm_copier.py"),
                         ("reporter.py", "cachewarm_reporter.py"), ("warmer.py", "warm.py")):
        shutil.copy(AGENTS / source, where / name)
    return where


def train(warmed: dict[str, Any], reports: Reports, torch_dir: Path, extra: dict[str, str] | None = None
          ) -> dict[str, Any]:
    env = base_env({"PYTHONPATH": str(site(warmed["tmp"] / "site")), "CACHEWARM_FRAMEWORK": "torch",
                    "TORCHINDUCTOR_CACHE_DIR": str(torch_dir), "TRITON_CACHE_DIR": str(torch_dir / "triton"),
                    "CACHEWARM_REPORT_URL": reports.url, "CACHEWARM_CACHE": "demo", "CACHEWARM_POD_NAMESPACE": "ml",
                    "CACHEWARM_POD_NAME": "trainer", "CACHEWARM_POD_UID": "u-1",
                    "TMPDIR": tempfile.mkdtemp(dir=warmed["tmp"]),  # each container's own /tmp
                    **(extra or {})})
    out = run(["train_torch.py", "--steps", "1"], env, warmed["app"])
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_pod_seeded_from_the_manifest_compiles_nothing_and_reports_it(
        warmed: dict[str, Any], storage_bed: Testbed) -> None:
    assert warmed["code"] == 0, warmed["log"]
    inductor, entries = warmed["inductor"], warmed["tmp"] / "entries"
    out = run(["-I", "-S", str(AGENTS / "copier.py")], base_env(copier_env(storage_bed, warmed, entries, inductor)),
              warmed["tmp"], timeout=120)
    assert out.returncode == 0, out.stderr
    copy = json.loads(out.stdout.strip().splitlines()[-1])["cachewarm-copier"]
    assert copy["copied"] == 1 and copy["errors"] == []
    assert copy["torch"]["archives"] == 1 and copy["torch"]["files"] == warmed["summary"]["torch"]["files"]
    assert copy["torch"]["refused"] == 0 and copy["torch"]["kept"] == 0
    assert not [p for p in entries.iterdir() if p.name.startswith("torch-inductor-")]  # extracted, then unlinked
    again = run(["-I", "-S", str(AGENTS / "copier.py")], base_env(copier_env(storage_bed, warmed, entries, inductor)),
                warmed["tmp"], timeout=120)  # an init container run again in the same pod: nothing fetched again
    again_copy = json.loads(again.stdout.strip().splitlines()[-1])["cachewarm-copier"]
    assert (again_copy["copied"], again_copy["present"], again_copy["failed"], again_copy["errors"],
            again_copy["cold"]) == (0, 1, 0, [], False)
    assert again_copy["torch"]["extractedBefore"] == 1 and again_copy["torch"]["files"] == 0
    reports = Reports()
    pod_tmp = warmed["tmp"] / "pod-tmp"
    pod_tmp.mkdir()
    try:
        seen = train(warmed, reports, inductor, {"TMPDIR": str(pod_tmp)})
    finally:
        reports.server.shutdown()
    # Inductor's precompiled header (~160 MB, built with g++ by every fresh container before it
    # loads cached kernels) came with the warmer's archive: the pod's temp dir links to the
    # seeded directory, which holds the warmer's header and no other, and none was built here.
    assert warmed["headers"], "the warmer's archive carries no precompiled header"
    assert sorted(p.name for p in (inductor / "precompiled_headers").glob("*.gch")) == warmed["headers"]
    assert [f for _, _, files in os.walk(pod_tmp) for f in files if f.endswith(".gch")] == []
    inductor_counts, aot = seen["counters"]["inductor"], seen["counters"]["aotAutograd"]
    assert inductor_counts.get("fxgraph_cache_miss", 0) == 0 and inductor_counts["fxgraph_cache_hit"] == 3
    assert aot.get("autograd_cache_miss", 0) == 0 and aot["autograd_cache_hit"] == 2
    final = reports.got[-1]
    assert final["final"] is True
    assert final["torch"]["fxGraphHits"] == 3 and final["torch"]["fxGraphMisses"] == 0
    assert final["torch"]["aotAutogradHits"] == 2 and final["torch"]["aotAutogradMisses"] == 0
    assert final["counts"]["requests"] == 3 and final["counts"]["hits"] == 3 and final["counts"]["compiles"] == 0
    assert final["fingerprint"] == warmed["summary"]["fingerprint"]  # the same path, env and torch: alike


def test_an_inductor_setting_in_the_env_misses_and_the_fingerprint_names_it(
        warmed: dict[str, Any], tmp_path: Path, storage_bed: Testbed) -> None:
    assert warmed["code"] == 0, warmed["log"]
    torch_dir = tmp_path / "inductor"
    out = run(["-I", "-S", str(AGENTS / "copier.py")], base_env(copier_env(storage_bed, warmed, tmp_path / "e", torch_dir)),
              tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    reports = Reports()
    try:
        seen = train(warmed, reports, torch_dir, {"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"})
    finally:
        reports.server.shutdown()
    assert seen["counters"]["inductor"]["fxgraph_cache_miss"] == 3
    fp, warm_fp = reports.got[-1]["fingerprint"], warmed["summary"]["fingerprint"]
    assert fp["inductorEnv"] == {"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"} and warm_fp["inductorEnv"] == {}
    assert reports.got[-1]["torch"]["fxGraphMisses"] == 3


def test_in_process_the_program_waits_at_import_torch_for_the_whole_copy(
        warmed: dict[str, Any], tmp_path: Path, storage_bed: Testbed) -> None:
    """The copier child that sitecustomize starts: its archive download is held at the
    proxy, and the program's `import torch` does not return until it is released (a marker
    the program writes right after the import stays absent), then it compiles nothing."""
    assert warmed["code"] == 0, warmed["log"]
    torch_dir, marker = tmp_path / "inductor", tmp_path / "imported"
    wrapper = warmed["app"] / f"wrapped_{uuid.uuid4().hex[:6]}.py"
    wrapper.write_text("import sys, torch\nopen(sys.argv.pop(1), 'w').close()\nimport runpy\n"
                       "sys.argv[0] = 'train_torch.py'\nrunpy.run_path('train_torch.py', run_name='__main__')\n")
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": "/download/.*torch-inductor-", "hold": "archive", "times": 1}])
    env = base_env({**copier_env(storage_bed, warmed, tmp_path / "entries", torch_dir),
                    "CACHEWARM_COPY_IN_PROCESS": "1", "CACHEWARM_COPY_SUMMARY": str(tmp_path / "copy" / "summary"),
                    "PYTHONPATH": str(site(tmp_path / "site")), "CACHEWARM_FRAMEWORK": "torch",
                    "TORCHINDUCTOR_CACHE_DIR": str(torch_dir), "TRITON_CACHE_DIR": str(torch_dir / "triton")})
    program = subprocess.Popen([TORCH_PYTHON, wrapper.name, str(marker), "--steps", "1"], env=env, cwd=warmed["app"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proxy.wait_held("archive")
        # While held, `import torch` has not returned: a process that did not wait would
        # write the marker within its import's few seconds. (A bound on seeing it absent,
        # not on the run: on a machine where the import takes longer than this, a process
        # that does not wait could pass unseen; one that waits never fails here.)
        stop = time.monotonic() + 15
        while time.monotonic() < stop and program.poll() is None:
            assert not marker.exists(), "import torch returned before the copy was over"
            time.sleep(0.2)
        proxy.release("archive")
        stdout, stderr = program.communicate(timeout=300)
    finally:
        proxy.clear_faults()
        if program.poll() is None:
            program.kill()
            program.wait()
    assert program.returncode == 0, stderr[-3000:]
    seen = json.loads(stdout.strip().splitlines()[-1])
    assert seen["counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert seen["counters"]["aotAutograd"].get("autograd_cache_miss", 0) == 0
    copy = json.loads((tmp_path / "copy" / "summary").read_text())
    assert copy["torch"]["archives"] == 1 and copy["torch"]["files"] > 10


@pytest.fixture
def gcs_env(storage_bed: Testbed, storage_only: storage.Client, monkeypatch: pytest.MonkeyPatch) -> str:
    """The warmer in this process against the emulator (its gcsfs is this venv's; the
    torch python is not needed for these): a fresh bucket's name."""
    for key, value in storage_bed.env().items():
        if key != "KUBECONFIG":
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setattr(warmer, "_FILESYSTEM", None)
    bucket = f"torch-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    return bucket


def child_warm(bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict[str, Any]]:
    """A torch warm whose entrypoint is a child (uncounted) that writes one Inductor-shaped
    file: the archive it leaves, uploaded, and the manifest."""
    inductor = tmp_path / "inductor"
    for name, value in {"CACHEWARM_FRAMEWORK": "torch", "CACHEWARM_CACHE_URL": f"gs://{bucket}/torch",
                        "CACHEWARM_MANIFEST": f"gs://{bucket}/{FOLDER}/demo-cpu-1.json",
                        "CACHEWARM_SUMMARY_FILE": str(tmp_path / "summary"),
                        "TORCHINDUCTOR_CACHE_DIR": str(inductor)}.items():
        monkeypatch.setenv(name, value)
    code = warmer.main(["command", "--", "sh", "-c", f"mkdir -p {inductor}/ab && echo so > {inductor}/ab/cx.so"])
    return code, json.loads((tmp_path / "summary").read_text())


def test_the_manifest_names_the_archive_the_warmer_built_not_one_swapped_in_after_the_upload(
        gcs_env: str, storage_only: storage.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone with write on the prefix replaces the archive (same name, same size, other
    bytes) between the warmer's upload and its manifest: the manifest still records the
    warmer's MD5 and the generation it wrote, so a copier refuses the swapped object."""
    real = warmer.put_file
    swapped: list[int] = []

    def put_then_swap(path: str, local: str, md5: str, size: int, custom_time: bool = False) -> str:
        generation = real(path, local, md5, size, custom_time)
        blob = storage_only.bucket(gcs_env).blob(path.split("/", 1)[1])
        blob.upload_from_string(b"\0" * size)
        [listed] = storage_only.list_blobs(gcs_env, prefix=blob.name)
        swapped.append(int(listed.generation))
        return generation

    monkeypatch.setattr(warmer, "put_file", put_then_swap)
    code, summary = child_warm(gcs_env, tmp_path, monkeypatch)
    assert code == 0 and summary["entriesWritten"] == 1, summary["errors"]
    doc = json.loads(storage_only.bucket(gcs_env).blob(f"{FOLDER}/demo-cpu-1.json").download_as_bytes())
    archive = warmer.torch_archive(str(tmp_path / "inductor"))[0]
    [entry] = doc["entries"]
    assert entry["name"] == f"torch-inductor-{hashlib.sha256(archive).hexdigest()}-cache"
    assert entry["md5"] == warmer._md5_base64(archive) and entry["size"] == len(archive)
    assert swapped and int(entry["generation"]) != swapped[0]  # the warmer's own, not the swapped object's


def test_a_same_size_object_already_under_the_archives_name_is_replaced_not_trusted(
        gcs_env: str, storage_only: storage.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object of the archive's name and size placed beforehand, other bytes: not "the
    same archive already there"; the warmer uploads its own and the manifest names it."""
    inductor = tmp_path / "inductor"
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab/cx.so").write_text("so\n")
    archive = warmer.torch_archive(str(inductor))[0]
    name = f"torch/torch-inductor-{hashlib.sha256(archive).hexdigest()}-cache"
    storage_only.bucket(gcs_env).blob(name).upload_from_string(b"\1" * len(archive))
    code, summary = child_warm(gcs_env, tmp_path, monkeypatch)
    assert code == 0 and summary["entriesWritten"] == 1, summary["errors"]
    [blob] = storage_only.list_blobs(gcs_env, prefix=name)
    generation = str(blob.generation)  # before the download, which resets the blob's properties here
    assert blob.download_as_bytes() == archive
    doc = json.loads(storage_only.bucket(gcs_env).blob(f"{FOLDER}/demo-cpu-1.json").download_as_bytes())
    assert doc["entries"] == [{"name": name.split("/")[-1], "size": len(archive), "md5": warmer._md5_base64(archive),
                               "generation": generation}]
    code, again = child_warm(gcs_env, tmp_path, monkeypatch)  # now the same bytes are there: refreshed, not uploaded
    assert code == 0 and again["entriesWritten"] == 0 and again["entriesRefreshed"] == 1, again["errors"]
