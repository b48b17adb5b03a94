"""Output that is never lost or left half-written.

* :func:`emit` writes results on stdout; a closed pipe or a full disk there becomes
  :class:`OutputClosed`, which :func:`mixprec.cli.main` reports in one line.
* :func:`write_file` writes a file through a temporary one in the same folder and renames it, so
  that a reader never sees a partial file; the folders it created are removed again when the
  write fails or is interrupted, so a failed run leaves nothing behind.
* :func:`folder_problem` says, before a long run, whether a folder could be created and written,
  without creating it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

__all__ = ["OutputClosed", "emit", "folder_problem", "silence", "write_file"]


class OutputClosed(Exception):
    """Standard output cannot be written (``reason`` says why: a broken pipe, no space left)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def emit(text: str = "") -> None:
    """Print ``text`` and a newline on stdout, flushed.

    Raises:
        OutputClosed: stdout is a closed pipe, a full disk, or otherwise unwritable.

    Host sync: none.
    """
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as exc:  # BrokenPipeError is one
        raise OutputClosed(exc.strerror or str(exc)) from None


def silence(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null, so that the interpreter's last flush of
    what it still buffers cannot fail with a traceback after the error was reported.

    Host sync: none.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # StringIO and the like: nothing to flush
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _missing_parents(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, outermost first."""
    missing = []
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing[::-1]


def folder_problem(folder: Path) -> str | None:
    """Why files could not be written into ``folder`` (created if missing), or None.

    Creates nothing: checks the folder, or the nearest existing folder above it.

    Host sync: none.
    """
    target = folder.absolute()
    while not target.exists():
        target = target.parent
    if target != folder.absolute() and not target.is_dir():
        return f"{target} is a file, so {folder} cannot be created"
    if not target.is_dir():
        return f"{folder} exists and is not a folder"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"{target} is not writable"
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_file(path: Path, write: Callable[[Path], object]) -> Path:
    """Create ``path`` by calling ``write(tmp)`` on a temporary file beside it, then renaming.

    Missing folders are created first and removed again if anything fails (an error, Ctrl-C),
    together with the temporary file; an existing ``path`` is replaced only by a complete file.

    Raises:
        OSError: the folder or the file cannot be written (the message names it).

    Host sync: none.
    """
    created = _missing_parents(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(21, "it is a folder", str(path))
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        tmp.chmod(0o666 & ~_umask())  # mkstemp makes it private; the result follows the umask
        write(tmp)
        os.replace(tmp, path)
        tmp = None
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if still empty
        raise
    return path
