"""Writing without losing anything: output paths are checked before any work, files are
written whole or not at all (temp file + rename), and a work folder has one writer."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from jaxspec.errors import JaxspecError

UMASK = os.umask(0o022)  # the process's umask (reading it sets it: set back at once, at import)
os.umask(UMASK)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_writable_dir(folder: Path, what: str) -> None:
    """The folder exists or can be made, and a file can be created in it; else a one-line
    error (checked by trying, since permission bits do not bind root)."""
    folder = Path(folder)
    base = _nearest_existing(folder)
    if not base.is_dir():
        raise JaxspecError(f"{what} {folder}: {base} is a file, not a folder; pick another path")
    try:
        # Probe the deepest existing folder: making the missing ones is left to the writer.
        with tempfile.NamedTemporaryFile(dir=base, prefix=".jaxspec-probe-"):
            pass
    except OSError as e:
        raise JaxspecError(
            f"{what} {folder} is not writable ({e.strerror}); pick another path"
        ) from None


def check_output_file(path: Path, what: str = "--out") -> None:
    """A file the tool will write: not a folder, in a writable place."""
    path = Path(path)
    if path.is_dir():
        raise JaxspecError(f"{what} {path} is a folder; name a file, e.g. {path / 'results.json'}")
    check_writable_dir(path.parent, what)


def _same_or_inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def check_output_dir(
    out: Path, sources: Iterable[Path] = (), overwrite: bool = False, what: str = "--out"
) -> None:
    """A folder the tool will fill: never a source, inside one or holding one; empty or
    missing unless `overwrite`; writable."""
    out = Path(out)
    resolved = out.resolve()
    for src in sources:
        src = Path(src).resolve()
        if _same_or_inside(resolved, src) or _same_or_inside(src, resolved):
            raise JaxspecError(
                f"{what} {out} would overwrite the source {src}; write to another folder"
            )
    if out.exists() and not out.is_dir():
        raise JaxspecError(f"{what} {out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise JaxspecError(
            f"{what} {out} is not empty; pass --overwrite to replace its files, or name a new "
            "folder"
        )
    check_writable_dir(out, what)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yields a temp path beside `path` to write; renamed onto `path` only when the block
    ends without an exception, so a crash never leaves a file cut short at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~UMASK)  # as open() would make it, not mkstemp's 0600
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def save_npz(path: Path, data: dict) -> None:
    """np.savez, atomically (`path` keeps its name: no `.npz` is appended)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **data)


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def load_npz(path: Path) -> dict:
    """A cache file's arrays; a damaged file is a one-line error naming it and the fix."""
    try:
        with np.load(path) as f:
            return dict(f)
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError) as e:
        raise JaxspecError(
            f"cache file {path} is damaged ({type(e).__name__}); delete it and rerun to rebuild it"
        ) from None


@contextlib.contextmanager
def exclusive(folder: Path, what: str = "work folder") -> Iterator[None]:
    """Holds `folder`/.lock for the block; a second process gets a one-line error naming the
    first (released by the OS when the holder dies, so no stale lock survives a crash)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / ".lock"
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise JaxspecError(
                f"{what} {folder} is in use by {holder}; wait for it to finish or pass another "
                "--work-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)
