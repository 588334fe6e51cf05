"""copy_out / copy_in: bit-exact against the pure-torch reference over the layout
matrix (element sizes, world sizes, uneven/empty shards, casts), opcheck, and
argument errors that name the op and the argument."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from shardgather import _layout as L
from shardgather import _reference

ops = torch.ops.shardgather

DTYPES = {
    "u8": torch.uint8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "bool": torch.bool,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
    "c128": torch.complex128,
}
CASTS = [
    ("f32", "bf16"),
    ("f32", "f16"),
    ("bf16", "f32"),
    ("f16", "f32"),
    ("f64", "f32"),
    ("f32", "f64"),
    ("bf16", "f16"),
]


def _values(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), (n,), generator=g, dtype=torch.int64
    ).to(dtype)


def _flat_layout(
    world: int, numels: list[int], dtype: torch.dtype, out_dtype: torch.dtype, seed: int
):
    """An FSDP1-like flat source: params back to back, padded to world * P, gathered."""
    g = torch.Generator().manual_seed(seed)
    fulls = [_values(n, dtype, g) for n in numels]
    total = sum(numels)
    p = max(1, math.ceil(total / world))
    flat = torch.zeros(world * p, dtype=dtype)
    if total:
        flat[:total] = torch.cat(fulls)
    shards = flat.view(torch.uint8).view(world, -1).contiguous()
    segs, base = [], 0
    for i, n in enumerate(numels):
        segs.append(L.Segment(base, p, 0, n, i, 0, L.kind_of(dtype), L.kind_of(out_dtype)))
        base += n
    return fulls, shards, L.segment_table(segs), flat


def _brute_force(flat: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """The obvious answer: torch.cat(shards)[:numel] split per param."""
    return list(torch.split(flat[: sum(numels)], numels))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_copy_out_matches_reference_and_brute_force(world: int, dtype: str) -> None:
    dt = DTYPES[dtype]
    numels = [7, 0, 1, 33, 4, 2]  # uneven, a zero-numel param, a 1-element (0-d) param
    fulls, shards, table, flat = _flat_layout(world, numels, dt, dt, seed=world)
    got = [torch.empty(n, dtype=dt) for n in numels]
    ref = [torch.empty(n, dtype=dt) for n in numels]
    ops.copy_out(shards, 0, table, got)
    _reference.copy_out(shards, 0, table, ref)
    for a, b, c in zip(got, ref, _brute_force(flat, numels)):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("cast", CASTS, ids=[f"{a}->{b}" for a, b in CASTS])
def test_copy_out_cast_is_tensor_to(world: int, cast: tuple[str, str]) -> None:
    src, dst = DTYPES[cast[0]], DTYPES[cast[1]]
    numels = [50, 3, 129]
    fulls, shards, table, _ = _flat_layout(world, numels, src, dst, seed=7)
    got = [torch.empty(n, dtype=dst) for n in numels]
    ops.copy_out(shards, 0, table, got)
    for a, f in zip(got, fulls):
        assert torch.equal(a, f.to(dst))  # round-to-nearest-even exactly like Tensor.to


def test_cast_special_values() -> None:
    v = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, 65504.0, 1e6, 3.3895e38])
    shards = v.view(torch.uint8).view(1, -1)
    for dst in (torch.bfloat16, torch.float16):
        out = torch.empty(v.numel(), dtype=dst)
        seg = L.Segment(0, v.numel(), 0, v.numel(), 0, 0, L.F32, L.kind_of(dst))
        ops.copy_out(shards, 0, L.segment_table([seg]), [out])
        assert torch.equal(out.view(torch.int16), v.to(dst).view(torch.int16))
    nan = torch.tensor([float("nan")]).view(torch.uint8).view(1, -1)
    out = torch.empty(1, dtype=torch.bfloat16)
    ops.copy_out(nan, 0, L.segment_table([L.Segment(0, 1, 0, 1, 0, 0, L.F32, L.BF16)]), [out])
    assert out.isnan().all()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", ["u8", "bf16", "f32", "f64"])
def test_copy_in_is_the_inverse_per_rank(world: int, dtype: str) -> None:
    dt = DTYPES[dtype]
    numels = [7, 0, 1, 33, 4, 2]
    fulls, shards, table, _ = _flat_layout(world, numels, dt, dt, seed=3)
    for rank in range(world):
        row = torch.zeros(1, shards.shape[1], dtype=torch.uint8)
        ref = row.clone()
        ops.copy_in(fulls, table, row, rank)
        _reference.copy_in(fulls, table, ref, rank)
        assert torch.equal(row, ref)
        # Every rank's row, the last (padded) one included: its elements are written and
        # its padding, zero in both, is never touched.
        assert torch.equal(row[0], shards[rank]), rank
        # The same row pre-filled: the padding keeps its bytes.
        pad_start = max(0, sum(numels) - rank * (shards.shape[1] // dt.itemsize)) * dt.itemsize
        filled = torch.full_like(row, 0xAB)
        ops.copy_in(fulls, table, filled, rank)
        assert torch.equal(filled[0, :pad_start], shards[rank, :pad_start]), rank
        assert bool((filled[0, pad_start:] == 0xAB).all()), rank
    whole = torch.zeros_like(shards)
    ops.copy_in(fulls, table, whole, 0)
    back = [torch.empty_like(f) for f in fulls]
    ops.copy_out(whole, 0, table, back)
    assert all(torch.equal(a, b) for a, b in zip(back, fulls))


def test_one_rank_row_copies_only_its_elements() -> None:
    fulls, shards, table, _ = _flat_layout(3, [10, 11], torch.float32, torch.float32, seed=1)
    out = [torch.full((n,), -1.0) for n in (10, 11)]
    ops.copy_out(shards[1:2].contiguous(), 1, table, out)
    ref = [torch.full((n,), -1.0) for n in (10, 11)]
    _reference.copy_out(shards[1:2].contiguous(), 1, table, ref)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert (out[0] == -1).sum() == 7 + 0  # P = 7: rank 1 holds flat [7, 14)


def test_fsdp2_mixed_dtype_uint8_packing() -> None:
    """Two params of different dtypes packed side by side in one uint8 row (FSDP2 style)."""
    world, g = 3, torch.Generator().manual_seed(0)
    a = torch.randn(7, 4, generator=g)  # fp32, dim0 7 -> 3 rows/rank, P = 12
    b = torch.randn(2, 3, generator=g).to(torch.bfloat16)  # dim0 2 < world: empty shard
    pa, pb = 12, 3
    rows = []
    for r in range(world):
        ra = torch.zeros(pa)
        sa = a[3 * r : 3 * r + 3].reshape(-1)
        ra[: sa.numel()] = sa
        rb = torch.zeros(pb, dtype=torch.bfloat16)
        sb = b[r : r + 1].reshape(-1)
        rb[: sb.numel()] = sb
        rows.append(
            torch.cat(
                [ra.view(torch.uint8), rb.view(torch.uint8), torch.zeros(10, dtype=torch.uint8)]
            )
        )
    shards = torch.stack(rows)
    table = L.segment_table(
        [
            L.Segment(0, pa, 0, 28, 0, 0, L.F32, L.F32),
            L.Segment(0, pb, 48, 6, 1, 0, L.BF16, L.F32),
        ]
    )
    out = [torch.empty(7, 4), torch.empty(2, 3)]
    ops.copy_out(shards, 0, table, out)
    assert torch.equal(out[0], a) and torch.equal(out[1], b.float())


def test_column_chunks_reassemble() -> None:
    """A source gathered in column chunks (split_columns) gives the same tensors."""
    world, numels = 3, [10, 17, 5]
    fulls, shards, table, flat = _flat_layout(world, numels, torch.float32, torch.float32, 2)
    p = shards.shape[1] // 4
    out = [torch.empty(n) for n in numels]
    segs = [L.Segment(*row.tolist()) for row in table]
    for lo in range(0, p, 4):
        hi = min(p, lo + 4)
        chunk = shards.view(world, p, 4)[:, lo:hi].reshape(world, -1).contiguous()
        parts = [s for seg in segs for s in L.split_columns(seg, world, lo, hi, 0)]
        ops.copy_out(chunk, 0, L.segment_table(parts), out)
    assert all(torch.equal(a, b) for a, b in zip(out, fulls))


def test_layout_twin_matches_the_compiled_rule() -> None:
    """The Python twin of layout.h (row_of/col_of) against where the compiled kernel
    actually reads each element: every shard element holds its own (row, col), so the
    output names the position the kernel took it from."""
    rnd = random.Random(0)
    for _ in range(200):
        world, numel, base = rnd.randint(1, 6), rnd.randint(0, 50), rnd.randint(0, 20)
        p = max(1, math.ceil((base + numel) / world)) + rnd.randint(0, 3)
        where = torch.arange(world * p, dtype=torch.float64).view(world, p)
        where = where // p * 1000 + where % p  # value = row * 1000 + col
        rows = where.view(torch.uint8).view(world, -1).contiguous()
        seg = L.Segment(base, p, 0, numel, 0, 0, L.kind_of(torch.float64), L.F64)
        out = [torch.full((numel,), -1.0, dtype=torch.float64)]
        ops.copy_out(rows, 0, L.segment_table([seg]), out)
        want = [L.row_of(base, p, e) * 1000 + L.col_of(base, p, e) for e in range(numel)]
        assert out[0].tolist() == want, (world, numel, base, p)


def _block_layout(
    shape: tuple[int, int],
    grid: tuple[int, int],
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    seed: int,
    pad: int = 0,
):
    """A tensor-parallel layout: the full ``[R, C]`` tensor cut into ``grid`` boxes
    (torch.chunk sizes, trailing boxes smaller or empty); the ranks hold them in
    column-major order (rank-major rows are not the full tensor's order), each box
    row-major in its padded row, ``pad`` spare elements after each of its rows (a
    shard-side stride). One strided segment per rank."""
    g = torch.Generator().manual_seed(seed)
    full = _values(shape[0] * shape[1], dtype, g).view(shape)
    rows_of = [t.shape[0] for t in torch.chunk(torch.empty(shape[0]), grid[0])] if shape[0] else []
    cols_of = [t.shape[0] for t in torch.chunk(torch.empty(shape[1]), grid[1])] if shape[1] else []
    rows_of += [0] * (grid[0] - len(rows_of))
    cols_of += [0] * (grid[1] - len(cols_of))
    boxes = []
    for b in range(grid[1]):  # column-major rank order
        for a in range(grid[0]):
            r0, c0 = sum(rows_of[:a]), sum(cols_of[:b])
            boxes.append((r0, c0, rows_of[a], cols_of[b]))
    p = max(1, max(nr * (nc + pad) for _, _, nr, nc in boxes))
    world = len(boxes)
    flat = torch.zeros(world * p, dtype=dtype)
    segs = []
    for r, (r0, c0, nr, nc) in enumerate(boxes):
        if nr and nc:
            box = torch.zeros(nr, nc + pad, dtype=dtype)
            box[:, :nc] = full[r0 : r0 + nr, c0 : c0 + nc]
            flat[r * p : r * p + box.numel()] = box.reshape(-1)
        seg = L.Segment(
            r * p,
            p,
            0,
            nr * nc,
            0,
            (r0 * shape[1] + c0) * out_dtype.itemsize,
            L.kind_of(dtype),
            L.kind_of(out_dtype),
            run=nc,
            shard_stride=nc + pad,
            full_stride=shape[1],
        )
        segs.append(seg)
    shards = flat.view(torch.uint8).view(world, -1).contiguous()
    return full, shards, segs


BLOCK_CASES = {
    # id: (shape, grid, pad)
    "rowwise-tp2": ((6, 8), (1, 2), 0),
    "2d-dp2-tp2": ((7, 10), (2, 2), 0),
    "uneven-empty-boxes": ((5, 3), (3, 4), 0),
    "padded-shard-rows": ((6, 9), (2, 3), 2),
    "one-column": ((9, 1), (3, 1), 1),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
@pytest.mark.parametrize("cast", [("f32", "f32"), ("f32", "bf16"), ("i16", "i16")], ids=str)
def test_strided_blocks_copy_out_and_back(case: str, cast: tuple[str, str]) -> None:
    shape, grid, pad = BLOCK_CASES[case]
    src, dst = DTYPES[cast[0]], DTYPES[cast[1]]
    full, shards, segs = _block_layout(shape, grid, src, dst, seed=4, pad=pad)
    table = L.segment_table(segs)
    got, ref = torch.full(shape, -7, dtype=dst), torch.full(shape, -7, dtype=dst)
    ops.copy_out(shards, 0, table, [got])
    _reference.copy_out(shards, 0, table, [ref])
    assert torch.equal(got, full.to(dst)) and torch.equal(ref, got)
    # Rank by rank, copy_in rebuilds each rank's padded row from the full tensor (the
    # shard-side padding between box rows is never written).
    if src == dst:
        for r in range(shards.shape[0]):
            row = torch.zeros(1, shards.shape[1], dtype=torch.uint8)
            ops.copy_in([full], table, row, r)
            assert torch.equal(row[0], shards[r]), r
            back = torch.zeros_like(row)
            _reference.copy_in([full], table, back, r)
            assert torch.equal(back, row), r


def test_strided_column_chunks_reassemble() -> None:
    """A 2-D layout gathered in column chunks of the rows: split_columns cuts a block's
    runs (partial first/last runs) and still delivers every element once."""
    full, shards, segs = _block_layout((7, 10), (2, 2), torch.float32, torch.float32, 1, pad=1)
    world, p = shards.shape[0], shards.shape[1] // 4
    for width in (1, 3, 4, 7):
        out = torch.full((7, 10), -1.0)
        for lo in range(0, p, width):
            hi = min(p, lo + width)
            chunk = shards.view(world, p, 4)[:, lo:hi].reshape(world, -1).contiguous()
            parts = [piece for seg in segs for piece in L.split_columns(seg, world, lo, hi, 0)]
            ops.copy_out(chunk, 0, L.segment_table(parts), [out])
        assert torch.equal(out, full), width


def test_strided_layout_twin_matches_the_compiled_rule() -> None:
    """The twin's block rule (flat position, full element) against where the compiled
    kernel reads and writes: every shard element holds its own (row, col)."""
    rnd = random.Random(1)
    for _ in range(300):
        run, count = rnd.randint(1, 6), rnd.randint(1, 5)
        ss, fs = run + rnd.randint(0, 4), run + rnd.randint(0, 5)
        base = rnd.randint(0, 15)
        extent = base + (count - 1) * ss + run
        world = rnd.randint(1, 4)
        p = max(1, -(-extent // world)) + rnd.randint(0, 2)
        where = torch.arange(world * p, dtype=torch.float64).view(world, p)
        where = where // p * 1000 + where % p
        rows = where.view(torch.uint8).view(world, -1).contiguous()
        seg = L.Segment(base, p, 0, run * count, 0, 8, L.F64, L.F64, run, ss, fs)
        size = 1 + (count - 1) * fs + run + 1
        out = torch.full((size,), -1.0, dtype=torch.float64)
        first = rnd.randint(0, world - 1)
        nrows = rnd.randint(1, world - first)
        ops.copy_out(rows[first : first + nrows].contiguous(), first, L.segment_table([seg]), [out])
        want = torch.full((size,), -1.0, dtype=torch.float64)
        b = seg.block
        for s in range(seg.numel):
            flat = b.flat(s)
            if first <= flat // p < first + nrows:
                want[1 + b.full_elem(s)] = flat // p * 1000 + flat % p
        assert torch.equal(out, want), (seg, world, first, nrows)


@pytest.mark.parametrize("op", ["copy_out", "copy_in"])
def test_opcheck(op: str) -> None:
    fulls, shards, table, _ = _flat_layout(3, [5, 8], torch.float32, torch.float32, seed=0)
    if op == "copy_out":
        args = (shards, 0, table, [torch.empty(5), torch.empty(8)])
    else:
        args = (fulls, table, torch.zeros_like(shards), 0)
    torch.library.opcheck(getattr(ops, op).default, args)


def _good():
    fulls, shards, table, _ = _flat_layout(2, [5, 8], torch.float32, torch.float32, seed=0)
    return shards, table, [torch.empty(5), torch.empty(8)]


BAD_CALLS = {
    "table-dtype": (lambda s, t, f: (s, 0, t.int(), f), "'segments' must have dtype Long"),
    "table-cols": (lambda s, t, f: (s, 0, t[:, :5].contiguous(), f), "11 columns"),
    "shards-dtype": (lambda s, t, f: (s.float(), 0, t, f), "'shards' must have dtype Byte"),
    "shards-noncontig": (lambda s, t, f: (s.t(), 0, t, f), "'shards' must be contiguous"),
    "full-noncontig": (
        lambda s, t, f: (s, 0, t, [f[0], torch.empty(8, 2)[:, 0]]),
        "'fulls\\[1\\]' must be contiguous",
    ),
    "full-too-small": (lambda s, t, f: (s, 0, t, [f[0], torch.empty(7)]), "out of range of fulls"),
    "full-index": (lambda s, t, f: (s, 0, t, [f[0]]), "index 1 out of range"),
    "row-overflow": (lambda s, t, f: (s[:, :8].contiguous(), 0, t, f), "do not fit a row"),
    "bad-kind": (lambda s, t, f: (s, 0, _set(t, L.SHARD_KIND, 42), f), "unknown element kind"),
    "raw-to-float": (lambda s, t, f: (s, 0, _set(t, L.SHARD_KIND, L.RAW4), f), "cannot cast"),
    "negative-numel": (lambda s, t, f: (s, 0, _set(t, L.NUMEL, -1), f), "negative numel"),
    "zero-P": (lambda s, t, f: (s, 0, _set(t, L.ROW_NUMEL, 0), f), "must be > 0"),
    "zero-run": (lambda s, t, f: (s, 0, _set(t, L.RUN, 0), f), "run .0. must be > 0"),
    "run-not-dividing": (lambda s, t, f: (s, 0, _set(t, L.RUN, 3), f), "divide numel"),
    "overlapping-runs": (
        lambda s, t, f: (s, 0, _set(_set(t, L.RUN, 1), L.SHARD_STRIDE, 0), f),
        "must be >= run",
    ),
    "strided-out-of-range": (
        lambda s, t, f: (s, 0, _set(_set(t, L.RUN, 1), L.FULL_STRIDE, 2), f),
        "out of range of fulls",
    ),
}


def _set(t: torch.Tensor, col: int, v: int) -> torch.Tensor:
    t = t.clone()
    t[:, col] = v
    return t


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_naming_op_and_argument(case: str) -> None:
    make, msg = BAD_CALLS[case]
    shards, table, fulls = _good()
    with pytest.raises(RuntimeError, match=f"shardgather::copy_out: .*{msg}"):
        ops.copy_out(*make(shards, table, fulls))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dst", ["device", "pinned"])
@pytest.mark.parametrize(
    "cast",
    [("f32", "f32"), ("f32", "bf16"), ("bf16", "f32"), ("u8", "u8")],
    ids=lambda c: f"{c[0]}->{c[1]}",
)
def test_cuda_copy_out_matches_cpu(dst: str, cast: tuple[str, str]) -> None:
    src_dt, dst_dt = DTYPES[cast[0]], DTYPES[cast[1]]
    numels = [7, 0, 1, 3300, 4, 100003]
    fulls, shards, table, _ = _flat_layout(3, numels, src_dt, dst_dt, seed=5)
    want = [torch.empty(n, dtype=dst_dt) for n in numels]
    ops.copy_out(shards, 0, table, want)
    if dst == "device":
        got = [torch.empty(n, dtype=dst_dt, device="cuda") for n in numels]
    else:
        got = [torch.empty(n, dtype=dst_dt, pin_memory=True) for n in numels]
    ops.copy_out(shards.cuda(), 0, table, got)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    # copy_in back on the device: the inverse.
    if src_dt == dst_dt:
        back = torch.zeros_like(shards).cuda()
        ops.copy_in(got, table, back, 0)
        out2 = [torch.empty(n, dtype=dst_dt) for n in numels]
        ops.copy_out(back.cpu(), 0, table, out2)
        assert all(torch.equal(a, b) for a, b in zip(out2, want))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(BLOCK_CASES))
@pytest.mark.parametrize("dst", ["device", "pinned"])
def test_cuda_strided_blocks_match_cpu(case: str, dst: str) -> None:
    shape, grid, pad = BLOCK_CASES[case]
    full, shards, segs = _block_layout(shape, grid, torch.float32, torch.bfloat16, 9, pad=pad)
    table = L.segment_table(segs)
    want = torch.zeros(shape, dtype=torch.bfloat16)
    ops.copy_out(shards, 0, table, [want])
    got = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    if dst == "pinned":
        got = torch.zeros(shape, dtype=torch.bfloat16).pin_memory()
    ops.copy_out(shards.cuda(), 0, table, [got])
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    f32 = [full.cuda()]
    table32 = L.segment_table(
        [dataclasses.replace(x, full_byte=x.full_byte * 2, full_kind=L.F32) for x in segs]
    )
    back = torch.zeros_like(shards).cuda()
    ops.copy_in(f32, table32, back, 0)
    torch.cuda.synchronize()
    assert torch.equal(back.cpu(), shards)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rejects_pageable_cpu_destination() -> None:
    shards, table, fulls = _good()
    with pytest.raises(RuntimeError, match="pinned CPU"):
        ops.copy_out(shards.cuda(), 0, table, fulls)


# ------------------------------------------------------------------ diff_update


def _diff_case(src_dt: torch.dtype, ref_dt: torch.dtype, n: int, seed: int):  # type: ignore[no-untyped-def]
    """A reference as last sent, and the source after a step that changed some values
    (special values included: a changed sign of zero, NaN, infinities)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n, generator=g).to(src_dt)
    ref = src.to(ref_dt)
    moved = torch.rand(n, generator=g) < 0.2
    src = torch.where(moved, src + torch.randn(n, generator=g).to(src_dt) * 1e-2, src)
    if n > 8:
        src[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")]).to(src_dt)
        ref[:4] = torch.tensor([0.0, 0.0, float("inf"), 1.0]).to(ref_dt)
    return src, ref


@pytest.mark.parametrize("src_dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ref_dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dt", [torch.int32, torch.int64])
@pytest.mark.parametrize("cap", ["all", "some", "none"])
def test_diff_update_matches_reference(src_dt, ref_dt, index_dt, cap) -> None:  # type: ignore[no-untyped-def]
    src, ref = _diff_case(src_dt, ref_dt, 5003, seed=1)
    n = {"all": 5003, "some": 17, "none": 0}[cap]
    got = [ref.clone(), torch.full((n,), -1, dtype=index_dt), torch.zeros(n, dtype=ref_dt)]
    want = [ref.clone(), torch.full((n,), -1, dtype=index_dt), torch.zeros(n, dtype=ref_dt)]
    k = _diff(src, *got, 7)
    k_ref = torch.zeros(1, dtype=torch.int64)
    _reference.diff_update(src, *want, k_ref, 7)
    assert k == int(k_ref[0]) > 17
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bitwise (NaN too)
    # ref now holds src as Tensor.to casts it, bit for bit.
    assert torch.equal(got[0].view(torch.uint8), src.to(ref_dt).view(torch.uint8))
    assert _diff(src, got[0], got[1], got[2], 0) == 0  # nothing changed since


@pytest.mark.parametrize("ref_dt", [torch.bfloat16, torch.float16, torch.float32])
def test_diff_update_across_cast_blocks(ref_dt) -> None:  # type: ignore[no-untyped-def]
    """The CPU kernel casts 2**17 elements at a time into a reused scratch and compares
    a word at a time: changes on both sides of a block boundary, in a last partial word,
    and a room that runs out in the middle block stay exactly the reference's."""
    block = 1 << 17
    n = 3 * block + 5  # a tail shorter than a word
    src = torch.randn(n, generator=torch.Generator().manual_seed(3))
    ref = src.to(ref_dt).clone()  # (not src itself when the dtypes match)
    where = torch.tensor([0, 1, block - 1, block, block + 1, 2 * block - 1, 2 * block, n - 1])
    src[where] += 1.0

    def fresh(cap: int) -> list[torch.Tensor]:
        return [
            ref.clone(),
            torch.full((cap,), -1, dtype=torch.int32),
            torch.zeros(cap, dtype=ref_dt),
        ]

    for cap in (n, 5):  # all recorded; room for the first five only
        got, want = fresh(cap), fresh(cap)
        k = _diff(src, *got, 11)
        k_ref = torch.zeros(1, dtype=torch.int64)
        _reference.diff_update(src, *want, k_ref, 11)
        assert k == int(k_ref[0]) == len(where)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(got[1][:5], where[:5].to(torch.int32) + 11)


def _diff(src, ref, positions, values, base) -> int:  # type: ignore[no-untyped-def]
    count = torch.zeros(1, dtype=torch.int64)
    ops.diff_update(src, ref, positions, values, count, base)
    return int(count[0])


def test_diff_update_opcheck() -> None:
    src, ref = _diff_case(torch.float32, torch.bfloat16, 64, seed=2)
    pos, val = torch.empty(64, dtype=torch.int32), torch.empty(64, dtype=torch.bfloat16)
    count = torch.zeros(1, dtype=torch.int64)
    torch.library.opcheck(ops.diff_update.default, (src, ref, pos, val, count, 0))


DIFF_BAD = {
    "count": (lambda s, r, p, v: (s, r, p, v, 0, "int"), "count must be one int64"),
    "2-d": (lambda s, r, p, v: (s.view(4, 4), r.view(4, 4), p, v, 0), "must be 1-D"),
    "lengths": (lambda s, r, p, v: (s[:8], r, p, v, 0), "src has 8 elements, ref 16"),
    "capacities": (lambda s, r, p, v: (s, r, p[:3], v, 0), "positions hold 3"),
    "index-dtype": (lambda s, r, p, v: (s, r, p.float(), v, 0), "int32 or int64"),
    "values-dtype": (lambda s, r, p, v: (s, r, p, v.float(), 0), "values must have ref's dtype"),
    "int32-overflow": (lambda s, r, p, v: (s, r, p, v, 2**31 - 4), "need int64"),
    "ref-dtype": (lambda s, r, p, v: (s, r.double(), p, v.double(), 0), "ref must be float32"),
}


@pytest.mark.parametrize("case", list(DIFF_BAD))
def test_diff_update_bad_arguments(case: str) -> None:
    make, msg = DIFF_BAD[case]
    args = (
        torch.randn(16),
        torch.zeros(16, dtype=torch.bfloat16),
        torch.empty(16, dtype=torch.int32),
    )
    call = make(*args, torch.empty(16, dtype=torch.bfloat16))
    count = torch.zeros(1, dtype=torch.int32 if call[-1] == "int" else torch.int64)
    with pytest.raises(RuntimeError, match=f"diff_update: .*{msg}"):
        ops.diff_update(*call[:4], count, call[4])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ref_dt", [torch.float32, torch.bfloat16])
def test_cuda_diff_update_matches_cpu(ref_dt: torch.dtype) -> None:
    src, ref = _diff_case(torch.float32, ref_dt, 100003, seed=3)
    n = 4000
    cpu = [ref.clone(), torch.full((n,), -1, dtype=torch.int64), torch.zeros(n, dtype=ref_dt)]
    gpu = [t.cuda() for t in cpu]
    assert _diff(src, *cpu, 5) == _diff(src.cuda(), *gpu, 5)
    assert all(
        torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(gpu, cpu)
    )
