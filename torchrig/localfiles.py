"""Files torchrig writes on the operator's machine (saved plans, fetch's manifest, verify's
bandwidth records, reports), written one way: whole or not at all."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """`path` replaced whole by `data`: a temporary file beside it (O_EXCL | O_NOFOLLOW, 0600
    from its first byte, so nothing already there, a planted link included, is followed or
    reused: the write is refused instead), given `mode`, synced, renamed over `path`, and the
    folder synced. On any failure the temporary file is removed and `path` is as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    # os.write may take less than it was given (a report is megabytes)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fsync_dir(path: Path) -> None:
    """A rename in `path` made durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class EarlyFlush:
    """A file being written in a stream (fetch's partial file), flushed to disk on a thread
    every `every` bytes as it grows: the fsync before its rename then waits for the last
    stretch only (1 GiB: 0.5-0.7 s of writeback after the last byte otherwise, the page cache
    holding it all). wrote(n) after each write; close() before the final fsync."""

    def __init__(self, fd: int, every: int = 64 << 20):
        self.fd, self.every, self._pending = fd, every, 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def wrote(self, n: int) -> None:
        self._pending += n
        if self._pending >= self.every:
            self._pending = 0
            if self._thread is None:  # a small file never starts one
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                os.fdatasync(self.fd)  # the GIL is released: the stream goes on meanwhile
            except OSError:
                return  # the final fsync reports it

    def close(self) -> None:
        """Stop the thread (the descriptor may be closed after this)."""
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join()
