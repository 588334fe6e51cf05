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

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from .stored import Extent, StoredTensor

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


def _torch_dtype(module: str, name: str) -> torch.dtype | None:
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        dtype = _torch_dtype(module, name)
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


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file, as a seekable read-only stream."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass
class _StorageRef:
    key: str
    dtype: torch.dtype | None  # None: an untyped storage (the dtype comes with the tensor)


@dataclass
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage, storage_offset, size, stride, *_rest):
    return _TensorRef(storage, storage_offset, tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_rest):
    return _TensorRef(storage, storage_offset, tuple(size), tuple(stride), dtype)


# torch.save names typed storages by these legacy classes (asking the classes for their
# dtype warns that TypedStorage is deprecated).
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


class _ChunkUnpickler(pickle.Unpickler):
    """``data.pkl`` of a one-tensor torch.save: yields a _TensorRef, builds nothing."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        dtype = _torch_dtype(module, name)
        if dtype is not None:
            return dtype
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return dict
        if (module == "torch" and name.endswith("Storage")) or (
            module == "torch.storage" and name == "UntypedStorage"
        ):
            return (module, name)
        raise CheckpointError(f"{self.where}: refusing to unpickle {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.where}: unexpected storage record {pid!r}")
        module, name = pid[1]
        dtype = None
        if module == "torch":
            dtype = _LEGACY_STORAGES.get(name)
            if dtype is None:
                raise CheckpointError(f"{self.where}: unknown storage type torch.{name}")
        return _StorageRef(str(pid[2]), dtype)


def _chunk_data_offset(key: str, chunk: _Chunk, dtype: torch.dtype) -> int:
    """File offset of the first element of the chunk's box, from its zip's directory
    and data.pkl; checks the record holds the box's elements, row-major, uncompressed."""
    where = f"{chunk.path} (chunk {list(chunk.offsets)} of {key!r})"
    fd = os.open(chunk.path, os.O_RDONLY)
    try:
        window = _Window(fd, chunk.offset, chunk.length)
        try:
            # Unbuffered: zipfile reads the end record, the directory and data.pkl only
            # (a buffer would pull in tensor bytes that may be another rank's).
            z = zipfile.ZipFile(window)
            infos = {i.filename: i for i in z.infolist()}
            pkl = next((n for n in infos if n.endswith("/data.pkl")), None)
            if pkl is None:
                raise CheckpointError(f"{where}: no data.pkl in the chunk's torch.save archive")
            prefix = pkl[: -len("data.pkl")]
            order = z.read(prefix + "byteorder").decode() if prefix + "byteorder" in infos else ""
            ref = _ChunkUnpickler(io.BytesIO(z.read(pkl)), where).load()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{where}: not a readable torch.save chunk ({exc})") from None
        if order not in ("", "little"):
            raise CheckpointError(f"{where}: {order}-endian data is not supported")
        if not isinstance(ref, _TensorRef):
            raise CheckpointError(f"{where}: the chunk holds a {type(ref).__name__}, not a tensor")
        if ref.dtype != dtype or ref.size != chunk.sizes:
            raise CheckpointError(
                f"{where}: the chunk holds {ref.dtype} {list(ref.size)}, the metadata says "
                f"{dtype} {list(chunk.sizes)}"
            )
        contiguous, n = [], 1
        for d in reversed(ref.size):
            contiguous.append(n)
            n *= d
        if any(s > 1 and st != c for s, st, c in zip(ref.size, ref.stride, contiguous[::-1])):
            raise CheckpointError(f"{where}: a non-contiguous chunk (strides {ref.stride})")
        info = infos.get(prefix + "data/" + ref.storage.key)
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{where}: the chunk's data record is missing or compressed")
        if (ref.storage_offset + n) * dtype.itemsize > info.file_size:
            raise CheckpointError(f"{where}: the chunk's data record is truncated")
        local = os.pread(fd, 30, chunk.offset + info.header_offset)
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{where}: damaged zip record")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data = chunk.offset + info.header_offset + 30 + name_len + extra_len
        if data + (ref.storage_offset + n) * dtype.itemsize > chunk.offset + chunk.length:
            raise CheckpointError(f"{where}: the chunk's data runs past its stored length")
        return data + ref.storage_offset * dtype.itemsize
    finally:
        os.close(fd)
