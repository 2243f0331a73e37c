"""Files torchrig writes on the operator's machine (saved plans, fetch's manifest, verify's
bandwidth records, reports), written one way: whole or not at all."""

from __future__ import annotations

import os
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
