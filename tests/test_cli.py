"""python -m shardgather inspect / clean-keys / consolidate on real files."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardgather as sg
from shardgather.__main__ import main

from .compare import diff_state_dicts
from .models import TinyLM

MiB = 2**20


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def test_inspect_warns_on_wrapped_keys(tmp_path, model, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "wrapped.pt"
    torch.save({"module._fsdp_wrapped_module." + k: v for k, v in model.state_dict().items()}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr()
    assert "module._fsdp_wrapped_module.embed.weight" in out.out
    assert "wrapper prefixes" in out.err


def test_inspect_safetensors_lists_aliases(tmp_path, model, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.safetensors"
    sg.save_full_state_dict(model, path, metadata={"step": "7"})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "lm_head.weight" in out and "alias of embed.weight" in out and '"step": "7"' in out


@pytest.mark.parametrize("src_kind", ["pt", "safetensors"])
@pytest.mark.parametrize("out_kind", ["pt", "safetensors"])
def test_clean_keys_repairs_a_wrapped_checkpoint(tmp_path, model, src_kind, out_kind) -> None:  # type: ignore[no-untyped-def]
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    wrapped = {"_orig_mod._fsdp_wrapped_module." + k: v.contiguous() for k, v in want.items()}
    src = tmp_path / f"in.{src_kind}"
    if src_kind == "pt":
        torch.save({"state_dict": wrapped}, src)
    else:
        from safetensors.torch import save_file

        save_file(wrapped, src)
    out = tmp_path / f"out.{out_kind}"
    assert main(["clean-keys", str(src), str(out)]) == 0
    got = sg.load_file(out) if out_kind == "safetensors" else torch.load(out)
    assert not diff_state_dicts(got, want, order=False)


def test_clean_keys_takes_tied_weights_and_keeps_other_entries(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Regressions: a torch file whose weights share memory (tied embeddings, the very
    file ``inspect`` sends to clean-keys) crashed with safetensors' raw traceback; entries
    that are not tensors (``epoch``) were dropped silently."""
    w = torch.randn(5, 3)
    wrapped = {
        "_fsdp_wrapped_module.embed.weight": w,
        "_fsdp_wrapped_module.head.weight": w,  # tied: the same tensor
        "_fsdp_wrapped_module.half": w[:2],  # another view of the same storage
        "module.bias": torch.zeros(3),
    }
    src = tmp_path / "old.pt"
    torch.save(wrapped, src)
    out = tmp_path / "fixed.safetensors"
    assert main(["clean-keys", str(src), str(out)]) == 0
    got = sg.load_file(out)
    assert sorted(got) == ["bias", "embed.weight", "half", "head.weight"]
    assert torch.equal(got["embed.weight"], w) and torch.equal(got["half"], w[:2])
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # stored once
    # Entries that are not tensors: a safetensors output refuses them by name, a torch
    # output keeps them.
    torch.save({**wrapped, "epoch": 3}, src)
    refused = tmp_path / "refused.safetensors"
    assert main(["clean-keys", str(src), str(refused)]) == 2
    assert "epoch" in capsys.readouterr().err and not refused.exists()
    assert main(["clean-keys", str(src), str(tmp_path / "fixed.pt")]) == 0
    kept = torch.load(tmp_path / "fixed.pt", weights_only=True)
    assert kept["epoch"] == 3 and torch.equal(kept["head.weight"], w)


def test_clean_keys_refuses_flat_params(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "flat.pt"
    torch.save({"_fsdp_wrapped_module._flat_param": torch.zeros(10)}, src)
    assert main(["clean-keys", str(src), str(tmp_path / "o.pt")]) == 2
    assert "flat parameter" in capsys.readouterr().err
    assert not (tmp_path / "o.pt").exists()


def test_consolidate_dcp_directory(tmp_path, model) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = tmp_path / "full.safetensors"
    assert (
        main(
            [
                "consolidate",
                str(tmp_path / "dcp"),
                str(out),
                "--prefix",
                "model.",
                "--dtype",
                "bf16",
                "--no-progress",
            ]
        )
        == 0
    )
    got = sg.load_file(out)
    want = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
        for k, v in model.state_dict().items()
    }
    assert not diff_state_dicts(got, want, order=False)


def test_bad_file_is_an_error_not_a_crash(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"garbage")
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    # Regression: it printed torch's mmap advice ("torch.save your checkpoint with this
    # option in order to use mmap") for a file that is no checkpoint at all.
    assert "not a checkpoint" in err and "mmap" not in err, err
    notes = tmp_path / "notes.txt"
    notes.write_text("step 1000: loss 2.3\n")
    assert main(["inspect", str(notes)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_consolidate_to_the_hf_layout_matches_torch_and_loads(tmp_path, model) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with pytest.warns(UserWarning):
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert main(["inspect", str(tmp_path / "dcp")]) == 0
    out = tmp_path / "hf"
    args = ["consolidate", str(tmp_path / "dcp"), str(out), "--max-shard-size", "2KB"]
    assert main([*args, "--no-progress"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # The same tensors torch's own consolidation produces, in the model's order.
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "torch.pt"))
    want = torch.load(tmp_path / "torch.pt", weights_only=True)
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(sg.load_file(out / name))
    assert not diff_state_dicts(got, want, order=False)
    assert list(index["weight_map"]) == sorted(want)  # save_pretrained sorts the index
    # A damaged directory is refused and nothing appears under the final name.
    (next((tmp_path / "dcp").glob("*.distcp"))).write_bytes(b"")
    assert main([*args[:2], str(tmp_path / "again"), "--no-progress"]) == 2
    assert not (tmp_path / "again").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_version_and_what_consolidate_wrote(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from shardgather.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"shardgather {sg.__version__}"
    import torch.distributed.checkpoint as dcp

    model = TinyLM(tied=False)
    with pytest.warns(UserWarning):
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    # A trailing "/" is a directory, and the CLI says it wrote one.
    assert main(["consolidate", str(tmp_path / "dcp"), str(tmp_path / "out") + "/"]) == 0
    captured = capsys.readouterr()
    assert f"in directory {tmp_path / 'out'}/" in captured.out, captured.out
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    # The bar counts every byte it promised: it ends at 100 %.
    assert "100%" in captured.err, captured.err
    assert not diff_state_dicts(
        sg.load_file(tmp_path / "out" / "model.safetensors"), model.state_dict(), order=False
    )


def test_consolidate_memory_is_its_buffers_not_the_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model many pieces large: the copy holds one 64 MiB buffer per reader plus the
    writer's, whatever the size (issue 29's bound: <= 256 MiB per process)."""
    import torch.distributed.checkpoint as dcp

    from shardgather._memory import peak_rss_rise, trim
    from shardgather.io.consolidate import BLOCK, DEFAULT_WORKERS, PIECE

    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(12 * 2**20, generator=g) for i in range(8)}  # 8 x 48 MiB
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    trim()  # sd stays resident: the rise below is the copy's alone
    out = tmp_path / "full.safetensors"
    with peak_rss_rise() as m:
        assert main(["consolidate", str(tmp_path / "dcp"), str(out), "--no-progress"]) == 0
    bound = (DEFAULT_WORKERS + 1) * (PIECE + 2 * BLOCK) + 48 * MiB
    assert m["peak_rise"] <= min(bound, 256 * MiB), m["peak_rise"] / MiB
    assert not diff_state_dicts(sg.load_file(out), sd, order=False)
