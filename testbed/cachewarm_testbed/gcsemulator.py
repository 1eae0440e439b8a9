"""The GCS emulator (gcp-storage-emulator) as the testbed runs it: `--in-memory`, without
the emulator's dump of its whole state on every write.

The emulator persists by serialising every bucket and object it holds (indented JSON,
`.meta`) after each write; in memory nothing ever reads that dump back, and its cost grows
with the state: with 1,000 buckets each write took about 25 ms of CPU, so the emulator, not
the operator, set the pace of bench/scale.py (real GCS serves buckets independently). Every
answer is unchanged: only the write of the unread dump is skipped. Usage is the emulator's
own: python -m cachewarm_testbed.gcsemulator start --host=... --port=... --in-memory
"""

from __future__ import annotations

from gcp_storage_emulator import __main__ as emulator
from gcp_storage_emulator import storage

_write_config_to_file = getattr(storage.Storage, "_write_config_to_file", None)


def _write_unless_in_memory(self: storage.Storage) -> None:
    if not self._use_memory_fs and _write_config_to_file is not None:
        _write_config_to_file(self)


def main() -> None:
    # An emulator release without these internals runs as it is (slower, same answers).
    if hasattr(storage.Storage, "_write_config_to_file") and "_use_memory_fs" in storage.Storage.__init__.__code__.co_names:
        storage.Storage._write_config_to_file = _write_unless_in_memory
    emulator.main()


if __name__ == "__main__":
    main()
