"""torch.save archives read without pickle's full powers.

A ``torch.save`` file is a zip (records stored uncompressed): ``<name>/data.pkl``
describes the object — containers, numbers, and tensors as references to storage
records ``<name>/data/<key>`` — and each record holds a storage's raw bytes. Here
``data.pkl`` goes through a restricted unpickler that builds containers and plain
values only: a tensor becomes a :class:`TensorRef` (dtype, shape, where its storage
is), never a tensor, and a class outside the allowlist the caller passes is a
:class:`CheckpointError` — nothing from the file can name a callable that runs. A
reference is then located: the byte offset of its first element in the file, checked
against its record's size, so a reader preads exactly the elements it needs.

Used for DCP chunks (one tensor each, at an offset of a ``.distcp`` file) and for
DeepSpeed's ``*_states.pt`` files (whole state dicts).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError

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


def torch_dtype(module: str, name: str) -> torch.dtype | None:
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    return None


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: torch.dtype | None  # None: an untyped storage (the dtype comes with the tensor)


@dataclass(frozen=True)
class TensorRef:
    """A tensor of an archive, not built: what it is and which storage record holds it."""

    storage: StorageRef
    storage_offset: int  # in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.size:
            n *= d
        return n

    @property
    def contiguous(self) -> bool:
        want = 1
        for d, s in zip(reversed(self.size), reversed(self.stride)):
            if d > 1 and s != want:
                return False
            want *= d
        return True


def _rebuild_v2(storage, storage_offset, size, stride, *_rest):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_rest):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), dtype)


def _rebuild_from_type_v2(func, new_type, args, state):
    # A tensor subclass or a tensor with Python attributes (DeepSpeed's ``ds_id``):
    # the plain tensor is what ``func(*args)`` describes; the type and the attribute
    # state are dropped, not applied.
    return func(*args)


class _TensorType:
    """Stands in for ``torch.Tensor`` as ``_rebuild_from_type_v2``'s type argument."""


class Opaque:
    """Stands in for an allowlisted class of the file's own library: instances keep the
    state pickle hands them as attributes; nothing of the real class runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


class _OrderedDict(dict):
    """``collections.OrderedDict``: a dict that takes attributes (a module's state dict
    carries ``_metadata``, which pickle sets after building it)."""


_BUILTINS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch", "Size"): tuple,
    ("collections", "OrderedDict"): _OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: Any, where: str, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(f)
        self.where, self.allowed = where, allowed

    def find_class(self, module: str, name: str) -> Any:
        dtype = torch_dtype(module, name)
        if dtype is not None:
            return dtype
        found = _BUILTINS.get((module, name), self.allowed.get((module, name)))
        if found is not None:
            return found
        if (module == "torch" and name.endswith("Storage")) or (
            module == "torch.storage" and name == "UntypedStorage"
        ):
            return (module, name)
        raise CheckpointError(
            f"{self.where}: refusing to unpickle {module}.{name} (not one of the classes this "
            "kind of file is made of): rebuilding it could run code from the file."
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.where}: unexpected storage record {pid!r}")
        module, name = pid[1]
        dtype = None
        if module == "torch":
            dtype = _LEGACY_STORAGES.get(name)
            if dtype is None:
                raise CheckpointError(f"{self.where}: unknown storage type torch.{name}")
        return StorageRef(str(pid[2]), dtype)


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


class Archive:
    """One torch.save archive: bytes ``[start, start + length)`` of ``path`` (the whole
    file by default). :meth:`load` returns its object with :class:`TensorRef` leaves;
    :meth:`locate` where a reference's elements are in the file."""

    def __init__(
        self,
        path: str,
        start: int = 0,
        length: int | None = None,
        allowed: Mapping[tuple[str, str], Callable[..., Any] | type] | None = None,
        where: str | None = None,
    ) -> None:
        self.path, self.start, self.allowed = path, start, dict(allowed or {})
        self.where = where or path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.where}: cannot be opened ({exc})") from None
        try:
            self.length = os.fstat(self.fd).st_size - start if length is None else length
            # Unbuffered: zipfile reads the end record, the directory and data.pkl only
            # (a buffer would pull in tensor bytes nobody asked for).
            self.zip = zipfile.ZipFile(_Window(self.fd, start, self.length))
            self.infos = {i.filename: i for i in self.zip.infolist()}
        except Exception as exc:
            os.close(self.fd)
            raise CheckpointError(
                f"{self.where}: not a readable torch.save archive ({exc}); the file may be "
                "truncated or damaged"
            ) from None
        pkl = next((n for n in self.infos if n.endswith("data.pkl")), None)
        if pkl is None:
            self.close()
            raise CheckpointError(f"{self.where}: no data.pkl in the torch.save archive")
        self.prefix = pkl[: -len("data.pkl")]
        self._pkl = pkl

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def load(self) -> Any:
        try:
            order_name = self.prefix + "byteorder"
            order = self.zip.read(order_name).decode() if order_name in self.infos else ""
            obj = _Unpickler(io.BytesIO(self.zip.read(self._pkl)), self.where, self.allowed).load()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"{self.where}: not a readable torch.save archive ({type(exc).__name__}: {exc})"
            ) from None
        if order not in ("", "little"):
            raise CheckpointError(f"{self.where}: {order}-endian data is not supported")
        return obj

    def locate(self, ref: TensorRef, what: str = "a tensor") -> int:
        """File offset of ``ref``'s first element; checks it is contiguous and its
        storage record, uncompressed, holds all its elements."""
        where = f"{self.where} ({what})"
        if not ref.contiguous:
            raise CheckpointError(f"{where}: a non-contiguous tensor (strides {ref.stride})")
        if ref.storage.dtype is not None and ref.storage.dtype != ref.dtype:
            raise CheckpointError(f"{where}: a {ref.dtype} view of a {ref.storage.dtype} storage")
        info = self.infos.get(self.prefix + "data/" + ref.storage.key)
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{where}: its data record is missing or compressed")
        size = ref.dtype.itemsize
        if ref.storage_offset < 0 or (ref.storage_offset + ref.numel) * size > info.file_size:
            raise CheckpointError(
                f"{where}: {list(ref.size)} elements from {ref.storage_offset} do not fit its "
                f"data record of {info.file_size} bytes"
            )
        local = os.pread(self.fd, 30, self.start + info.header_offset)
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{where}: damaged zip record")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data = self.start + info.header_offset + 30 + name_len + extra_len
        if data + info.file_size > self.start + self.length:
            raise CheckpointError(f"{where}: its data record runs past the end of the file")
        return data + ref.storage_offset * size
