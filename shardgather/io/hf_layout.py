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
    for f in files:
        header = read_header(f)
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
        unlisted = sorted(set(out) - set(weight_map))
        if unlisted:
            raise CheckpointError(
                f"stored keys the index does not list: {unlisted[:5]}"
                + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
            )
    return out


def map_keys(keys: Iterable[str], key_map: KeyMap | None) -> dict[str, str]:
    """model key -> source key. ``key_map`` is ``{source_prefix: model_prefix}`` (the
    longest matching prefix is replaced; other keys stay), or a callable from a source
    key to the model's (None drops the key)."""
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
                f"key_map sends both {out[new]!r} and {key!r} to the model's {new!r}"
            )
        out[new] = key
    return out
