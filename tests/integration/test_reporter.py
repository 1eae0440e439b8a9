"""The reporter in a training process, as a pod runs it: the shipped files on a prepended
PYTHONPATH, an ordinary JAX training script that knows nothing of cachewarm, and a report
endpoint that answers, refuses, hangs or is not there. Real JAX compiles on CPU; the
endpoint is a local HTTP(S) server of the test's own."""

from __future__ import annotations

import datetime as dt
import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cachewarm.admission import certificates as certs

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tests" / "data" / "jax_train.py"


def site(tmp_path: Path) -> Path:
    """The emptyDir the init container fills: the reporter, its sitecustomize, the warmer."""
    where = tmp_path / "cachewarm-site"
    where.mkdir()
    shutil.copy(REPO / "operator" / "cachewarm" / "agents" / "reporter.py", where / "cachewarm_reporter.py")
    shutil.copy(REPO / "operator" / "cachewarm" / "agents" / "sitecustomize.py", where / "sitecustomize.py")
    shutil.copy(REPO / "operator" / "cachewarm" / "agents" / "warmer.py", where / "warm.py")
    return where


@dataclass
class Endpoint:
    url: str
    reports: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def serve(status: int = 200, tls: tuple[Path, Path] | None = None) -> tuple[Endpoint, http.server.HTTPServer]:
    endpoint = Endpoint("")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            endpoint.reports.append(json.loads(body))
            endpoint.headers.append(dict(self.headers))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    scheme = "http"
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(tls[0]), str(tls[1]))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    endpoint.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/report"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return endpoint, server


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    found, server = serve()
    yield found
    server.shutdown()


def train(tmp_path: Path, url: str, *args: str, extra_env: dict[str, str] | None = None,
          pythonpath: str | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    where = tmp_path / "cachewarm-site"
    if not where.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        site(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "CACHEWARM_", "XLA_"))}
    env.update({
        "PYTHONPATH": pythonpath if pythonpath is not None else str(where),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
        "CACHEWARM_REPORT_URL": url, "CACHEWARM_CACHE": "llama",
        "CACHEWARM_POD_NAMESPACE": "ml", "CACHEWARM_POD_NAME": "trainer", "CACHEWARM_POD_UID": "u-1",
        **(extra_env or {}),
    })
    out = subprocess.run([sys.executable, str(TRAIN), *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def test_a_training_process_reports_its_misses_then_its_hits(tmp_path: Path, endpoint: Endpoint) -> None:
    _, cold = train(tmp_path, endpoint.url, "--extra")
    [report] = endpoint.reports  # the run is shorter than the first report's delay: the one at exit
    assert report["pod"] == {"namespace": "ml", "name": "trainer", "uid": "u-1"} and report["cache"] == "llama"
    counts = report["counts"]
    assert (counts["requests"], counts["hits"], counts["misses"]) == (cold["requests"], 0, cold["requests"])
    assert counts["compiles"] >= cold["requests"] and counts["compileSecondsSpent"] > 0
    assert {m["program"] for m in counts["lastMisses"]} >= {"jit_train_step", "jit_evaluate"}
    assert all(len(m["key"]) > 64 for m in counts["lastMisses"])
    assert report["fingerprint"]["platform"] == "cpu" and report["fingerprint"]["cacheDir"] == str(tmp_path / "cache")
    _, warm = train(tmp_path, endpoint.url, "--extra")
    counts = endpoint.reports[1]["counts"]
    assert counts["hits"] == counts["requests"] == warm["hits"] > 0 and counts["misses"] == 0
    # JAX's own estimate (compile time recorded with the entry minus load time): on CPU a
    # program this small loads slower than it compiles, so it may be negative; it is there.
    assert counts["compileSecondsSaved"] != 0 and counts["lastMisses"] == []
    # The entries it hit, by JAX's own key: the very keys the cold run missed.
    assert {h["key"] for h in counts["hitKeys"]} == {m["key"] for m in endpoint.reports[0]["counts"]["lastMisses"]}


@pytest.mark.parametrize("answer", ["refused", "500", "hangs"])
def test_training_is_unaffected_when_reports_cannot_be_delivered(tmp_path: Path, answer: str) -> None:
    """The same output with the endpoint down, failing or hanging: the process exits on its
    own (a hung report is given up after the exit bound), and says once that it could not
    report."""
    hung = socket.socket()
    if answer == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/report"  # closed again: nothing listens
        server = None
    elif answer == "500":
        failing, server = serve(status=500)
        url = failing.url
    else:
        hung.bind(("127.0.0.1", 0))
        hung.listen(1)  # accepts into the backlog, never answers
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/report"
        server = None
    out, result = train(tmp_path, url)
    _, unreported = train(tmp_path / "off", "", pythonpath="")
    assert result["requests"] == unreported["requests"] and result["compiled"] == unreported["compiled"]
    assert out.stderr.count("cachewarm reporter: could not send a report") == 1
    hung.close()
    if server is not None:
        server.shutdown()


def test_reports_go_over_https_with_the_pods_token_and_the_given_ca(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    ca = certs.make_ca("test-ca", now=now)
    serving = certs.make_serving_cert(ca, ["127.0.0.1"], now=now)
    (tmp_path / "tls.crt").write_bytes(serving.cert_pem)
    (tmp_path / "tls.key").write_bytes(serving.key_pem)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    (tmp_path / "token").write_text("projected-token\n")
    secure, server = serve(tls=(tmp_path / "tls.crt", tmp_path / "tls.key"))
    try:
        train(tmp_path, secure.url, extra_env={"CACHEWARM_REPORT_CA": ca.cert_pem.decode(),  # as the webhook gives it
                                               "CACHEWARM_REPORT_TOKEN_FILE": str(tmp_path / "token")})
        assert len(secure.reports) == 1 and secure.headers[0]["Authorization"] == "Bearer projected-token"
        # Without the CA the server is not trusted: nothing is sent, training goes on.
        out, _ = train(tmp_path, secure.url)
        assert len(secure.reports) == 1 and "CERTIFICATE_VERIFY_FAILED" in out.stderr
    finally:
        server.shutdown()


def test_the_images_pythonpath_and_sitecustomize_still_work(tmp_path: Path, endpoint: Endpoint) -> None:
    """The pod's PYTHONPATH replaced the image's ENV PYTHONPATH: the value an init container
    recorded is restored behind the reporter's directory, and the image's own
    sitecustomize (further down the path) still runs."""
    where = site(tmp_path)
    image_lib = tmp_path / "image-lib"
    image_lib.mkdir()
    (image_lib / "teamlib.py").write_text("VALUE = 'from the image'\n")
    (image_lib / "sitecustomize.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['MARK']).write_text('image sitecustomize ran')\n")
    (where / "image-pythonpath").write_text(f"{image_lib}\n")
    script = tmp_path / "uses_teamlib.py"
    script.write_text("import sys, teamlib\nprint(teamlib.VALUE)\nprint(sys.path.index(%r) < sys.path.index(%r))\n"
                      % (str(where), str(image_lib)))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("CACHEWARM_", "JAX_"))},
           "PYTHONPATH": str(where), "MARK": str(tmp_path / "mark"), "CACHEWARM_REPORT_URL": endpoint.url,
           "CACHEWARM_RESTORE_IMAGE_PYTHONPATH": "1"}  # the webhook's word: the spec set no PYTHONPATH
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from", "the", "image", "True"]
    assert (tmp_path / "mark").read_text() == "image sitecustomize ran"
    assert endpoint.reports == []  # no jax: nothing counted, nothing sent
    # A container whose spec set its own PYTHONPATH had the image's replaced: not restored.
    env.pop("CACHEWARM_RESTORE_IMAGE_PYTHONPATH")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "No module named 'teamlib'" in out.stderr
    # A reporter that cannot load (here a file an older interpreter could not read) still
    # leaves the process the image's paths: sitecustomize restores them by itself.
    env["CACHEWARM_RESTORE_IMAGE_PYTHONPATH"] = "1"
    (where / "cachewarm_reporter.py").write_text("this is not python\n")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from", "the", "image", "True"]


def test_a_process_without_jax_does_not_import_it(tmp_path: Path, endpoint: Endpoint) -> None:
    where = site(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(where), "CACHEWARM_REPORT_URL": endpoint.url}
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps('jax' in sys.modules))"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "false" and out.stderr == ""


def test_the_processs_logging_and_jaxs_loader_stay_as_they_were(tmp_path: Path, endpoint: Endpoint) -> None:
    """The reporter reads JAX's miss records without changing what the process logs (a level
    the user sets on `jax` after importing it still silences them) and leaves jax's module
    loader as it was (importlib.resources still lists the package's files)."""
    where = site(tmp_path)
    script = tmp_path / "quiet.py"
    script.write_text(
        "import logging, importlib.resources, json\n"
        "import jax, jax.numpy as jnp\n"
        "logging.basicConfig(level=logging.DEBUG)\n"
        "logging.getLogger('jax').setLevel(logging.ERROR)\n"
        "jax.jit(lambda x: x * 2)(jnp.ones(4)).block_until_ready()\n"
        "print(json.dumps(len(list(importlib.resources.files('jax').iterdir())) > 10))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "CACHEWARM_", "PYTHONPATH"))}
    env.update({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_EXPLAIN_CACHE_MISSES": "1", "CACHEWARM_REPORT_URL": endpoint.url})
    runs = {}
    for label, path in (("on", str(where)), ("off", "")):
        out = subprocess.run([sys.executable, str(script)], env={**env, "PYTHONPATH": path}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs[label] = out
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    assert runs["on"].stdout.strip() == runs["off"].stdout.strip() == "true"
    assert "jax._src.compiler" not in runs["off"].stderr and "jax._src.compiler" not in runs["on"].stderr
    [report] = endpoint.reports
    assert "jit__lambda" in {m["program"] for m in report["counts"]["lastMisses"]}  # read all the same


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox-static (make node-deps)")
@pytest.mark.parametrize("image_env", [{"PYTHONPATH": "/opt/lib:/srv/app"}, {}])
def test_the_recorders_command_writes_the_images_pythonpath_with_only_busybox(tmp_path: Path,
                                                                             image_env: dict[str, str]) -> None:
    """The recorder init container's exact command, with the static busybox the copy puts
    in the emptyDir and an environment with nothing else on PATH (as in an image without
    a shell): the file holds the image's PYTHONPATH (empty when it sets none), exit 0."""
    from cachewarm.builders.reporting import RECORD_PYTHONPATH

    shutil.copy(shutil.which("busybox") or "", tmp_path / "busybox")
    target = tmp_path / "image-pythonpath"
    done = subprocess.run([str(tmp_path / "busybox"), "sh", "-c", RECORD_PYTHONPATH, str(target)],
                          env={"PATH": "/nonexistent", **image_env}, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert target.read_text() == image_env.get("PYTHONPATH", "")
    unwritable = subprocess.run([str(tmp_path / "busybox"), "sh", "-c", RECORD_PYTHONPATH, "/proc/nope/x"],
                                env={"PATH": "/nonexistent"}, capture_output=True, timeout=30)
    assert unwritable.returncode == 0  # a failed write never keeps the pod from starting


def test_a_pod_with_a_local_copy_says_what_it_did_in_its_report(tmp_path: Path, endpoint: Endpoint) -> None:
    """The copy's init container left its summary where CACHEWARM_LOCAL_COPY_SUMMARY says:
    the report carries it (cold, with the first error); without the file (the copy did not
    run or could not write it) the report goes as before, without it."""
    summary = tmp_path / "local-copy" / "summary.json"
    summary.parent.mkdir()
    summary.write_text(json.dumps({"copied": 0, "present": 2, "bytes": 0, "failed": 3, "wanted": 5, "cold": True,
                                   "source": "manifest", "seconds": 1.23456,
                                   "errors": ["HTTPError 403: Forbidden", "again"], "leftOut": {"budget": 0},
                                   "manifestsMissing": []}))
    train(tmp_path, endpoint.url, extra_env={"CACHEWARM_LOCAL_COPY_SUMMARY": str(summary)})
    [report] = endpoint.reports
    assert report["localCopy"] == {"copied": 0, "present": 2, "bytes": 0, "failed": 3, "cold": True,
                                   "seconds": 1.235, "source": "manifest", "error": "HTTPError 403: Forbidden"}
    assert report["counts"]["requests"] > 0  # the report as ever, with it
    summary.unlink()
    train(tmp_path, endpoint.url, extra_env={"CACHEWARM_LOCAL_COPY_SUMMARY": str(summary)})
    assert "localCopy" not in endpoint.reports[1] and endpoint.reports[1]["counts"]["requests"] > 0
