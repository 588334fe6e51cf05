"""What a load reads: a path (safetensors file, Hugging Face directory or index, DCP
directory, DeepSpeed ZeRO checkpoint, torch file) or a dict, as tensors by key — validated before any byte moves.

Files become :class:`StoredTensor` descriptions (where each element's bytes are), so a
rank can read exactly its own elements; torch files and dicts are full tensors (a
torch file memory-mapped: only the pages a rank touches are read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .._fqn import clean_fqn
from ..errors import CheckpointError
from .dcp_format import dcp_sources, is_dcp_directory
from .deepspeed_format import is_deepspeed_checkpoint, read_zero_checkpoint
from .hf_layout import KeyMap, is_safetensors_source, map_keys, open_sources, safetensors_files
from .safetensors_format import read_header
from .stored import StoredTensor, one_extent


def stored_tensors(path: str) -> dict[str, StoredTensor]:
    """Every key (and tied alias) of a safetensors file, directory or index -> where
    its bytes are."""
    return {
        key: one_extent(key, f, info.dtype, tuple(info.shape), info.begin)
        for key, (f, info) in open_sources(*safetensors_files(path)).items()
    }


def looks_like_safetensors(path: str) -> bool:
    if path.endswith(".safetensors"):
        return True
    if path.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return False
    try:
        read_header(path)
        return True
    except CheckpointError:
        return False


def read_torch_file(path: str, clean: bool = True) -> dict[str, torch.Tensor]:
    """A torch.save'd state dict, memory-mapped, read with ``weights_only=True``. A nested
    ``state_dict``/``model``/``module`` dict is found; ``clean`` strips wrapper prefixes
    from the keys."""
    tensors, _ = read_torch_entries(path, clean)
    return tensors


def read_torch_entries(path: str, clean: bool = True) -> tuple[dict[str, torch.Tensor], dict]:  # type: ignore[type-arg]
    """:func:`read_torch_file`'s tensors, and the other entries beside them (e.g. an
    ``epoch``), for a tool that must not drop them silently."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    # torch.save writes a zip archive ("PK\x03\x04"); the legacy format is a pickle
    # (protocol 2+: "\x80"). Anything else is not a torch file at all: say so, not what
    # torch's mmap loader says of it.
    if not magic.startswith((b"PK\x03\x04", b"\x80")):
        raise CheckpointError(
            f"{path}: not a checkpoint: neither safetensors nor a torch.save file (it starts "
            f"with {magic!r}); shardgather reads safetensors files and directories, torch "
            "files, torch.distributed.checkpoint and DeepSpeed directories"
        )
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a safetensors or torch checkpoint ({exc})") from exc
    for nested in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(nested), dict):
            obj = obj[nested]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    tensors = {
        (clean_fqn(k) if clean else k): v for k, v in obj.items() if isinstance(v, torch.Tensor)
    }
    return tensors, {k: v for k, v in obj.items() if not isinstance(v, torch.Tensor)}


def open_path(
    path: str, key_map: KeyMap | None
) -> tuple[dict[str, StoredTensor] | dict[str, torch.Tensor], dict[str, str]]:
    """The tensors at ``path`` by model key (key map applied), and the renames made
    (model key -> the source's own name). Headers, indexes and DCP metadata are all
    validated here."""
    if is_dcp_directory(path):
        found: Mapping[str, object] = dcp_sources(path)
    elif is_deepspeed_checkpoint(path):
        found = read_zero_checkpoint(path).sources()
    elif is_safetensors_source(path) or looks_like_safetensors(path):
        found = stored_tensors(path)
    else:
        found = read_torch_file(path)
    names = map_keys(found, key_map)
    renamed = {k: v for k, v in names.items() if k != v}
    return {model_key: found[src_key] for model_key, src_key in names.items()}, renamed  # type: ignore[return-value]


def renamed_dict(sd: Mapping[str, torch.Tensor], key_map: KeyMap | None) -> dict[str, torch.Tensor]:
    if key_map is None:
        return dict(sd)
    return {model_key: sd[src_key] for model_key, src_key in map_keys(sd, key_map).items()}
