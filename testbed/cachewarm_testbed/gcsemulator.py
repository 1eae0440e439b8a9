"""The GCS emulator (gcp-storage-emulator) as the testbed runs it: `--in-memory`, without
the emulator's dump of its whole state on every write, and with a listen backlog that does
not drop connections.

The emulator persists by serialising every bucket and object it holds (indented JSON,
`.meta`) after each write; in memory nothing ever reads that dump back, and its cost grows
with the state: with 1,000 buckets each write took about 25 ms of CPU, so the emulator, not
the operator, set the pace of bench/scale.py (real GCS serves buckets independently). Every
answer is unchanged: only the write of the unread dump is skipped. Usage is the emulator's
own: python -m cachewarm_testbed.gcsemulator start --host=... --port=... --in-memory

The emulator serves one request at a time on http.server's HTTPServer, whose listen backlog
is socketserver's default of 5. Clients that open more connections at once (the copier's
16 downloads, through the proxy's connection pool) overflow it; Linux then drops the SYN,
and the client's connect waits for its retransmission: one second. About one burst of ten
downloads in ten stalled that long (measured: 4 of 40, worst 1.04 s), which GCS, with no
such backlog, never does. The backlog is raised to SOMAXCONN's usual 4096 (the kernel caps
it at net.core.somaxconn); requests are still served one at a time, in order.
"""

from __future__ import annotations

import socket
from http import server

from gcp_storage_emulator import __main__ as emulator
from gcp_storage_emulator import storage

_write_config_to_file = getattr(storage.Storage, "_write_config_to_file", None)


def _write_unless_in_memory(self: storage.Storage) -> None:
    if not self._use_memory_fs and _write_config_to_file is not None:
        _write_config_to_file(self)


def main() -> None:
    server.HTTPServer.request_queue_size = socket.SOMAXCONN
    # An emulator release without these internals runs as it is (slower, same answers).
    if hasattr(storage.Storage, "_write_config_to_file") and "_use_memory_fs" in storage.Storage.__init__.__code__.co_names:
        storage.Storage._write_config_to_file = _write_unless_in_memory
    emulator.main()


if __name__ == "__main__":
    main()
