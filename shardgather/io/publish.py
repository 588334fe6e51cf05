"""Atomic publishing: a finished temporary file or directory takes its final name in one
step, durably — readers see the old version or the complete new one, never a part.

Files: ``os.replace`` then an fsync of the parent directory (the rename itself is not
durable until the directory is). Directories cannot be renamed over a non-empty one, so
an existing directory is swapped with ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15,
glibc >= 2.28): the final name never disappears. Where that is unavailable, the old
directory is renamed aside first (a short window without the final name).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(tmp: str, final: str) -> None:
    """Rename a finished (already fsync'ed) file into place, durably."""
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False  # e.g. a filesystem without exchange support
    raise OSError(err, f"cannot exchange {a!r} and {b!r}: {os.strerror(err)}")


def publish_dir(tmp: str, final: str, keep: Callable[[str], bool] | None = None) -> None:
    """Make the finished directory ``tmp`` the directory ``final``.

    ``keep(name)``: entries of an existing ``final`` to carry into the new one (files
    are hard-linked in before the swap, so they never go missing; sub-directories are
    moved over after it). Everything else of the old directory is deleted.
    """
    moved_later: list[str] = []
    if os.path.isdir(final) and keep is not None:
        for name in os.listdir(final):
            if not keep(name) or os.path.lexists(os.path.join(tmp, name)):
                continue
            old = os.path.join(final, name)
            if os.path.isdir(old) and not os.path.islink(old):
                moved_later.append(name)
                continue
            try:
                os.link(old, os.path.join(tmp, name), follow_symlinks=False)
            except OSError:
                shutil.copy2(old, os.path.join(tmp, name), follow_symlinks=False)
    fsync_dir(tmp)
    parent = os.path.dirname(final)
    aside = None
    if os.path.lexists(final):
        if _exchange(tmp, final):
            aside = tmp  # now holds the old directory
        else:
            aside = os.path.join(parent, f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)
    fsync_dir(parent)
    if aside is not None:
        for name in moved_later:
            with contextlib.suppress(OSError):
                os.rename(os.path.join(aside, name), os.path.join(final, name))
        if moved_later:
            fsync_dir(final)
        if os.path.isdir(aside) and not os.path.islink(aside):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.unlink(aside)
