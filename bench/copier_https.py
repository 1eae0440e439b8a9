"""What a copy over HTTPS costs in CPU and time: the copier (copier.copy, as the init
container and the in-process copy run it) copies N entries from an HTTPS server (the
copier tests' fault injector, with no faults, serving a certificate of a CA made here)
into a fresh directory, several times. The default CAs are the system's bundle plus that
CA (SSL_CERT_FILE), so each TLS context loads a CA store of a real size. CPU is this
process's, the server's threads included (the same in every variant). `--per-connection`
gives urllib no context, as the copier did before one context per copy: each connection
makes its own.

Run: .venv/bin/python bench/copier_https.py [--entries 50] [--runs 5] [--per-connection]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "integration"), str(REPO / "tests")]

import test_copier as tc  # noqa: E402 - the tests' fault injector

from cachewarm.admission import certificates as certs
from cachewarm.agents import copier  # noqa: E402

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size", type=int, default=20000, help="bytes per entry")
    parser.add_argument("--per-connection", action="store_true", help="no shared context (urllib's default)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="copier-https-"))
    now = dt.datetime.now(dt.timezone.utc)
    ca = certs.make_ca("bench-ca", now=now)
    serving = certs.make_serving_cert(ca, ["127.0.0.1"], now=now)
    (folder / "cert").write_bytes(serving.cert_pem)
    (folder / "key").write_bytes(serving.key_pem)
    (folder / "bundle.pem").write_bytes((SYSTEM_BUNDLE.read_bytes() if SYSTEM_BUNDLE.exists() else b"") + ca.cert_pem)
    os.environ["SSL_CERT_FILE"] = str(folder / "bundle.pem")
    if args.per_connection:
        copier.ssl_context = lambda bundle, https=True: (None, "")  # type: ignore[assignment]
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(folder / "cert", folder / "key")
    objects = {f"jax/{tc.entry('jit_bench', str(i))}": os.urandom(args.size) for i in range(args.entries)}
    rows = []
    with tc.FaultInjector(objects, tls=tls).serving() as server:
        for run in range(args.runs):
            cpu, wall = time.process_time(), time.perf_counter()
            summary = copier.copy(tc.faulty_env(server, folder / f"cache{run}"), copier.new_summary("prefix"))
            rows.append((time.perf_counter() - wall, time.process_time() - cpu))
            assert summary["copied"] == args.entries and not summary["errors"], summary
    print(f"{args.entries} entries of {args.size} bytes over HTTPS, "
          f"{'a context per connection' if args.per_connection else 'one context per copy'}: "
          f"wall {statistics.median(r[0] for r in rows):.3f} s, CPU {statistics.median(r[1] for r in rows):.3f} s "
          f"(medians of {args.runs}; CA store {os.path.getsize(folder / 'bundle.pem')} bytes)")


if __name__ == "__main__":
    main()
