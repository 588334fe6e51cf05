"""GPU end-to-end (skipped without CUDA): FSDP1/FSDP2 on NCCL with one GPU per rank,
gather + save + load + optimizer state, bit-exact against the plain model."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _nccl_world_1(tmp_path, fn) -> None:  # type: ignore[no-untyped-def]
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path}/rdzv",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("transport", ["auto", "collective"])
def test_gather_save_load_on_gpu(tmp_path, flavour: str, transport: str) -> None:  # type: ignore[no-untyped-def]
    import copy

    import shardgather as sg

    from .compare import diff_state_dicts
    from .models import TinyLM

    def body() -> None:
        torch.manual_seed(0)
        model = TinyLM().cuda()
        plain = copy.deepcopy(model).cpu()
        if flavour == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model, device_id=torch.cuda.current_device())
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        got = sg.full_state_dict(model, transport=transport)
        assert not diff_state_dicts(got, plain.state_dict())
        got16 = sg.full_state_dict(model, dtype=torch.bfloat16, transport=transport)
        want16 = {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in plain.state_dict().items()
        }
        assert not diff_state_dicts(got16, want16)
        path = tmp_path / "m.safetensors"
        sg.save_full_state_dict(model, path, transport=transport)
        assert not diff_state_dicts(sg.load_file(path), plain.state_dict(), order=False)
        torch.manual_seed(1)
        other = TinyLM().cuda()
        if flavour == "fsdp1":
            other = FSDP(other, device_id=torch.cuda.current_device())
        else:
            fully_shard(other)
        sg.load_full_state_dict(other, path)
        assert not diff_state_dicts(sg.full_state_dict(other), plain.state_dict())

    _nccl_world_1(tmp_path, body)


@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2"])
def test_async_save_on_gpu_holds_the_values_at_call_time(tmp_path, flavour: str) -> None:  # type: ignore[no-untyped-def]
    """The snapshot of CUDA shards (a copy kernel into pinned staging on a side stream
    that the training stream then waits for): a step right after the call is not in
    the file."""
    import shardgather as sg

    from .compare import diff_state_dicts
    from .models import TinyLM

    def body() -> None:
        torch.manual_seed(0)
        model = TinyLM().cuda()
        if flavour == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model, device_id=torch.cuda.current_device())
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for i in range(2):  # the second snapshot reuses the pinned buffer
            want = sg.full_state_dict(model)
            path = tmp_path / f"m{i}.safetensors"
            handle = sg.save_full_state_dict(model, path, blocking=False)
            tokens = torch.randint(0, 37, (2, 5), device="cuda")
            model(tokens).float().pow(2).mean().backward()
            opt.step()
            handle.wait()
            assert not diff_state_dicts(sg.load_file(path), want, order=False)

    _nccl_world_1(tmp_path, body)
