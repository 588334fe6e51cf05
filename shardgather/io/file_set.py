"""A set of output files laid out before any data moves: one safetensors file, or the
sharded directory transformers' ``save_pretrained`` writes. Names, headers and where
each tensor's bytes go follow from (name, dtype, shape) alone, so every rank knows
them without a message. Files are created under a temporary name beside the final
path, written, fsync'ed by every writer, and published atomically (publish.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import hf_layout
from .publish import publish_dir, publish_file
from .safetensors_format import ALIASES_KEY, encode_header


@dataclass
class FileSet:
    """What one save writes: the files' names, headers and sizes, and where each primary
    entry's bytes go. One file (``directory=False``) or an HF directory."""

    final: str  # the file, or the directory, that appears at the end
    directory: bool
    names: list[str]  # file names (in the directory; the final's own name for one file)
    headers: list[bytes]
    sizes: list[int]  # whole-file sizes
    where: dict[str, tuple[int, int]]  # primary model key -> (file index, absolute offset)
    extra: dict[str, bytes] = field(default_factory=dict)  # index and pass-through files


def lay_out(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
    path: str | os.PathLike,
    *,
    metadata: dict[str, str] | None = None,
    max_shard_size: int | None = None,
    files: dict[str, bytes] | None = None,
    aliases: dict[str, str] | None = None,
    total_parameters: int | None = None,
) -> FileSet:
    """Files for ``(stored name, dtype, shape)`` tensors in this order (``where`` keyed
    by stored name); ``aliases``: alias -> stored name, recorded in its tensor's file."""
    nbytes = {}
    for name, dtype, shape in tensors:
        n = dtype.itemsize
        for d in shape:
            n *= d
        nbytes[name] = n
    info = {name: (dtype, shape) for name, dtype, shape in tensors}
    if max_shard_size is None:
        groups = [[name for name, _, _ in tensors]]
        names = [os.path.basename(os.fspath(path))]
    else:
        groups = hf_layout.split_shards([(n, nbytes[n]) for n, _, _ in tensors], max_shard_size)
        names = hf_layout.shard_names(len(groups))
    headers: list[bytes] = []
    sizes: list[int] = []
    where: dict[str, tuple[int, int]] = {}
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(groups):
        layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        pos = 0
        for k in keys:
            layout[k] = (info[k][0], info[k][1], pos, pos + nbytes[k])
            pos += nbytes[k]
            weight_map[k] = names[i]
        meta = dict(metadata or {})
        meta["format"] = "pt"
        # Tied aliases are recorded with their tensor, in the file that stores it.
        here = set(keys)
        tied = {a: p for a, p in (aliases or {}).items() if p in here}
        if tied:
            meta[ALIASES_KEY] = json.dumps(tied)
        header = encode_header(layout, meta)
        for k in keys:
            where[k] = (i, len(header) + layout[k][2])
        headers.append(header)
        sizes.append(len(header) + pos)
    extra = dict(files or {})
    if max_shard_size is not None and len(groups) > 1:
        total = sum(nbytes.values())
        extra[hf_layout.INDEX_FILE] = hf_layout.index_document(
            weight_map,
            total,
            total_parameters
            if total_parameters is not None
            else sum(nbytes[n] // info[n][0].itemsize for n in nbytes),
        )
    return FileSet(
        final=os.path.abspath(os.fspath(path)),
        directory=max_shard_size is not None,
        names=names,
        headers=headers,
        sizes=sizes,
        where=where,
        extra=extra,
    )


def write_alone(fs: FileSet, fill: Callable[[list[int], dict[str, tuple[int, int]]], None]) -> None:
    """One process writes the whole file set: ``fill(fds, where)`` pwrites every
    tensor (``fds[i]`` is file ``i``'s descriptor, ``where`` as in the FileSet); then
    fsync and atomic publishing, or nothing left behind on any error."""
    tmp, _paths, fds = create(fs)
    try:
        fill(fds, fs.where)
        for fd in fds:
            os.fsync(fd)
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        remove(tmp)
        raise
    for fd in fds:
        os.close(fd)
    try:
        publish(fs, tmp)
    except BaseException:
        remove(tmp)
        raise


class OpenFiles:
    """This rank's descriptors of the temporary files, opened on first use (a rank
    that only sends pieces to rank 0 opens none); fsync'ed and closed at the end."""

    def __init__(self, paths: list[str], fds: list[int] | None = None) -> None:
        self.paths = paths
        self.fds: dict[int, int] = dict(enumerate(fds)) if fds else {}
        self.direct_fds: dict[int, int] = {}  # -1: the filesystem refuses O_DIRECT

    def fd(self, i: int) -> int:
        if i not in self.fds:
            self.fds[i] = os.open(self.paths[i], os.O_WRONLY)
        return self.fds[i]

    def direct(self, fd: int) -> int:
        """A descriptor of the same file opened with O_DIRECT (writes from aligned memory
        go to the disk by DMA: no copy into the page cache, no CPU), or -1."""
        i = next(i for i, f in self.fds.items() if f == fd)
        if i not in self.direct_fds:
            try:
                self.direct_fds[i] = os.open(
                    self.paths[i], os.O_WRONLY | getattr(os, "O_DIRECT", 0)
                )
            except OSError:  # e.g. tmpfs
                self.direct_fds[i] = -1
            if not hasattr(os, "O_DIRECT") and self.direct_fds[i] >= 0:
                os.close(self.direct_fds[i])
                self.direct_fds[i] = -1
        return self.direct_fds[i]

    def sync(self) -> None:
        # Every writer flushes its own writes: rank 0's fsync could run before another
        # rank's pwrite reached the page cache, and the rename would outlive the data.
        for fd in [*self.fds.values(), *self.direct_fds.values()]:
            if fd >= 0:
                os.fsync(fd)

    def close(self) -> None:
        for fd in [*self.fds.values(), *self.direct_fds.values()]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fds.clear()
        self.direct_fds.clear()


def create(fs: FileSet) -> tuple[str, list[str], list[int]]:
    """Rank 0: the temporary file (or directory and files), sized, headers written, the
    index and pass-through files complete. Returns (temp path, file paths, fds)."""
    parent = os.path.dirname(fs.final) or "."
    base = os.path.basename(fs.final)
    if fs.directory:
        if os.path.lexists(fs.final) and not os.path.isdir(fs.final):
            raise OSError(f"{fs.final!r} exists and is not a directory")
        tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would publish a private export
        paths = [os.path.join(tmp, n) for n in fs.names]
    else:
        if os.path.isdir(fs.final):
            raise OSError(
                f"{fs.final!r} is a directory; pass max_shard_size= to write the Hugging Face "
                "directory layout there, or a file path"
            )
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it, not mkstemp's 0600
        os.close(fd)
        paths = [tmp]
    fds: list[int] = []
    try:
        for p, header, size in zip(paths, fs.headers, fs.sizes):
            fds.append(os.open(p, os.O_RDWR | os.O_CREAT, 0o644))
            os.ftruncate(fds[-1], size)
            os.pwrite(fds[-1], header, 0)
        for name, data in fs.extra.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for fd in fds:
            os.close(fd)
        remove(tmp)
        raise
    return tmp, paths, fds


def _umask() -> int:
    """The process umask (reading it means setting it: restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove(tmp: str | None) -> None:
    if tmp is None:
        return
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.lexists(tmp):
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def publish(fs: FileSet, tmp: str) -> None:
    if fs.directory:
        # Files of an existing directory that are not weights (config.json, tokenizer,
        # README) stay; old shards and indexes go, or a loader would mix them in.
        publish_dir(tmp, fs.final, keep=lambda n: not hf_layout.is_weights_file(n))
    else:
        publish_file(tmp, fs.final)
