"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) as tensors in files, read without
unpickling anything with pickle's full powers.

A checkpoint is a directory ``global_stepN/`` (its parent names it in ``latest``)::

    mp_rank_00_model_states.pt                   ZeRO-1/2: the module's state dict
                                                 (compute dtype), shapes, ties, buffers
    zero_pp_rank_R_mp_rank_00_model_states.pt    ZeRO-3: the same per rank (parameters
                                                 empty; frozen ones as fragments)
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                 each rank's fp32 master partition(s)
                                                 and its optimizer state

Where each parameter's fp32 elements are (DeepSpeed's ``zero_to_fp32`` protocol):

- ZeRO-1/2: per param group, the ranks' partitions (``single_partition_of_fp32_groups``,
  equal lengths) concatenated are one flat vector holding the group's parameters back
  to back (in ``param_shapes`` order, plus ``param_alignment_paddings``);
- ZeRO-3: each parameter is split in ``ceil(numel / world)`` slices, rank R holding
  slice R (the last one padded); a rank's ``fp32_flat_groups`` hold its slices of every
  parameter back to back.

Every element is thus a run of a rank's file, and each parameter a
:class:`~shardgather.io.stored.StoredTensor` whose extents point into the archives'
storage records (:mod:`.torch_archive`): a reader preads exactly the bytes it needs,
and no file is loaded whole. The optimizer's element-wise states (Adam's ``exp_avg``,
``exp_avg_sq``) have the fp32 partitions' layout, so they map by parameter name the
same way.

The ``*.pt`` files are read through the restricted unpickler: containers, numbers,
tensors as references, and DeepSpeed's three small classes (``LossScaler``,
``ZeroStageEnum``, ``fragment_address``) as inert stand-ins; anything else is a
:class:`CheckpointError`. Checked before anything is read: every rank's file is there
and agrees on stage and world size, shapes add up to the stored partitions exactly,
and each reference lies inside its file.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from .stored import Extent, StoredTensor
from .torch_archive import Archive, Opaque, TensorRef

LATEST = "latest"
_OPTIM = re.compile(r"^(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL12 = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def _zero_stage(value: Any) -> int:
    return int(value)


# The classes DeepSpeed's checkpoint files are made of, besides torch's (0.9 - 0.19).
ALLOWED: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): Opaque,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): Opaque,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): Opaque,
}


@dataclass
class ZeroCheckpoint:
    """A ZeRO checkpoint's tensors by the module's names, validated, nothing read."""

    directory: str
    stage: int
    world: int
    tensors: dict[str, StoredTensor]  # the module's order; fp32 masters for trainable ones
    aliases: dict[str, str]  # tied name -> the name it shares storage with
    trainable: list[str]  # in optimizer order (param groups, then param_shapes order)
    groups: list[list[str]]  # the trainable names of each optimizer param group
    param_groups: list[dict[str, Any]]  # rank 0's hyperparameters (no "params")
    states: dict[str, dict[str, StoredTensor]] = field(default_factory=dict)  # state -> name ->
    step: torch.Tensor | int | float | None = None  # the optimizer's step count, if one

    def sources(self) -> dict[str, StoredTensor]:
        """Every name, tied aliases included (sharing their tensor's description)."""
        out = dict(self.tensors)
        out.update({a: self.tensors[p] for a, p in self.aliases.items() if p in self.tensors})
        return out


def checkpoint_directory(path: str | os.PathLike) -> str | None:
    """The ``global_stepN`` directory ``path`` is, or names in ``latest``; None if ``path``
    is no DeepSpeed checkpoint."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        return None
    if _model_files(path):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read(4096).strip()
        if not tag or os.path.basename(tag) != tag or tag in (".", ".."):
            raise CheckpointError(f"{latest}: names {tag!r}, not a directory beside it")
        found = os.path.join(path, tag)
        if not os.path.isdir(found) or not _model_files(found):
            raise CheckpointError(
                f"{latest} names {tag!r}, but {found} holds no DeepSpeed model states: the "
                "checkpoint was moved or not saved completely"
            )
        return found
    return None


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    try:
        return checkpoint_directory(path) is not None
    except CheckpointError:
        return True  # it says it is one; reading it will say what is wrong


def _model_files(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith("_model_states.pt")]


class _Files:
    """The checkpoint's archives, opened once; closed when the description is built
    (locations are plain numbers)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.open: dict[str, Archive] = {}

    def load(self, name: str) -> tuple[Archive, Any]:
        path = os.path.join(self.directory, name)
        archive = Archive(path, allowed=ALLOWED, where=path)
        self.open[name] = archive
        obj = archive.load()
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
        return archive, obj

    def close(self) -> None:
        for a in self.open.values():
            a.close()


def read_zero_checkpoint(path: str | os.PathLike) -> ZeroCheckpoint:
    """Describe the ZeRO checkpoint at ``path`` (a ``global_stepN`` directory, or its
    parent with ``latest``). Raises :class:`CheckpointError` naming what is wrong."""
    directory = checkpoint_directory(path)
    if directory is None:
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint (no *_model_states.pt)")
    files = _Files(directory)
    try:
        return _read(files)
    finally:
        files.close()


def _read(files: _Files) -> ZeroCheckpoint:
    directory = files.directory
    names = sorted(os.listdir(directory))
    if any(n.startswith("layer_") and n.endswith("-model_states.pt") for n in names):
        raise CheckpointError(
            f"{directory}: a pipeline-parallel DeepSpeed checkpoint (layer_*-model_states.pt); "
            "convert it with DeepSpeed's universal checkpoint tools (ds_to_universal.py) first"
        )
    optim: dict[int, str] = {}
    for n in names:
        m = _OPTIM.match(n)
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise CheckpointError(
                f"{directory}: {n} belongs to model-parallel rank {int(m.group(2))}: tensor- or "
                "pipeline-parallel DeepSpeed checkpoints (Megatron-DeepSpeed) are not supported; "
                "convert with ds_to_universal.py first"
            )
        if int(m.group(1)) in optim:
            raise CheckpointError(
                f"{directory}: two optimizer files for rank {m.group(1)} ({optim[int(m.group(1))]}"
                f", {n})"
            )
        optim[int(m.group(1))] = n
    if not optim:
        raise CheckpointError(
            f"{directory}: no *_optim_states.pt files: the fp32 weights of a ZeRO checkpoint "
            "live there (saved without optimizer state? then the model states file holds the "
            "compute-dtype weights only)"
        )
    world = len(optim)
    if sorted(optim) != list(range(world)):
        raise CheckpointError(
            f"{directory}: optimizer files for ranks {sorted(optim)}: rank(s) "
            f"{sorted(set(range(max(optim) + 1)) - set(optim))} missing — a rank did not save"
        )
    parts: list[tuple[Archive, dict[str, Any]]] = []
    for r in range(world):
        archive, obj = files.load(optim[r])
        osd = obj.get("optimizer_state_dict")
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise CheckpointError(f"{archive.where}: not a ZeRO optimizer state file")
        parts.append((archive, osd))
    stage = parts[0][1]["zero_stage"]
    counts = parts[0][1].get("partition_count")
    if isinstance(counts, list):
        if len(set(counts)) > 1:
            raise CheckpointError(
                f"{directory}: param groups partitioned over {sorted(set(counts))} ranks "
                "(expert-parallel MoE groups): not supported yet"
            )
        counts = counts[0] if counts else world
    for _, osd in parts:
        if osd.get("zero_stage") != stage:
            raise CheckpointError(f"{directory}: ranks disagree on the ZeRO stage")
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{directory}: unknown ZeRO stage {stage!r}")
    if counts != world:
        raise CheckpointError(
            f"{directory}: the checkpoint was partitioned over {counts} ranks but holds "
            f"{world} optimizer files — overwritten by a run of another size, or a rank did "
            "not save"
        )
    if stage == 3:
        model_names = []
        for r in range(world):
            n = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            if n not in names:
                raise CheckpointError(f"{directory}: {n} is missing — a rank did not save")
            model_names.append(n)
    else:
        model_names = ["mp_rank_00_model_states.pt"]
        if model_names[0] not in names:
            raise CheckpointError(f"{directory}: {model_names[0]} is missing")
    models = [files.load(n) for n in model_names]
    return _describe(directory, stage, world, models, parts)


def _shapes(obj: Any, where: str, what: str) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes``: a list (per param group) of name -> shape, or one dict."""
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list) or not all(isinstance(g, dict) for g in obj):
        raise CheckpointError(f"{where}: {what} is not a list of name -> shape")
    out = []
    for g in obj:
        group = {}
        for k, v in g.items():
            if not isinstance(k, str) or not isinstance(v, tuple):
                raise CheckpointError(f"{where}: {what} holds {k!r}: {v!r}")
            if not all(isinstance(d, int) and d >= 0 for d in v):
                raise CheckpointError(f"{where}: {what}: {k!r} has shape {v!r}")
            group[k] = tuple(v)
        out.append(group)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _ref(obj: Any, where: str, what: str) -> TensorRef:
    if not isinstance(obj, TensorRef):
        raise CheckpointError(f"{where}: {what} is a {type(obj).__name__}, not a tensor")
    return obj


class _Flat:
    """One rank's tensors laid end to end (its flat groups), located in its file: maps
    a range of the concatenation to file runs."""

    def __init__(
        self,
        archive: Archive,
        refs: list[TensorRef],
        what: str,
        lengths: list[int] | None = None,
    ) -> None:
        """``lengths``: use only that many leading elements of each tensor."""
        extents, pos = [], 0
        dtypes = {r.dtype for r in refs}
        if len(dtypes) > 1:
            raise CheckpointError(
                f"{archive.where}: {what} mixes dtypes {sorted(map(str, dtypes))}"
            )
        self.dtype = refs[0].dtype if refs else torch.float32
        self.lengths = []
        for i, ref in enumerate(refs):
            if len(ref.size) != 1:
                raise CheckpointError(f"{archive.where}: {what}[{i}] is not flat: {list(ref.size)}")
            n = ref.numel if lengths is None else lengths[i]
            self.lengths.append(n)
            if n:
                at = archive.locate(ref, f"{what}[{i}]")
                extents.append(Extent(archive.path, pos, n, at))
            pos += n
        self.numel = pos
        self.stored = StoredTensor(f"{archive.where}: {what}", self.dtype, (pos,), extents)

    def extents(self, lo: int, hi: int, first: int) -> list[Extent]:
        """Elements ``lo:hi`` of the concatenation as extents of a tensor whose element
        ``first`` is element ``lo`` here."""
        return [Extent(p, first + (f - lo), n, off) for p, off, f, n in self.stored.runs(lo, hi)]


def _describe(
    directory: str,
    stage: int,
    world: int,
    models: list[tuple[Archive, dict[str, Any]]],
    parts: list[tuple[Archive, dict[str, Any]]],
) -> ZeroCheckpoint:
    archive0, m0 = models[0]
    where0 = archive0.where
    module = m0.get("module")
    if not isinstance(module, dict) or "buffer_names" not in m0 or "param_shapes" not in m0:
        raise CheckpointError(f"{where0}: not a DeepSpeed model states file")
    if (m0.get("mp_world_size") or 1) != 1:
        raise CheckpointError(
            f"{where0}: saved with model parallelism {m0['mp_world_size']}: not supported"
        )
    groups = _shapes(m0["param_shapes"], where0, "param_shapes")
    shapes = {k: s for g in groups for k, s in g.items()}
    buffers = set(m0.get("buffer_names") or [])
    shared = m0.get("shared_params") or {}
    if isinstance(shared, list):  # older versions: [(alias, target), ...]
        shared = dict(shared)
    aliases = {a: t for a, t in shared.items() if isinstance(a, str) and isinstance(t, str)}
    frozen_shapes = m0.get("frozen_param_shapes")
    frozen_shapes = (
        _shapes(frozen_shapes, where0, "frozen_param_shapes")[0] if frozen_shapes else {}
    )

    tensors: dict[str, StoredTensor] = {}
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats: list[_Flat] = []
    per_rank_lengths = []
    for archive, osd in parts:
        refs = osd.get(key)
        if not isinstance(refs, list):
            raise CheckpointError(f"{archive.where}: no {key} (not a ZeRO-{stage} optimizer file?)")
        flat = _Flat(archive, [_ref(x, archive.where, key) for x in refs], key)
        flats.append(flat)
        per_rank_lengths.append(flat.lengths)
    if stage == 3:
        where = _zero3_layout(directory, shapes, flats, world)
    else:
        where = _zero12_layout(directory, groups, flats, world, parts)

    for name, (runs, shape) in where.items():
        tensors[name] = StoredTensor(name, flats[0].dtype, shape, runs)

    # Frozen parameters and buffers: the model states (ZeRO-3: frozen ones as each
    # rank's fragment; ZeRO-1/2: whole, also when DeepSpeed did not list them, as at
    # ZeRO-1 — every module entry that is not trainable, a buffer or a tie).
    out: dict[str, StoredTensor] = {}
    for name, value in module.items():
        if name in aliases and aliases[name] != name:
            continue
        if name in tensors:
            out[name] = tensors[name]
        elif name in buffers or stage != 3:
            ref = _ref(value, where0, f"module[{name!r}]")
            out[name] = _whole(archive0, ref, name)
        elif name in frozen_shapes:
            out[name] = _zero3_frozen(name, frozen_shapes[name], models, world)
        else:
            raise CheckpointError(
                f"{where0}: {name!r} is neither trainable, frozen, a buffer nor tied: the "
                "model states do not describe it"
            )
    missing = [n for n in shapes if n not in out]
    if missing:
        raise CheckpointError(f"{where0}: trainable {missing[:3]} missing from the module")
    aliases = {a: t for a, t in aliases.items() if a != t}
    dangling = [a for a, t in aliases.items() if t not in out]
    if dangling:
        raise CheckpointError(f"{where0}: {dangling[0]!r} is tied to a name the module lacks")

    ckpt = ZeroCheckpoint(
        directory=directory,
        stage=stage,
        world=world,
        tensors=out,
        aliases=aliases,
        trainable=list(shapes),
        groups=[list(g) for g in groups],
        param_groups=_param_groups(parts[0][1], stage, where0),
    )
    _optimizer_states(ckpt, parts, groups, flats)
    return ckpt


def _whole(archive: Archive, ref: TensorRef, name: str) -> StoredTensor:
    extents = []
    if ref.numel:
        extents.append(Extent(archive.path, 0, ref.numel, archive.locate(ref, repr(name))))
    return StoredTensor(name, ref.dtype, ref.size, extents)


def _zero3_frozen(
    name: str,
    shape: tuple[int, ...],
    models: list[tuple[Archive, dict[str, Any]]],
    world: int,
) -> StoredTensor:
    n = _numel(shape)
    part = math.ceil(n / world) if n else 0
    extents, dtype = [], None
    for r, (archive, m) in enumerate(models):
        frags = m.get("frozen_param_fragments") or {}
        ref = _ref(frags.get(name), archive.where, f"frozen_param_fragments[{name!r}]")
        dtype = dtype or ref.dtype
        if ref.numel != part or ref.dtype != dtype:
            raise CheckpointError(
                f"{archive.where}: frozen {name!r}: a {ref.dtype} fragment of {ref.numel} "
                f"elements, want {part} of {n} ({dtype})"
            )
        lo, hi = r * part, min(n, (r + 1) * part)
        if hi > lo:
            at = archive.locate(ref, f"frozen_param_fragments[{name!r}]")
            extents.append(Extent(archive.path, lo, hi - lo, at))
    assert dtype is not None
    return StoredTensor(name, dtype, shape, extents)


Runs = dict[str, tuple[list[Extent], tuple[int, ...]]]


def _zero3_layout(
    directory: str, shapes: dict[str, tuple[int, ...]], flats: list[_Flat], world: int
) -> Runs:
    out: Runs = {}
    offset = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        part = math.ceil(n / world)
        extents: list[Extent] = []
        for r, flat in enumerate(flats):
            lo, hi = r * part, min(n, (r + 1) * part)
            if hi > lo:
                extents += flat.extents(offset, offset + hi - lo, lo)
        out[name] = (extents, shape)
        offset += part
    for r, flat in enumerate(flats):
        if flat.numel != offset:
            raise CheckpointError(
                f"{directory}: rank {r}'s fp32 partition holds {flat.numel} elements, the "
                f"parameter shapes need {offset}: shapes and partitions do not add up"
            )
    return out


def _zero12_layout(
    directory: str,
    groups: list[dict[str, tuple[int, ...]]],
    flats: list[_Flat],
    world: int,
    parts: list[tuple[Archive, dict[str, Any]]],
) -> Runs:
    for r, flat in enumerate(flats):
        if len(flat.lengths) != len(groups):
            raise CheckpointError(
                f"{directory}: rank {r} holds {len(flat.lengths)} fp32 partitions for "
                f"{len(groups)} param groups"
            )
    paddings = parts[0][1].get("param_alignment_paddings")
    out: Runs = {}
    for g, shapes in enumerate(groups):
        # The group's flat vector: the ranks' partitions end to end (DeepSpeed saves the
        # last one without its padding, so lengths may differ).
        lengths = [flat.lengths[g] for flat in flats]
        begins = [sum(lengths[:r]) for r in range(world)]
        within_rank = [sum(flat.lengths[:g]) for flat in flats]  # group g in rank r's flat
        stored = sum(lengths)
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and (not isinstance(pads, list) or len(pads) != len(shapes)):
            raise CheckpointError(f"{directory}: param_alignment_paddings of group {g} mismatch")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = _numel(shape)
            if offset + n > stored:
                raise CheckpointError(
                    f"{directory}: group {g}'s parameters need more than its {stored} stored "
                    f"elements ({name!r} ends at {offset + n}): shapes and partitions do not "
                    "add up"
                )
            extents: list[Extent] = []
            for r in range(world):
                lo, hi = max(offset, begins[r]), min(offset + n, begins[r] + lengths[r])
                if hi > lo:
                    at = within_rank[r] + lo - begins[r]
                    extents += flats[r].extents(at, at + hi - lo, lo - offset)
            out[name] = (extents, shape)
            offset += n + (int(pads[i]) if pads is not None else 0)
        align = 2 * world  # DeepSpeed pads each group's flat vector to a multiple of this
        if math.ceil(offset / align) != math.ceil(stored / align):
            raise CheckpointError(
                f"{directory}: group {g}'s parameters take {offset} of its {stored} stored "
                "elements: shapes and partitions do not add up"
            )
        _check_fragments(directory, g, shapes, parts)
    return out


def _check_fragments(
    directory: str,
    g: int,
    shapes: dict[str, tuple[int, ...]],
    parts: list[tuple[Archive, dict[str, Any]]],
) -> None:
    """Where DeepSpeed recorded each rank's fragments (``param_slice_mappings``), they
    must be what the shapes say: a second, independent account of the layout."""
    total = {name: 0 for name in shapes}
    for archive, osd in parts:
        maps = osd.get("param_slice_mappings")
        if not isinstance(maps, list) or g >= len(maps) or not isinstance(maps[g], dict):
            return
        for name, frag in maps[g].items():
            numel, start = getattr(frag, "numel", None), getattr(frag, "start", None)
            if name not in total or not isinstance(numel, int) or not isinstance(start, int):
                raise CheckpointError(f"{archive.where}: param_slice_mappings names {name!r}")
            total[name] += numel
    for name, n in total.items():
        if n != _numel(shapes[name]):
            raise CheckpointError(
                f"{directory}: the ranks' fragments of {name!r} hold {n} elements, its shape "
                f"{list(shapes[name])} has {_numel(shapes[name])}"
            )


def _param_groups(osd: dict[str, Any], stage: int, where: str) -> list[dict[str, Any]]:
    inner = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list):
        return []
    return [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]


def _optimizer_states(
    ckpt: ZeroCheckpoint,
    parts: list[tuple[Archive, dict[str, Any]]],
    groups: list[dict[str, tuple[int, ...]]],
    flats: list[_Flat],
) -> None:
    """Element-wise optimizer states laid out like the fp32 partitions (Adam's moments),
    by parameter name; each group's ``step``."""
    per_rank: list[dict[str, list[TensorRef]]] = []
    steps: list[Any] = []
    for r, (archive, osd) in enumerate(parts):
        inner = osd.get("optimizer_state_dict" if ckpt.stage == 3 else "base_optimizer_state")
        state = inner.get("state") if isinstance(inner, dict) else None
        if not isinstance(state, dict) or not state:
            return  # saved before the first step, or without optimizer state
        found: dict[str, list[TensorRef]] = {}
        for i, length in enumerate(flats[r].lengths):
            entry = state.get(i)
            if not isinstance(entry, dict):
                return
            for k, v in entry.items():
                # DeepSpeed saves the last rank's fp32 partition without its padding,
                # but not its optimizer states: they may be longer; the tail is padding.
                if isinstance(v, TensorRef) and len(v.size) == 1 and v.numel >= length > 0:
                    found.setdefault(k, []).append(v)
                elif k == "step" and r == 0:
                    steps.append(_scalar(archive, v))
        per_rank.append({k: v for k, v in found.items() if len(v) == len(flats[r].lengths)})
    names = set(per_rank[0])
    if any(set(p) != names for p in per_rank):
        return
    shapes = {k: s for g in groups for k, s in g.items()}
    for state_name in sorted(names):
        state_flats = [
            _Flat(
                archive,
                per_rank[r][state_name],
                f"optimizer state {state_name!r}",
                lengths=flats[r].lengths,
            )
            for r, (archive, _) in enumerate(parts)
        ]
        if ckpt.stage == 3:
            where = _zero3_layout(ckpt.directory, shapes, state_flats, ckpt.world)
        else:
            where = _zero12_layout(ckpt.directory, groups, state_flats, ckpt.world, parts)
        ckpt.states[state_name] = {
            n: StoredTensor(n, state_flats[0].dtype, shape, runs)
            for n, (runs, shape) in where.items()
        }
    if steps and all(_equal(x, steps[0]) for x in steps):
        ckpt.step = steps[0]


def _scalar(archive: Archive, v: Any) -> Any:
    """A scalar state (``step``): a number, or a 0-d tensor read from its record."""
    if not isinstance(v, TensorRef):
        return v
    if v.numel != 1:
        raise CheckpointError(f"{archive.where}: a step of shape {list(v.size)}")
    raw = os.pread(archive.fd, v.dtype.itemsize, archive.locate(v, "step"))
    return torch.frombuffer(bytearray(raw), dtype=v.dtype).reshape(v.size).clone()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b
