"""Nothing from disk is trusted: damaged or crafted files raise a ShardGatherError
before a byte reaches the model, nothing is unpickled unless asked for, and the CLI
answers bad input with one line and exit status 2.

The fuzz test mutates valid headers and files and holds shardgather's reader to the
reference ``safetensors`` reader: a file is either loaded with exactly the values the
reference reads from it, or rejected with a ShardGatherError that changed nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardgather as sg
from shardgather.__main__ import main
from shardgather.io import json_values

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM, make_optimizer

ALIASES = "shardgather.aliases"
TIED = {"lm_head.weight": "embed.weight"}  # TinyLM's tied weights, as the model has them


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(d=4, n_layers=1)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _parts(path: Path) -> tuple[list[list[Any]], bytes]:
    """A safetensors file as (header as [key, value] pairs, data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return [[k, v] for k, v in header.items()], raw[8 + n :]


def _serialize(pairs: list[list[Any]], data: bytes, prefix_delta: int = 0) -> bytes:
    # By hand, so that a key can appear twice, as a crafted file may have it.
    text = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"
    raw = text.encode()
    return struct.pack("<Q", max(0, len(raw) + prefix_delta)) + raw + data


def _write(path: Path, pairs: list[list[Any]], data: bytes) -> None:
    path.write_bytes(_serialize(pairs, data))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[list[Any]], bytes]:
    path = tmp_path / "good.safetensors"
    sg.save_full_state_dict(_model(), path)
    return (path, *_parts(path))


def _tensor_index(pairs: list[list[Any]], name: str) -> int:
    return next(i for i, (k, _) in enumerate(pairs) if k == name)


def _expect_rejected(path: Path, match: str) -> None:
    model = _model(1)
    before = _snapshot(model)
    with pytest.raises(sg.CheckpointError, match=match):
        sg.load_full_state_dict(model, path)
    assert not diff_state_dicts(model.state_dict(), before)
    with pytest.raises(sg.CheckpointError, match=match):
        sg.load_file(path)


# ---------------------------------------------------------- one regression test per class


def test_negative_data_offsets_are_rejected(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    i = _tensor_index(pairs, "scale")
    pairs[i][1]["data_offsets"] = [-4, 0]
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", r"'scale' has invalid data_offsets \[-4, 0\]")


def test_overlapping_tensors_are_rejected(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    i = _tensor_index(pairs, "norm.bias")
    j = _tensor_index(pairs, "norm.weight")
    # norm.bias claims norm.weight's bytes; the file's real norm.bias bytes are orphaned.
    pairs[i][1]["data_offsets"] = pairs[j][1]["data_offsets"]
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", r"'norm\.(weight|bias)' has data_offsets")


def test_duplicate_key_is_rejected(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    i = _tensor_index(pairs, "norm.bias")
    pairs.append([pairs[i][0], dict(pairs[i][1])])
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", r"key 'norm\.bias' appears twice")


def test_offsets_that_are_not_a_list_are_a_checkpoint_error(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    pairs[_tensor_index(pairs, "scale")][1]["data_offsets"] = 7
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", "invalid data_offsets 7")


@pytest.mark.parametrize(
    ("aliases", "match"),
    [
        ("{not json", "corrupt shardgather.aliases"),
        ('["lm_head.weight"]', "not a JSON object"),
        ('{"lm_head.weight": "nowhere"}', "'nowhere', which is not a stored tensor"),
        ('{"norm.bias": "embed.weight"}', "'norm.bias' as an alias, but it is a stored"),
    ],
    ids=["not_json", "not_an_object", "names_a_missing_key", "shadows_a_stored_key"],
)
def test_bad_alias_map_is_a_checkpoint_error(saved, tmp_path, aliases: str, match: str) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    pairs[_tensor_index(pairs, "__metadata__")][1][ALIASES] = aliases
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", match)


def test_metadata_that_is_not_an_object_is_a_checkpoint_error(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    pairs[_tensor_index(pairs, "__metadata__")][1] = ["format", "pt"]
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", "__metadata__ must map str to str")


def test_negative_shape_through_load_file_is_a_checkpoint_error(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    pairs[_tensor_index(pairs, "norm.bias")][1]["shape"] = [-4]
    _write(tmp_path / "bad.safetensors", pairs, data)
    _expect_rejected(tmp_path / "bad.safetensors", r"'norm\.bias' has an invalid shape \[-4\]")


def test_float8_file_into_a_float_model_is_not_cast_as_raw_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The kernels cast between fp16/bf16/fp32/fp64 only; float8 bytes would be copied raw.
    from safetensors.torch import save_file

    model = _model()
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd["norm.weight"] = sd["norm.weight"].to(torch.float8_e4m3fn)
    save_file(sd, tmp_path / "f8.safetensors")
    target = _model(1)
    before = _snapshot(target)
    with pytest.raises(
        sg.StateDictMismatchError, match=r"norm\.weight: dtype torch\.float8_e4m3fn"
    ):
        sg.load_full_state_dict(target, tmp_path / "f8.safetensors", strict=False)
    assert not diff_state_dicts(target.state_dict(), before)


def test_trailing_bytes_after_the_data_are_rejected(saved, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, _, _ = saved
    (tmp_path / "bad.safetensors").write_bytes(path.read_bytes() + b"\0" * 8)
    _expect_rejected(tmp_path / "bad.safetensors", "truncated or padded")


# ------------------------------------------------------------------- checkpoint directories


class _Boom:
    """A pickle that runs code when unpickled (it would create ``marker``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


class UserState:
    def __init__(self, step: int) -> None:
        self.step = step


def _checkpoint(tmp_path: Path) -> tuple[Path, TinyLM, torch.optim.Optimizer]:
    model = _model()
    opt = make_optimizer(model)
    model(torch.randint(0, 37, (2, 3))).pow(2).mean().backward()
    opt.step()
    ckpt = tmp_path / "ckpt"
    sg.save_checkpoint(ckpt, model, opt, extra={"step": 1})
    return ckpt, model, opt


def _fresh() -> tuple[TinyLM, torch.optim.Optimizer, dict, dict]:  # type: ignore[type-arg]
    model = _model(1)
    opt = make_optimizer(model)
    return model, opt, _snapshot(model), opt.state_dict()


def test_checkpoint_metadata_is_json_not_pickle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt, model, opt = _checkpoint(tmp_path)
    assert sorted(os.listdir(ckpt)) == [
        "extra.pt",
        "model.safetensors",
        "optim.json",
        "optim.safetensors",
    ]
    json.loads((ckpt / "optim.json").read_text())  # plain JSON
    fresh, fresh_opt, _, _ = _fresh()
    assert sg.load_checkpoint(ckpt, fresh, fresh_opt) == {"step": 1}
    assert not diff_state_dicts(fresh.state_dict(), model.state_dict())
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, st_want in want["state"].items():
        for name, v in st_want.items():
            assert torch.equal(got["state"][i][name], v), (i, name)


def test_extra_is_not_unpickled_unless_trusted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt, _, _ = _checkpoint(tmp_path)
    marker = tmp_path / "code-ran"
    torch.save({"step": _Boom(str(marker))}, ckpt / "extra.pt")
    model, opt, before, opt_before = _fresh()
    with pytest.raises(sg.CheckpointError, match="trust_pickle=True") as e:
        sg.load_checkpoint(ckpt, model, opt)
    # One plain sentence naming the class: no terminal escapes, nothing cut mid-way
    assert "\x1b" not in str(e.value) and "\t" not in str(e.value), repr(str(e.value))
    assert "(e.g. " in str(e.value) and str(e.value).endswith("add_safe_globals."), str(e.value)
    assert not marker.exists()
    assert not diff_state_dicts(model.state_dict(), before)  # validated before loading
    assert opt.state_dict() == opt_before
    # Opting in restores arbitrary objects.
    torch.save({"user": UserState(3)}, ckpt / "extra.pt")
    assert sg.load_checkpoint(ckpt, model, opt, trust_pickle=True)["user"].step == 3


@pytest.mark.parametrize("blocking", [True, False])
def test_extra_that_a_load_would_refuse_is_refused_at_save_before_anything_is_written(
    tmp_path, blocking: bool
) -> None:  # type: ignore[no-untyped-def]
    """Regression: a datetime in ``extra`` was saved, and only the load refused it."""
    import datetime

    model = _model()
    opt = make_optimizer(model)
    ckpt = tmp_path / "ckpt"
    when = datetime.datetime(2026, 12, 7, 18, 0)
    with pytest.raises(sg.ShardGatherError, match="datetime") as e:
        sg.save_checkpoint(ckpt, model, opt, extra={"when": when}, blocking=blocking)
    assert "nothing was written" in str(e.value) and "isoformat" in str(e.value)
    assert os.listdir(tmp_path) == []  # no directory, no temporary
    # Allowed where it is saved and loaded: it round-trips.
    with torch.serialization.safe_globals([datetime.datetime]):
        handle = sg.save_checkpoint(ckpt, model, opt, extra={"when": when}, blocking=blocking)
        if handle is not None:
            handle.wait()
        assert sg.load_checkpoint(ckpt, model, opt) == {"when": when}


def test_legacy_pickled_optimizer_metadata_is_not_unpickled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt, _, _ = _checkpoint(tmp_path)
    marker = tmp_path / "code-ran"
    (ckpt / "optim.json").unlink()
    torch.save({"param_groups": _Boom(str(marker))}, ckpt / "optim.pt")
    model, opt, before, _ = _fresh()
    with pytest.raises(sg.CheckpointError, match="trust_pickle"):
        sg.load_checkpoint(ckpt, model, opt)
    assert not marker.exists()
    assert not diff_state_dicts(model.state_dict(), before)


@pytest.mark.parametrize(
    "damage",
    ["truncated_optim_file", "optim_json_garbage", "optim_json_wrong_shape", "missing_state"],
)
def test_bad_optimizer_file_leaves_no_half_loaded_model(tmp_path, damage: str) -> None:  # type: ignore[no-untyped-def]
    ckpt, _, _ = _checkpoint(tmp_path)
    optim_file = ckpt / "optim.safetensors"
    if damage == "truncated_optim_file":
        with open(optim_file, "r+b") as f:
            f.truncate(os.path.getsize(optim_file) - 12)
    elif damage == "optim_json_garbage":
        (ckpt / "optim.json").write_text('{"param_groups": 3}')
    elif damage == "optim_json_wrong_shape":
        meta = json.loads((ckpt / "optim.json").read_text())
        meta["param_groups"] = meta["param_groups"][:1]
        (ckpt / "optim.json").write_text(json.dumps(meta))
    else:
        meta = json.loads((ckpt / "optim.json").read_text())
        meta["elements"]["norm.weight"].append("nonexistent")
        (ckpt / "optim.json").write_text(json.dumps(meta))
    model, opt, before, opt_before = _fresh()
    with pytest.raises(sg.ShardGatherError):
        sg.load_checkpoint(ckpt, model, opt)
    assert not diff_state_dicts(model.state_dict(), before)
    assert opt.state_dict() == opt_before


def test_json_values_round_trip_exactly() -> None:
    value = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "nan": float("nan"),
        "foreach": None,
        "step": torch.tensor(3.0),
        "bf16": torch.randn(3).to(torch.bfloat16),
        "dtype": torch.float16,
        "__private": [1, (2, "x")],
    }
    back = json_values.loads(json_values.dumps(value), "test")
    assert back.keys() == value.keys()
    assert back["betas"] == (0.9, 0.999) and back["lr"] == 1e-3 and back["nan"] != back["nan"]
    assert torch.equal(back["step"], value["step"]) and back["step"].dtype == torch.float32
    assert torch.equal(back["bf16"], value["bf16"]) and back["dtype"] is torch.float16
    assert back["__private"] == [1, (2, "x")]
    with pytest.raises(sg.ShardGatherError, match="cannot be stored without pickle"):
        json_values.dumps({"x": object()})


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.sampled_from(["float32", "bfloat16", "nope", "__tuple__", "__tensor__"]),
)
json_any = st.recursive(
    json_leaf,
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["__tuple__", "__tensor__", "__dtype__", "__dict__", "dtype", "shape", "hex", "a"]
            ),
            c,
            max_size=3,
        )
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(json_any)
def test_json_values_decode_never_raises_anything_else(obj: Any) -> None:
    with contextlib.suppress(sg.CheckpointError):
        json_values.loads(json.dumps(obj).encode(), "fuzz")


# --------------------------------------------------------------------------------- fuzzing

_FIELDS = ["dtype", "shape", "data_offsets"]
_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 40), st.sampled_from(_FIELDS), json_any),
    st.tuples(st.just("offsets"), st.integers(0, 40), st.integers(-9, 9), st.integers(-9, 9)),
    st.tuples(st.just("shape"), st.integers(0, 40), st.integers(0, 2), st.integers(-3, 3)),
    st.tuples(
        st.just("dtype"),
        st.integers(0, 40),
        st.sampled_from(["F32", "BF16", "F16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "X"]),
    ),
    st.tuples(st.just("swap"), st.integers(0, 40), st.integers(0, 40)),
    st.tuples(st.just("delete"), st.integers(0, 40)),
    st.tuples(st.just("duplicate"), st.integers(0, 40)),
    st.tuples(st.just("metadata"), json_any),
    st.tuples(
        st.just("aliases"),
        st.one_of(
            st.text(max_size=8),
            st.dictionaries(
                st.sampled_from(["lm_head.weight", "embed.weight", "x", "norm.bias"]),
                st.one_of(st.sampled_from(["embed.weight", "lm_head.weight", "y"]), json_leaf),
                max_size=2,
            ).map(json.dumps),
        ),
    ),
    st.tuples(st.just("prefix"), st.integers(-16, 16)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("append"), st.integers(1, 9)),
)


def _mutate(pairs: list[list[Any]], data: bytes, ops: list[tuple]) -> bytes:  # type: ignore[type-arg]
    """The bytes of the valid file's header and data after ``ops``."""
    pairs = json.loads(json.dumps(pairs))
    prefix = 0
    truncate: float | None = None
    for kind, *args in ops:
        tensors = [i for i, (k, _) in enumerate(pairs) if k != "__metadata__"]
        meta = [p for p in pairs if p[0] == "__metadata__"]
        pick = tensors[args[0] % len(tensors)] if tensors and isinstance(args[0], int) else None
        entry = pairs[pick][1] if pick is not None else None
        if not isinstance(entry, dict):
            entry = {}
        if kind == "set":
            entry[args[1]] = args[2]
        elif kind == "offsets" and _ints(entry.get("data_offsets"), 2):
            o = entry["data_offsets"]
            entry["data_offsets"] = [o[0] + args[1], o[1] + args[2]]
        elif kind == "shape" and _ints(entry.get("shape")) and entry["shape"]:
            shape = entry["shape"]
            shape[args[1] % len(shape)] += args[2]
        elif kind == "dtype":
            entry["dtype"] = args[1]
        elif kind == "swap" and pick is not None:
            other = pairs[tensors[args[1] % len(tensors)]][1]
            if isinstance(other, dict):
                entry["data_offsets"], other["data_offsets"] = (
                    other.get("data_offsets"),
                    entry.get("data_offsets"),
                )
        elif kind == "delete" and pick is not None:
            del pairs[pick]
        elif kind == "duplicate" and pick is not None:
            pairs.append(json.loads(json.dumps(pairs[pick])))
        elif kind == "metadata" and meta:
            meta[0][1] = args[0]
        elif kind == "aliases" and meta and isinstance(meta[0][1], dict):
            meta[0][1][ALIASES] = args[0]
        elif kind == "prefix":
            prefix += args[0]
        elif kind == "truncate":
            truncate = args[0]
        elif kind == "append":
            data += b"\x7f" * args[0]
    raw = _serialize(pairs, data, prefix)
    return raw if truncate is None else raw[: int(truncate * len(raw))]


def _ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and all(type(x) is int for x in v)


def _reference(path: Path) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    try:
        sd = load_file(path)
        n = struct.unpack("<Q", path.read_bytes()[:8])[0]
        meta = json.loads(path.read_bytes()[8 : 8 + n]).get("__metadata__") or {}
        for alias, key in json.loads(meta.get(ALIASES, "{}")).items():
            sd[alias] = sd[key]
        return sd
    except Exception:
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        return True
    except AssertionError:
        return False


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(_mutation, min_size=1, max_size=3))
def test_fuzzed_files_load_exactly_or_raise_cleanly(saved, tmp_path, ops) -> None:  # type: ignore[no-untyped-def]
    _, pairs, data = saved
    path = tmp_path / "fuzzed.safetensors"
    path.write_bytes(_mutate(pairs, data, ops))
    reference = _reference(path)

    model = _model(1)
    before = _snapshot(model)
    try:
        result = sg.load_full_state_dict(model, path, strict=False)
    except sg.ShardGatherError as exc:
        event(f"rejected: {type(exc).__name__}")
        assert not diff_state_dicts(model.state_dict(), before)
    else:
        event("loaded")
        assert reference is not None, f"accepted a file the reference reader rejects: {ops}"
        after = model.state_dict()
        for k, v in after.items():
            src = k if k in reference else TIED.get(k)  # a tied alias loads its primary
            want = before[k] if k in result.missing_keys else reference[src].to(v.dtype)
            assert _same(v, want), (k, ops)

    try:
        got = sg.load_file(path)
    except sg.ShardGatherError:
        return
    assert reference is not None, f"load_file accepted a file the reference rejects: {ops}"
    assert got.keys() == reference.keys()
    for k in got:
        assert got[k].dtype == reference[k].dtype and _same(got[k], reference[k]), (k, ops)


# ------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "damage", ["negative_offsets", "duplicate_key", "bad_aliases", "truncated", "directory"]
)
@pytest.mark.parametrize("command", ["inspect", "clean-keys"])
def test_cli_bad_input_is_one_line_and_status_2(saved, tmp_path, capsys, damage, command) -> None:  # type: ignore[no-untyped-def]
    path, pairs, data = saved
    bad = tmp_path / "bad.safetensors"
    if damage == "negative_offsets":
        pairs[_tensor_index(pairs, "scale")][1]["data_offsets"] = [-4, 0]
        _write(bad, pairs, data)
    elif damage == "duplicate_key":
        pairs.append(pairs[_tensor_index(pairs, "scale")])
        _write(bad, pairs, data)
    elif damage == "bad_aliases":
        pairs[_tensor_index(pairs, "__metadata__")][1][ALIASES] = "{"
        _write(bad, pairs, data)
    elif damage == "truncated":
        bad.write_bytes(path.read_bytes()[:-5])
    else:
        bad.mkdir()
    out = tmp_path / "out.safetensors"
    argv = ["inspect", str(bad)] if command == "inspect" else ["clean-keys", str(bad), str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardgather: error: "), err
    assert "Traceback" not in err[0]
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["good.safetensors", "bad.safetensors"])


def test_cli_missing_output_directory_is_one_line(saved, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path, _, _ = saved
    assert main(["clean-keys", str(path), str(tmp_path / "no" / "out.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardgather: error: "), err


def test_cli_consolidate_of_a_damaged_dcp_directory(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save(
            {"model": _model().state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True
        )
    for f in os.listdir(tmp_path / "dcp"):
        if f.endswith(".distcp"):
            with open(tmp_path / "dcp" / f, "r+b") as fh:
                fh.truncate(10)
    out = tmp_path / "full.safetensors"
    assert main(["consolidate", str(tmp_path / "dcp"), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardgather: error: "), err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["dcp"]


# ------------------------------------------------------------- the same, in sharded models


def sharded_bad_files_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    """Crafted files into FSDP2 (2 ranks): every rank raises, no shard changes."""
    from .builders import build

    model, _ = build("fsdp2", world, seed=0)
    opt = make_optimizer(model)
    from .models import train_steps

    train_steps(model, rank, 1, opt)
    ckpt = os.path.join(root, "ckpt")
    sg.save_checkpoint(ckpt, model, opt)
    before = sg.full_state_dict(model, rank0_only=False)
    out: dict[str, Any] = {}
    good = os.path.join(ckpt, "model.safetensors")
    raw = Path(good).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    pairs = [[k, v] for k, v in header.items()]
    bad = os.path.join(root, f"bad-{rank}.safetensors")
    i = _tensor_index(pairs, "norm.bias")
    j = _tensor_index(pairs, "norm.weight")
    variants = {
        "negative": lambda p: p[_tensor_index(p, "scale")][1].__setitem__("data_offsets", [-4, 0]),
        "overlap": lambda p: p[i][1].__setitem__("data_offsets", p[j][1]["data_offsets"]),
        "duplicate": lambda p: p.append([p[i][0], dict(p[i][1])]),
    }
    for name, damage in variants.items():
        p = json.loads(json.dumps(pairs))
        damage(p)
        _write(Path(bad), p, data)
        try:
            sg.load_full_state_dict(model, bad)
            out[name] = None
        except sg.ShardGatherError as exc:
            out[name] = type(exc).__name__
    optim_file = os.path.join(ckpt, "optim.safetensors")
    if rank == 0:
        with open(optim_file, "r+b") as f:
            f.truncate(os.path.getsize(optim_file) - 12)
    torch.distributed.barrier()
    fresh, _ = build("fsdp2", world, seed=1)
    fresh_opt = make_optimizer(fresh)
    fresh_before = sg.full_state_dict(fresh, rank0_only=False)
    try:
        sg.load_checkpoint(ckpt, fresh, fresh_opt)
        out["truncated_optim"] = None
    except sg.ShardGatherError as exc:
        out["truncated_optim"] = type(exc).__name__
    out["unchanged"] = not diff_state_dicts(sg.full_state_dict(model, rank0_only=False), before)
    out["fresh_unchanged"] = not diff_state_dicts(
        sg.full_state_dict(fresh, rank0_only=False), fresh_before
    )
    return out


@pytest.mark.distributed
def test_crafted_files_into_a_sharded_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for r in dist_harness.run(
        "tests.test_untrusted_files:sharded_bad_files_worker", 2, root=str(tmp_path)
    ):
        assert r == {
            "negative": "CheckpointError",
            "overlap": "CheckpointError",
            "duplicate": "CheckpointError",
            "truncated_optim": "CheckpointError",
            "unchanged": True,
            "fresh_unchanged": True,
        }, r


def test_pickle_module_is_what_torch_raises() -> None:
    # load_checkpoint maps weights_only refusals through pickle.UnpicklingError.
    import io

    buf = io.BytesIO()
    torch.save({"x": UserState(1)}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)
