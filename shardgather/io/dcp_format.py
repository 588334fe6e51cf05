"""torch.distributed.checkpoint (DCP) directories as load sources, read without
unpickling anything from disk with pickle's full powers.

A DCP directory holds ``.metadata`` (a pickle: each key's dtype, size and chunks, and
where each chunk is stored) and ``__R_I.distcp`` files; with torch's default
``FileSystemWriter`` every chunk is a small ``torch.save`` zip (uncompressed) at an
offset of a ``.distcp`` file. Both are parsed here by restricted unpicklers that only
build the handful of classes those files contain (anything else raises
:class:`CheckpointError`), and a chunk's zip is read through a window on its file: its
directory and ``data.pkl`` (a few KB) tell where its raw row-major bytes start. Each rank
then preads just the element ranges of its own shard (:mod:`.stored`).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from .stored import Extent, StoredTensor
from .torch_archive import Archive, TensorRef, torch_dtype

METADATA_FILE = ".metadata"

# The classes a .metadata pickle is made of (torch 2.x). Resolved lazily: importing
# torch.distributed.checkpoint costs ~0.5 s and is needed only for DCP directories.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        dtype = torch_dtype(module, name)
        if dtype is not None:
            return dtype
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.where}: refusing to unpickle {module}.{name} (not one of the classes DCP "
            "metadata is made of). If you trust this directory, convert it with torch "
            "(torch.distributed.checkpoint.format_utils.dcp_to_torch_save) and load that file."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where}: unexpected persistent id in DCP metadata")


def is_dcp_directory(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def read_metadata(directory: str) -> Any:
    """The directory's ``Metadata`` object, through the restricted unpickler."""
    where = os.path.join(directory, METADATA_FILE)
    try:
        with open(where, "rb") as f:
            md = _MetadataUnpickler(f, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or not a pickle
        raise CheckpointError(f"{where}: not readable DCP metadata ({exc})") from None
    if not hasattr(md, "state_dict_metadata") or not isinstance(
        getattr(md, "storage_data", None), dict
    ):
        raise CheckpointError(
            f"{where}: DCP metadata without storage data (written by a custom storage writer?)"
        )
    return md


def dcp_sources(directory: str) -> dict[str, StoredTensor]:
    """Every tensor key of a DCP directory -> where its chunks' bytes are. Only
    ``.metadata`` is read here; a chunk's own few-KB zip directory is read when a rank
    first needs its bytes (:func:`locate_chunks`). Non-tensor entries are left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = os.path.abspath(directory)
    md = read_metadata(directory)
    stored: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in md.storage_data.items():
        stored[(index.fqn, tuple(index.offset or ()))] = info
    out: dict[str, StoredTensor] = {}
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        shape = tuple(int(d) for d in meta.size)
        chunks = []
        for chunk in meta.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            info = stored.get((key, offsets))
            if info is None:
                raise CheckpointError(
                    f"{directory}: {key!r} has a chunk at {list(offsets)} that no file stores: "
                    "the checkpoint is incomplete"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{directory}: {key!r} is stored through {list(info.transform_descriptors)} "
                    "(compressed or transformed chunks); convert the directory with torch first"
                )
            name = info.relative_path
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise CheckpointError(
                    f"{directory}: {key!r} points at {name!r}, outside the directory"
                )
            chunks.append(
                _Chunk(
                    os.path.join(directory, name),
                    int(info.offset),
                    int(info.length),
                    offsets,
                    tuple(int(s) for s in chunk.sizes),
                )
            )
        out[key] = _chunked(key, meta.properties.dtype, shape, chunks)
    _check_files({c for t in out.values() for c, _ in t.chunks.values()}, directory)
    return out


def _check_files(chunks: set[_Chunk], directory: str) -> None:
    """Every chunk's file exists and holds its stored range (a stat per file)."""
    sizes: dict[str, int] = {}
    for c in sorted(chunks, key=lambda c: (c.path, c.offset)):
        if c.path not in sizes:
            try:
                sizes[c.path] = os.stat(c.path).st_size
            except OSError:
                raise CheckpointError(
                    f"{directory}: {os.path.basename(c.path)!r} is missing (the metadata "
                    "stores chunks in it): the checkpoint is incomplete"
                ) from None
        if c.offset < 0 or c.length <= 0 or c.offset + c.length > sizes[c.path]:
            raise CheckpointError(
                f"{c.path}: holds {sizes[c.path]} bytes, the metadata stores a chunk at "
                f"[{c.offset}, {c.offset + c.length}): the file is truncated"
            )


@dataclass(frozen=True)
class _Chunk:
    path: str
    offset: int  # of its torch.save zip in the file
    length: int
    offsets: tuple[int, ...]  # its box in the full tensor
    sizes: tuple[int, ...]


class DcpTensor(StoredTensor):
    """A DCP tensor: its extents are known from the metadata alone, but their byte
    offsets only once the chunk's zip has been read; :meth:`runs` reads the zips of
    the chunks it touches, once."""

    chunks: dict[int, tuple[_Chunk, int]]  # extent index -> its chunk, first element in it
    located: dict[_Chunk, int]  # chunk -> file offset of the box's element 0

    def runs(self, lo: int, hi: int):  # type: ignore[override]
        for i, x in enumerate(self.extents):
            if x.first + x.count > lo and x.first < hi and x.offset < 0:
                self.extents[i] = _locate(self, i, x)
        return super().runs(lo, hi)


def _locate(t: DcpTensor, i: int, x: Extent) -> Extent:
    chunk, within = t.chunks[i]
    if chunk not in t.located:
        t.located[chunk] = _chunk_data_offset(t.key, chunk, t.dtype)
    return Extent(x.path, x.first, x.count, t.located[chunk] + within * t.dtype.itemsize)


def _chunked(
    key: str, dtype: torch.dtype, shape: tuple[int, ...], chunks: list[_Chunk]
) -> StoredTensor:
    """Extents of the full tensor's row-major elements from the chunks' boxes: one per
    chunk when chunks are row blocks (FSDP), one per contiguous run of the box otherwise.
    Offsets stay unknown (-1) until a rank reads the chunk."""
    extents: list[Extent] = []
    owner: dict[int, tuple[_Chunk, int]] = {}
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise CheckpointError(f"{key!r}: a chunk's rank differs from the tensor's {shape}")
        if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)):
            raise CheckpointError(f"{key!r}: chunk {list(c.offsets)} lies outside {list(shape)}")
        if any(s == 0 for s in c.sizes):
            continue
        if not shape:  # a 0-d tensor: one element
            owner[len(extents)] = (c, 0)
            extents.append(Extent(c.path, 0, 1, -1))
            continue
        # The innermost dims the chunk spans fully form one contiguous run with the
        # first partial dim (from the end).
        k = len(shape) - 1
        while k > 0 and c.sizes[k] == shape[k]:
            k -= 1
        run = 1
        for d in range(k, len(shape)):
            run *= c.sizes[d]
        outer = [range(c.sizes[d]) for d in range(k)]
        within = 0
        for idx in _product(outer):
            first = sum((c.offsets[d] + idx[d]) * strides[d] for d in range(k))
            first += c.offsets[k] * strides[k]
            owner[len(extents)] = (c, within)
            extents.append(Extent(c.path, first, run, -1))
            within += run
    order = sorted(range(len(extents)), key=lambda j: extents[j].first)
    t = DcpTensor(key, dtype, shape, [extents[j] for j in order])
    t.chunks = {new: owner[old] for new, old in enumerate(order)}
    t.located = {}
    return t


def _product(ranges: list[range]):
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (head, *rest)


# ------------------------------------------------------------------ a chunk's zip


def _chunk_data_offset(key: str, chunk: _Chunk, dtype: torch.dtype) -> int:
    """File offset of the first element of the chunk's box, from its zip's directory
    and data.pkl; checks the record holds the box's elements, row-major, uncompressed."""
    where = f"{chunk.path} (chunk {list(chunk.offsets)} of {key!r})"
    with Archive(chunk.path, chunk.offset, chunk.length, where=where) as archive:
        ref = archive.load()
        if not isinstance(ref, TensorRef):
            raise CheckpointError(f"{where}: the chunk holds a {type(ref).__name__}, not a tensor")
        if ref.dtype != dtype or ref.size != chunk.sizes:
            raise CheckpointError(
                f"{where}: the chunk holds {ref.dtype} {list(ref.size)}, the metadata says "
                f"{dtype} {list(chunk.sizes)}"
            )
        return archive.locate(ref, "the chunk's data")
