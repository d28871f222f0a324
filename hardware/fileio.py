"""Every file the tool reads or writes goes through here: size-capped UTF-8 reads, atomic writes, output paths
checked before any work. Failures are InputErrors naming the flag or file (exit 2), never tracebacks."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hardware.errors import InputError, shown_path

MAX_FILE_BYTES = 1_000_000  # plan files, profiles, model YAMLs, imported configs: larger is refused unread
MAX_TABLE_BYTES = 20_000_000  # runs CSVs: ~40,000 rows of the runs schema


def read_text(path: str | Path, limit: int = MAX_FILE_BYTES) -> str:
    """A user's text file: it must exist, be a regular file of at most `limit` bytes and decode as UTF-8."""
    p = Path(path)
    try:
        if not p.is_file():
            raise InputError(f"{shown_path(p)}: file not found" + (" (it is a folder)" if p.is_dir() else ""))
        if p.stat().st_size > limit:
            raise InputError(f"{shown_path(p)}: file is larger than {limit:,} bytes")
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"{shown_path(p)}: cannot read ({e.strerror or e})") from None
    if len(data) > limit:  # a file that grew (or a /proc file reporting size 0)
        raise InputError(f"{shown_path(p)}: file is larger than {limit:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{shown_path(p)}: not UTF-8 text (byte {e.start}); expected a UTF-8 text file") from None


def check_output_path(path: str | Path, flag: str) -> Path:
    """Check that `path` can be written before any work is done: its folder exists and takes a new file, and the
    path is not a folder or a device. Returns the path."""
    p = Path(path)
    shown = f"{flag} {shown_path(p)}"
    if p.is_dir():
        raise InputError(f"{shown}: is a folder; expected a file path")
    if p.exists() and not p.is_file():
        raise InputError(f"{shown}: is not a regular file; expected a file path")
    if not p.parent.is_dir():
        raise InputError(f"{shown}: folder {shown_path(p.parent)} does not exist")
    try:  # the only honest writability test: create (and remove) a file where the output will go
        fd, probe = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name[:40]}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{shown}: folder {shown_path(p.parent)} is not writable ({e.strerror or e})") from None
    return p


@contextlib.contextmanager
def atomic_path(path: str | Path, flag: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write the whole output to; on success it replaces `path` in one
    rename (os.replace), on any failure it is removed, so an existing file is never truncated or half-written."""
    p = check_output_path(path, flag)
    fd, tmp_name = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name[:40]}.", suffix=".tmp" + p.suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _keep_mode(p, tmp)
        _sync(tmp)
        os.replace(tmp, p)
    except OSError as e:
        raise InputError(f"{flag} {shown_path(p)}: cannot write ({e.strerror or e}); the file is unchanged") \
            from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _sync(path: Path) -> None:
    """Flush the written file to disk before the rename, so that a crash leaves the old file or the new one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_mode(target: Path, tmp: Path) -> None:
    """The new file gets the old file's permissions, or the umask's for a new file (mkstemp makes it 0600)."""
    if target.is_file():
        os.chmod(tmp, target.stat().st_mode & 0o7777)
        return
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)


def write_text(path: str | Path, text: str, flag: str = "output") -> Path:
    """Write `text` (UTF-8) to `path` atomically (see atomic_path)."""
    with atomic_path(path, flag) as tmp:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
    return Path(path)
