"""Command line: file-level jobs on checkpoints.

python -m shardgather inspect FILE
python -m shardgather clean-keys IN OUT
python -m shardgather consolidate DCP_DIR OUT.safetensors [--dtype bf16] [--prefix model.]
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
from .io.hf_layout import INDEX_SUFFIX, open_sources, safetensors_files
from .io.publish import publish_file
from .io.safetensors_format import (
    ALIASES_KEY,
    encode_header,
    pread_into,
    pwrite_from,
    read_header,
)

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
    from .checkpoint import _torch_file

    return _torch_file(path, clean=False)


def cmd_inspect(path: str) -> int:
    rows: list[tuple[str, str, tuple[int, ...], int]] = []
    aliases: dict[str, str] = {}
    files: list[str] = []
    if os.path.isdir(path) or path.endswith(INDEX_SUFFIX):
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
    if not files:
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
    in_files = f" in {len(files)} files" if len(files) > 1 else ""
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
    return tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=directory)


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
        if src_st:
            from .checkpoint import load_file

            sd = load_file(src)
        else:
            sd = _torch_state_dict(src)
        names = _renamed(list(sd))
        clean = {names[k]: v for k, v in sd.items()}
        fd, tmp = _atomic_target(out)
        os.close(fd)
        try:
            if out.endswith(".safetensors"):
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in clean.items()}, tmp)
            else:
                torch.save(clean, tmp)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    print(f"wrote {out}")
    return 0


def cmd_consolidate(
    dcp_dir: str, out: str, dtype: str | None, prefix: str | None, progress: bool
) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(dcp_dir)
    try:
        md = reader.read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"{dcp_dir}: not a torch.distributed.checkpoint directory ({exc})"
        ) from exc
    cast = DTYPES[dtype] if dtype else None
    items = []
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        if prefix and not key.startswith(prefix):
            continue
        name = clean_fqn(key[len(prefix) :] if prefix else key)
        src_dtype = meta.properties.dtype
        out_dtype = cast if cast is not None and src_dtype.is_floating_point else src_dtype
        items.append((key, name, tuple(meta.size), src_dtype, out_dtype))
    if not items:
        raise CheckpointError(f"{dcp_dir}: no tensors{' under ' + prefix if prefix else ''}")
    layout, pos = {}, 0
    for _, name, shape, _, odt in items:
        n = odt.itemsize
        for d in shape:
            n *= d
        layout[name] = (odt, shape, pos, pos + n)
        pos += n
    head = encode_header(layout, {"format": "pt", "source": "torch.distributed.checkpoint"})
    fd, tmp = _atomic_target(out)
    try:
        os.ftruncate(fd, len(head) + pos)
        os.pwrite(fd, head, 0)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=pos, unit="B", unit_scale=True, desc="consolidate")
        for key, name, shape, sdt, odt in items:
            # One tensor in memory at a time: DCP reads just its chunks.
            t = torch.empty(shape, dtype=sdt)
            try:
                dcp.load({key: t}, storage_reader=reader, no_dist=True)
            except (Exception, CheckpointException) as exc:  # DCP's, for damaged chunks
                raise CheckpointError(
                    f"{dcp_dir}: cannot read {key!r} ({type(exc).__name__}: {exc})"
                ) from None
            t = t.to(odt).contiguous()
            pwrite_from(fd, t.reshape(-1).view(torch.uint8), len(head) + layout[name][2])
            if bar is not None:
                bar.update(layout[name][3] - layout[name][2])
            del t
        if bar is not None:
            bar.close()
        _finish(fd, tmp, out)
    except BaseException:
        _cleanup(fd, tmp)
        raise
    print(f"wrote {out}: {len(items)} tensors, {pos / 2**20:.1f} MiB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shardgather",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="keys, dtypes, shapes, bytes; warns on wrapped names")
    p.add_argument("file")
    p = sub.add_parser("clean-keys", help="rewrite a checkpoint with clean (unwrapped) names")
    p.add_argument("src")
    p.add_argument("out")
    p = sub.add_parser("consolidate", help="torch.distributed.checkpoint dir -> one safetensors")
    p.add_argument("dcp_dir")
    p.add_argument("out")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--prefix", default=None, help="only keys under this prefix (stripped)")
    p.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return cmd_inspect(args.file)
        if args.cmd == "clean-keys":
            return cmd_clean_keys(args.src, args.out)
        return cmd_consolidate(
            args.dcp_dir, args.out, args.dtype, args.prefix, not args.no_progress
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
