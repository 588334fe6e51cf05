"""The vLLM backend's own logic, in-process and without vLLM (its module imports vLLM
only where it registers the engine): the layout check against the engine's checkpoint,
and the checkpoint-form copy. The real engine (and the layer groups its reload takes,
vLLM's own) is tests/test_vllm.py."""

from __future__ import annotations

import pytest
import torch

import shardgather as sg
from shardgather.integrations import vllm as sg_vllm


def test_the_module_imports_without_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the trainer's environment has none")
    # Imported above without vLLM; only registering needs it.
    with pytest.raises(ImportError):
        sg_vllm.register()


def test_the_layout_is_checked_against_the_engines_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import safetensors.torch

    safetensors.torch.save_file(
        {"model.embed.weight": torch.zeros(8, 4), "model.layers.0.w": torch.zeros(4, 4)},
        str(tmp_path / "model.safetensors"),
    )
    expected = sg_vllm.checkpoint_layout(str(tmp_path))
    assert expected == {"model.embed.weight": (8, 4), "model.layers.0.w": (4, 4)}
    good = [
        ("model.embed.weight", (8, 4), torch.bfloat16),
        ("model.layers.0.w", (4, 4), torch.float32),
    ]
    sg_vllm.check_layout(good, expected)  # dtypes may differ: vLLM casts as it loads
    with pytest.raises(sg.StateDictMismatchError, match=r"model\.layers\.0\.w") as e:
        sg_vllm.check_layout([("model.layers.0.w", (4, 5), torch.float32)], expected)
    assert "another shape" in str(e.value) and e.value.mismatched
    with pytest.raises(sg.StateDictMismatchError, match="extra") as e:
        sg_vllm.check_layout([("extra", (3,), torch.float32)], expected)
    assert e.value.unexpected_keys == ["extra"]
    assert sg_vllm.checkpoint_layout(str(tmp_path / "nowhere")) is None  # nothing to check


def test_the_copy_is_one_buffer_per_dtype_with_a_view_per_name() -> None:
    layout = [
        ("a", (2, 3), torch.bfloat16),
        ("b", (4,), torch.float32),
        ("c", (3,), torch.bfloat16),
    ]
    copy = sg_vllm.own_copy(layout)
    assert [tuple(copy[n].shape) for n in "abc"] == [(2, 3), (4,), (3,)]
    assert copy["a"].untyped_storage().data_ptr() == copy["c"].untyped_storage().data_ptr()
    assert copy["c"].storage_offset() == 6 and copy["a"].is_contiguous()
