"""Command line: file-level jobs on checkpoints.

python -m shardgather inspect FILE
python -m shardgather clean-keys IN OUT
python -m shardgather consolidate SRC OUT.safetensors [--dtype bf16] [--prefix model.]
python -m shardgather consolidate SRC OUT_DIR --max-shard-size 5GB

SRC: a torch.distributed.checkpoint directory, or a DeepSpeed ZeRO-1/2/3 checkpoint
(global_stepN/, or the directory whose 'latest' names it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence

import torch

from ._fqn import FLAT_PARAM_COMPONENTS, clean_fqn, has_wrapper_components
from .errors import CheckpointError, ShardGatherError
from .io.consolidate import copy_tensors
from .io.file_set import lay_out, write_alone
from .io.hf_layout import INDEX_SUFFIX, open_sources, safetensors_files
from .io.publish import publish_file
from .io.safetensors_format import (
    ALIASES_KEY,
    encode_header,
    pread_into,
    pwrite_from,
    read_header,
)
from .io.stored import StoredTensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COPY_CHUNK = 64 * 2**20


def _is_safetensors(path: str) -> bool:
    if path.endswith(".safetensors"):
        return True
    try:
        read_header(path)
        return True
    except CheckpointError:
        return False


def _torch_state_dict(path: str) -> dict[str, torch.Tensor]:
    from .io.sources import read_torch_file

    return read_torch_file(path, clean=False)


def cmd_inspect(path: str) -> int:
    rows: list[tuple[str, str, tuple[int, ...], int]] = []
    aliases: dict[str, str] = {}
    files: list[str] = []
    from .io.dcp_format import is_dcp_directory
    from .io.deepspeed_format import is_deepspeed_checkpoint

    dcp_files: set[str] = set()
    if is_dcp_directory(path) or is_deepspeed_checkpoint(path):
        # What consolidate reads, read the same way (DeepSpeed's too: `inspect ds_ckpt/`
        # failed where `consolidate ds_ckpt/` worked).
        stored, tied, _ = _consolidation_sources(path)
        for k, t in stored.items():
            rows.append((k, str(t.dtype).replace("torch.", ""), t.shape, t.nbytes))
            dcp_files.update(t.paths)
        aliases.update(tied)
    elif os.path.isdir(path) or path.endswith(INDEX_SUFFIX):
        files, weight_map = safetensors_files(path)
        open_sources(files, weight_map)  # the files agree with each other and the index
    elif _is_safetensors(path):
        files = [path]
    meta: dict[str, str] = {}
    for f in files:
        header = read_header(f)
        aliases.update(header.aliases)
        for k, t in header.tensors.items():
            rows.append((k, str(t.dtype).replace("torch.", ""), t.shape, t.end - t.begin))
        meta.update({k: v for k, v in header.metadata.items() if k != ALIASES_KEY})
    if not files and not dcp_files:
        for k, v in _torch_state_dict(path).items():
            rows.append(
                (
                    k,
                    str(v.dtype).replace("torch.", ""),
                    tuple(v.shape),
                    v.numel() * v.element_size(),
                )
            )
        meta = {}
    width = max([len(r[0]) for r in rows] + [10])
    for k, dt, shape, n in rows:
        print(f"{k:{width}}  {dt:9}  {list(shape)}  {n} B")
    for a, k in aliases.items():
        print(f"{a:{width}}  (alias of {k})")
    total = sum(r[3] for r in rows)
    n_files = max(len(files), len(dcp_files))
    in_files = f" in {n_files} files" if n_files > 1 else ""
    print(f"{len(rows)} tensors, {len(aliases)} aliases, {total / 2**20:.1f} MiB{in_files}")
    if meta:
        print(f"metadata: {json.dumps(meta)}")
    wrapped = [r[0] for r in rows if has_wrapper_components(r[0])]
    if wrapped:
        print(
            f"WARNING: {len(wrapped)} keys carry wrapper prefixes or flat parameters "
            f"(e.g. {wrapped[0]!r}): this checkpoint will not load into the plain model. "
            "Repair names with `python -m shardgather clean-keys`.",
            file=sys.stderr,
        )
    return 0


def _atomic_target(out: str) -> tuple[int, str]:
    directory = os.path.dirname(os.path.abspath(out)) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=directory)
    mask = os.umask(0o022)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)  # as open() would create it, not mkstemp's 0600
    return fd, tmp


def _finish(fd: int, tmp: str, out: str) -> None:
    os.fsync(fd)
    os.close(fd)
    publish_file(tmp, out)


def _cleanup(fd: int, tmp: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    if os.path.exists(tmp):
        os.unlink(tmp)


def _renamed(keys: Sequence[str]) -> dict[str, str]:
    flat = [k for k in keys if any(p in FLAT_PARAM_COMPONENTS for p in k.split("."))]
    if flat:
        raise ShardGatherError(
            f"{flat[0]!r} is an FSDP1 flat parameter: its tensor concatenates many parameters, "
            "so renaming cannot repair it. Re-export from the sharded model with "
            "shardgather.save_full_state_dict."
        )
    new = {k: clean_fqn(k) for k in keys}
    seen: dict[str, str] = {}
    for old, n in new.items():
        if n in seen:
            raise ShardGatherError(f"{old!r} and {seen[n]!r} both clean to {n!r}")
        seen[n] = old
    return new


def _stored_once(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to write, each shared one once (tied weights: safetensors refuses tensors
    that share memory), and the aliases (key -> the key stored) that shardgather's
    ``load_file`` restores. Other views of a stored storage are copied."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}  # type: ignore[type-arg]
    stored_storages: set[int] = set()
    for key, t in sd.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        begin = t.storage_offset() * t.element_size()
        ident = (ptr, begin, tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        # Another view of a storage already stored: a copy of its own (safetensors
        # refuses tensors that share memory).
        shares = bool(t.numel()) and ptr in stored_storages
        stored[key] = t.contiguous().clone() if shares else t.contiguous()
        if t.numel():
            seen[ident] = key
            stored_storages.add(ptr)
    return stored, aliases


def cmd_clean_keys(src: str, out: str) -> int:
    """Rename keys; OUT's extension picks its format (.safetensors, else torch.save)."""
    src_st = _is_safetensors(src)
    if src_st and out.endswith(".safetensors"):
        # Only the header changes: stream the data bytes through unchanged.
        header = read_header(src)
        names = _renamed(list(header.tensors))
        layout = {
            names[k]: (t.dtype, t.shape, t.begin - header.data_start, t.end - header.data_start)
            for k, t in header.tensors.items()
        }
        meta = dict(header.metadata)
        if header.aliases:
            meta[ALIASES_KEY] = json.dumps(
                {clean_fqn(a): names[k] for a, k in header.aliases.items()}
            )
        head = encode_header(layout, meta)
        fd, tmp = _atomic_target(out)
        try:
            os.pwrite(fd, head, 0)
            end = max((t.end for t in header.tensors.values()), default=header.data_start)
            buf = torch.empty(_COPY_CHUNK, dtype=torch.uint8)
            src_fd = os.open(src, os.O_RDONLY)
            try:
                for off in range(header.data_start, end, _COPY_CHUNK):  # data bytes unchanged
                    n = min(_COPY_CHUNK, end - off)
                    pread_into(src_fd, buf[:n], off)
                    pwrite_from(fd, buf[:n], len(head) + off - header.data_start)
            finally:
                os.close(src_fd)
            _finish(fd, tmp, out)
        except BaseException:
            _cleanup(fd, tmp)
            raise
    else:
        others: dict = {}  # type: ignore[type-arg]
        if src_st:
            from .api import load_file

            sd = load_file(src)
        else:
            from .io.sources import read_torch_entries

            sd, others = read_torch_entries(src, clean=False)
        names = _renamed(list(sd))
        clean = {names[k]: v for k, v in sd.items()}
        if others and out.endswith(".safetensors"):
            raise ShardGatherError(
                f"{src} holds entries that are not tensors ({sorted(map(str, others))[:5]}), "
                "which a safetensors file cannot hold: nothing was written. Write a torch "
                "file instead (an OUT not ending in .safetensors keeps them), or drop them."
            )
        fd, tmp = _atomic_target(out)
        os.close(fd)
        try:
            if out.endswith(".safetensors"):
                from safetensors.torch import save_file

                stored, aliases = _stored_once(clean)
                meta = {ALIASES_KEY: json.dumps(aliases)} if aliases else None
                save_file(stored, tmp, metadata=meta)
            else:
                torch.save({**clean, **{k: v for k, v in others.items() if k not in clean}}, tmp)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    print(f"wrote {out}")
    return 0


def _consolidation_sources(
    src: str,
) -> tuple[dict[str, StoredTensor], dict[str, str], str]:
    """The tensors of a DCP directory or a DeepSpeed ZeRO checkpoint (its tied aliases,
    what it is), read through the restricted readers (nothing unpickled with pickle's
    full powers)."""
    from .io.dcp_format import dcp_sources, is_dcp_directory
    from .io.deepspeed_format import is_deepspeed_checkpoint, read_zero_checkpoint

    if is_dcp_directory(src):
        return dcp_sources(src), {}, "torch.distributed.checkpoint"
    if is_deepspeed_checkpoint(src):
        ck = read_zero_checkpoint(src)
        return ck.tensors, ck.aliases, f"deepspeed ZeRO-{ck.stage} (world {ck.world})"
    raise CheckpointError(
        f"{src}: neither a torch.distributed.checkpoint directory (no .metadata) nor a "
        "DeepSpeed checkpoint (no *_model_states.pt here or in the directory named by "
        "'latest')"
    )


def cmd_consolidate(
    src: str,
    out: str,
    dtype: str | None,
    prefix: str | None,
    progress: bool,
    max_shard_size: str | None = None,
    workers: int | None = None,
) -> int:
    """A DCP directory or a DeepSpeed ZeRO checkpoint -> one safetensors file, or the
    sharded HF layout. ``workers`` reader threads fill 64 MiB pieces (cast if asked)
    while this thread writes the previous ones to their final offsets with O_DIRECT
    (see :mod:`shardgather.io.consolidate`); memory: ``workers + 1`` pieces."""
    from .io.hf_layout import output_layout

    shard_bytes = output_layout(out, max_shard_size)
    tensors, tied, what = _consolidation_sources(src)
    cast = DTYPES[dtype] if dtype else None

    def renamed(key: str) -> str | None:
        """The output name of a source key (None: outside ``prefix``)."""
        if prefix and not key.startswith(prefix):
            return None
        return clean_fqn(key[len(prefix) :] if prefix else key)

    items = []
    seen: set[str] = set()
    for key, t in tensors.items():
        name = renamed(key)
        if name is None:
            continue
        if name in seen:
            raise CheckpointError(f"{src}: two keys clean to {name!r}; pass --prefix")
        seen.add(name)
        out_dtype = cast if cast is not None and t.dtype.is_floating_point else t.dtype
        items.append((name, t, out_dtype))
    if not items:
        raise CheckpointError(f"{src}: no tensors{' under ' + prefix if prefix else ''}")
    aliases = {}
    for a, k in tied.items():
        na, nk = renamed(a), renamed(k)
        if na is not None and nk is not None:
            aliases[na] = nk
    fs = lay_out(
        [(n, odt, t.shape) for n, t, odt in items],
        out,
        metadata={"source": what},
        max_shard_size=shard_bytes,
        aliases=aliases,
    )
    total = sum(fs.sizes)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        # the bytes the bar counts: tensor data (headers are written before it starts)
        data = sum(t.numel * odt.itemsize for _, t, odt in items)
        bar = tqdm(total=data, unit="B", unit_scale=True, desc="consolidate")
    write_alone(fs, lambda fds, where: copy_tensors(items, fds, where, workers, bar))
    if bar is not None:
        bar.close()
    if fs.directory:
        dest = f"{len(fs.names)} file{'s' if len(fs.names) > 1 else ''} in directory {fs.final}/"
    else:
        dest = f"the file {fs.final}"
    tied_note = f" (+{len(aliases)} tied)" if aliases else ""
    print(f"wrote {len(items)} tensors{tied_note}, {total / 2**20:.1f} MiB: {dest}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shardgather",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from . import __version__

    ap.add_argument("--version", action="version", version=f"shardgather {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="keys, dtypes, shapes, bytes; warns on wrapped names")
    p.add_argument("file")
    p = sub.add_parser("clean-keys", help="rewrite a checkpoint with clean (unwrapped) names")
    p.add_argument("src")
    p.add_argument("out")
    p = sub.add_parser(
        "consolidate",
        help="a torch.distributed.checkpoint directory or a DeepSpeed ZeRO checkpoint -> "
        "one safetensors file or an HF directory",
    )
    p.add_argument("src", help="DCP directory, or DeepSpeed global_stepN/ (or its parent)")
    p.add_argument("out", help="OUT.safetensors, or OUT/ (or an existing directory): the HF layout")
    p.add_argument(
        "--max-shard-size",
        default=None,
        help="write the Hugging Face sharded layout into OUT, files of at most this "
        "size (e.g. 5GB, 4GiB; as transformers' save_pretrained)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--prefix", default=None, help="only keys under this prefix (stripped)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="DeepSpeed only: write a shardgather checkpoint directory OUT/ (weights, the "
        "optimizer's moments by parameter name, its groups and step) for "
        "shardgather.load_checkpoint: an exact resume under FSDP",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads reading at once, 64 MiB of memory each (default 2, 1 on one core: "
        "a second read in flight keeps a single disk busy; more for NVMe arrays, "
        "network filesystems or casts)",
    )
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return cmd_inspect(args.file)
        if args.cmd == "clean-keys":
            return cmd_clean_keys(args.src, args.out)
        if args.checkpoint:
            from .checkpoint import checkpoint_from_zero

            done = checkpoint_from_zero(
                args.src,
                args.out,
                dtype=DTYPES[args.dtype] if args.dtype else None,
                workers=args.workers,
                progress=not args.no_progress,
            )
            print(f"wrote the checkpoint directory {done}/")
            return 0
        return cmd_consolidate(
            args.src,
            args.out,
            args.dtype,
            args.prefix,
            not args.no_progress,
            args.max_shard_size,
            args.workers,
        )
    except ShardGatherError as exc:
        print(f"shardgather: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the output directory does not exist
        print(f"shardgather: error: {exc}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
