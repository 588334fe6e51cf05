"""Hugging Face's safetensors layouts as load sources: one file, or the sharded
directory ``save_pretrained`` writes (``model-00001-of-00004.safetensors`` ... plus
``model.safetensors.index.json`` with its ``weight_map``), and key maps between a
checkpoint's names and a model's.

Every file's header goes through :func:`read_header` (validated); the index is checked
against the headers — a key stored twice, a file the index names but that is missing, a
name that points outside the directory, a stored key the index does not list, all raise
:class:`CheckpointError` naming the key and the files, before any data is read.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Mapping

from ..errors import CheckpointError
from .safetensors_format import TensorInfo, read_header

INDEX_SUFFIX = ".safetensors.index.json"
KeyMap = Mapping[str, str] | Callable[[str], str | None]


def is_safetensors_source(path: str) -> bool:
    """A directory, an index file or a ``.safetensors`` file (other files: torch's)."""
    return os.path.isdir(path) or path.endswith((INDEX_SUFFIX, ".safetensors"))


def safetensors_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The files a path names and, for a sharded layout, the index's weight map
    (key -> file path). A directory holds one index (then its files), or no index and
    ``*.safetensors`` files (all of them: ``model.safetensors`` alone, typically)."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            raise CheckpointError(
                f"{path}: a torch.distributed.checkpoint (DCP) directory. Convert it once with "
                "`shardgather consolidate DIR model.safetensors`, then load that file."
            )
        indexes = sorted(glob.glob(os.path.join(glob.escape(path), "*" + INDEX_SUFFIX)))
        if len(indexes) > 1:
            raise CheckpointError(
                f"{path}: several index files {[os.path.basename(i) for i in indexes]}; pass "
                "the one to load"
            )
        if indexes:
            return _from_index(indexes[0])
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files and no index in the directory")
        return files, None
    if path.endswith(INDEX_SUFFIX):
        return _from_index(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file or directory")
    return [path], None


def _from_index(index: str) -> tuple[list[str], dict[str, str]]:
    try:
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index}: not a readable JSON index ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: expected {{'weight_map': {{key: file name}}}}")
    directory = os.path.dirname(os.path.abspath(index))
    paths: dict[str, str] = {}
    for key, name in weight_map.items():
        # A plain file name in the index's own directory: nothing else is opened.
        if name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
            raise CheckpointError(
                f"{index}: {key!r} is mapped to {name!r}, not a file name in the index's directory"
            )
        paths[key] = os.path.join(directory, name)
    files = sorted(set(paths.values()))
    for f in files:
        if not os.path.isfile(f):
            listed = next(k for k, v in paths.items() if v == f)
            raise CheckpointError(
                f"{index}: lists {os.path.basename(f)!r} (for {listed!r} and others) but the "
                "file is missing: the checkpoint is incomplete"
            )
    return files, paths


def open_sources(
    files: list[str], weight_map: dict[str, str] | None
) -> dict[str, tuple[str, TensorInfo]]:
    """Every stored key (and tied alias) -> (file, its tensor), across the files."""
    out: dict[str, tuple[str, TensorInfo]] = {}
    aliases: set[str] = set()
    for f in files:
        header = read_header(f)
        aliases.update(a for a in header.aliases if a not in header.tensors)
        for key in header.all_keys():
            if key in out:
                raise CheckpointError(
                    f"{key!r} is stored in both {os.path.basename(out[key][0])!r} and "
                    f"{os.path.basename(f)!r}: which one is meant is ambiguous"
                )
            out[key] = (f, header.resolve(key))
    if weight_map is not None:
        for key, f in weight_map.items():
            if key not in out:
                raise CheckpointError(
                    f"the index maps {key!r} to {os.path.basename(f)!r}, which does not store it"
                )
            if out[key][0] != f:
                raise CheckpointError(
                    f"the index maps {key!r} to {os.path.basename(f)!r}, but it is stored in "
                    f"{os.path.basename(out[key][0])!r}"
                )
        # Tied aliases (our header metadata) live with their tensor; the index, like
        # transformers', lists stored tensors only.
        unlisted = sorted(set(out) - set(weight_map) - aliases)
        if unlisted:
            raise CheckpointError(
                f"stored keys the index does not list: {unlisted[:5]}"
                + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
            )
    return out


def map_keys(keys: Iterable[str], key_map: KeyMap | None, into: str = "model's") -> dict[str, str]:
    """destination key -> source key. ``key_map`` is ``{source_prefix: dest_prefix}``
    (the longest matching prefix is replaced; other keys stay), or a callable from a
    source key to the destination's (None drops the key). Loading, the source is the
    file and the destination the model; saving, the other way round (``into`` names
    the destination in errors)."""
    out: dict[str, str] = {}
    prefixes = None
    if key_map is not None and not callable(key_map):
        if not isinstance(key_map, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in key_map.items()
        ):
            raise CheckpointError(
                "key_map must be a {source_prefix: model_prefix} dict or a callable"
            )
        prefixes = sorted(key_map, key=len, reverse=True)
    for key in keys:
        if key_map is None:
            new: str | None = key
        elif prefixes is not None:
            hit = next((p for p in prefixes if key.startswith(p)), None)
            new = key if hit is None else key_map[hit] + key[len(hit) :]  # type: ignore[index]
        else:
            new = key_map(key)  # type: ignore[operator]
            if new is not None and not isinstance(new, str):
                raise CheckpointError(f"key_map({key!r}) returned {new!r}, not a str or None")
        if new is None:
            continue
        if new in out:
            raise CheckpointError(
                f"key_map sends both {out[new]!r} and {key!r} to the {into} {new!r}"
            )
        out[new] = key
    return out


# ---------------------------------------------------------------------------- writing

# huggingface_hub's units (parse_size_to_int): decimal, as in transformers' "5GB".
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model" + INDEX_SUFFIX


# save_pretrained's default max_shard_size: what a directory path gets when none is given
DEFAULT_SHARD_SIZE = "5GB"


def output_layout(path: str | os.PathLike, max_shard_size: int | str | None) -> int | None:
    """Bytes per file of the Hugging Face layout at ``path``, or None for one file.
    Paths mean what they look like: a trailing ``/`` or an existing directory is the HF
    layout (one ``model.safetensors`` inside when it fits ``DEFAULT_SHARD_SIZE``); a
    ``.safetensors`` name is one file, and asking it to be split is an error (it would
    make a directory named like a file)."""
    p = os.fspath(path)
    directory = p.endswith(("/", os.sep)) or os.path.isdir(p)
    if max_shard_size is None:
        return parse_size(DEFAULT_SHARD_SIZE) if directory else None
    if p.endswith(".safetensors") and not directory:
        stem = p[: -len(".safetensors")] or "model"
        raise CheckpointError(
            f"{p!r} names a file, but max_shard_size= writes a directory of files (the "
            f"Hugging Face layout): pass a directory path such as {stem + '/'!r}, or drop "
            "max_shard_size to write the one file"
        )
    return parse_size(max_shard_size)


def parse_size(size: int | str) -> int:
    """Bytes from ``5_000_000_000``, ``"5GB"`` (10**9, as transformers reads it) or
    ``"4.5GiB"`` (2**30)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise CheckpointError(f"max_shard_size must be bytes (int) or like '5GB', got {size!r}")
    if isinstance(size, str):
        text = size.strip().upper()
        unit = next(
            (u for u in sorted(_SIZE_UNITS, key=len, reverse=True) if text.endswith(u)), None
        )
        try:
            if unit is None:
                raise ValueError
            size = int(float(text[: -len(unit)]) * _SIZE_UNITS[unit])
        except ValueError:
            raise CheckpointError(
                f"max_shard_size {size!r}: expected a number and a unit (KB, MB, GB, TB; KiB, "
                "MiB, GiB, TiB), e.g. '5GB'"
            ) from None
    if size <= 0:
        raise CheckpointError(f"max_shard_size must be > 0 bytes, got {size}")
    return size


def split_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Keys in file order, split at tensor boundaries: a file is closed when the next
    tensor would take it past ``max_shard_size``; a bigger tensor gets a file of its own.
    (huggingface_hub moves such a tensor to the end of the list; keeping it in place keeps
    the files in the plan's order, which is what lets each rank write one contiguous run.)"""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, n in sizes:
        if current and used + n > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(key)
        used += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' names: ``model.safetensors`` alone, else ``model-00001-of-0000N``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_document(weight_map: dict[str, str], total_size: int, total_parameters: int) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` formats it."""
    doc = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": weight_map,
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def is_weights_file(name: str) -> bool:
    """A file of an existing directory that a new export replaces: any safetensors file
    or index (left behind, a loader would glob it up with the new ones)."""
    return name.endswith((".safetensors", INDEX_SUFFIX))


def extra_files(files: Mapping[str, object] | None) -> dict[str, bytes]:
    """The bytes of each pass-through file (``config.json``, tokenizer files...):
    ``bytes`` or ``str`` are the content, a dict or list is written as JSON, an
    ``os.PathLike`` is a file to copy. Names are plain file names of the directory."""
    out: dict[str, bytes] = {}
    for name, value in (files or {}).items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or os.path.basename(name) != name
            or "\\" in name
            or name.startswith(".")
        ):
            raise CheckpointError(f"files: {name!r} is not a plain file name for the directory")
        if is_weights_file(name):
            raise CheckpointError(
                f"files: {name!r} would be taken for a weights file; the export writes those"
            )
        if isinstance(value, bytes):
            out[name] = value
        elif isinstance(value, str):
            out[name] = value.encode()
        elif isinstance(value, (dict, list)):
            out[name] = (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
        elif isinstance(value, os.PathLike):
            try:
                with open(value, "rb") as f:
                    out[name] = f.read()
            except OSError as exc:
                raise CheckpointError(f"files: cannot read {os.fspath(value)!r} ({exc})") from None
        else:
            raise CheckpointError(
                f"files[{name!r}]: expected bytes, str, a JSON dict/list or a path (os.PathLike), "
                f"got {type(value).__name__}"
            )
    return out
