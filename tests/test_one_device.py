"""Every verb on one device, the same test body on the CPU (gloo; always run, so the
test itself is known to work) and on a GPU (NCCL; run by bench/gpu_check.sh where a GPU
is lent, skipped elsewhere): the paths a CUDA model takes that the op tests do not —
the HF save, the load, the stream with ``device="cuda"``, checkpoints with an exact
resume, and weight-sync deltas of CUDA shards (``diff_update`` on the device) — each
bit-exact against torch's own full state dict."""

from __future__ import annotations

import copy
import datetime
import socket
import threading
from typing import Any

import pytest
import torch

import shardgather as sg

from .compare import diff_state_dicts
from .models import TinyLM

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def _world_1(tmp_path, device: str, fn) -> Any:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{tmp_path}/rdzv",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def _wrap(model: torch.nn.Module, flavour: str, device: str) -> torch.nn.Module:
    if flavour == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
        return FSDP(model, device_id=torch.device(dev), use_orig_params=True)
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:  # type: ignore[union-attr]
        fully_shard(b)
    fully_shard(model)
    return model


def _torch_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def _cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in sd.items()}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 37, (2, 5), generator=gen).to(device)
    model(tokens).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_verb_on_one_device(tmp_path, device: str, flavour: str) -> None:  # type: ignore[no-untyped-def]
    def body() -> None:
        torch.manual_seed(0)
        model = _wrap(TinyLM(tied=False).to(device), flavour, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt, device, 0)
        want = _torch_full(model)
        # full_state_dict, and the HF layout written by the save
        assert not diff_state_dicts(_cpu(sg.full_state_dict(model)), want, order=False)
        hf = str(tmp_path / "hf") + "/"
        sg.save_full_state_dict(model, hf)
        assert not diff_state_dicts(sg.load_file(hf + "model.safetensors"), want, order=False)
        # the stream, its tensors on the model's device
        with sg.Gatherer(model) as g:
            streamed = {}
            for k, t in g.iter_full_tensors(device=device):
                assert t.device.type == device, (k, t.device)
                streamed[k] = t.cpu().clone()
        assert not diff_state_dicts(streamed, want, order=False)
        # a checkpoint, a step, then an exact resume (model and optimizer)
        ckpt = str(tmp_path / "ckpt")
        sg.save_checkpoint(ckpt, model, opt, extra={"step": 1})
        osd = sg.full_optim_state_dict(model, opt)
        _step(model, opt, device, 1)
        assert diff_state_dicts(_cpu(sg.full_state_dict(model)), want, order=False)
        assert sg.load_checkpoint(ckpt, model, opt) == {"step": 1}
        assert not diff_state_dicts(_torch_full(model), want, order=False)
        again = sg.full_optim_state_dict(model, opt)
        for key, st in osd["state"].items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(again["state"][key][name].cpu(), v.cpu()), (key, name)
        # the HF directory back into a fresh model
        torch.manual_seed(1)
        other = _wrap(TinyLM(tied=False).to(device), flavour, device)
        sg.load_full_state_dict(other, hf)
        assert not diff_state_dicts(_torch_full(other), want, order=False)

    _world_1(tmp_path, device, body)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("device", DEVICES)
def test_weight_sync_deltas_of_shards_on_one_device(tmp_path, device: str, flavour: str) -> None:  # type: ignore[no-untyped-def]
    """A sender over the device's shards (its deltas compared by ``diff_update`` on that
    device), a receiver on a thread of the same process with a CPU target: after every
    sync the target equals torch's full state dict of the trainer, cast to bf16."""
    port = _free_port()
    timeout = datetime.timedelta(seconds=120)
    torch.manual_seed(0)
    plain = TinyLM(tied=False)
    target = {k: _bf16(v).clone() for k, v in plain.state_dict().items()}
    got: dict[str, Any] = {"syncs": [], "error": None}

    def receive(steps: int) -> None:
        try:
            group = sg.connect_sync_group("127.0.0.1", port, 1, 2, timeout=timeout)
            receiver = sg.WeightReceiver(group, target=target, timeout=timeout)
            for _ in range(steps):
                got["syncs"].append(receiver.receive()["mode"])
            receiver.close()
        except BaseException as exc:  # the test reads it
            got["error"] = exc

    def body() -> list[str]:
        model = _wrap(copy.deepcopy(plain).to(device), flavour, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        group = sg.connect_sync_group("127.0.0.1", port, 0, 2, timeout=timeout)
        sender = sg.WeightSender(model, group, dtype=torch.bfloat16, delta=True, timeout=timeout)
        modes, problems = [], []
        for step in range(3):
            if step:
                _step(model, opt, device, step)
            modes.append(sender.sync()["mode"])
            want = {k: _bf16(v) for k, v in _torch_full(model).items()}
            problems += [f"sync {step}: {p}" for p in diff_state_dicts(target, want, order=False)]
        assert not problems, problems
        return modes

    thread = threading.Thread(target=receive, args=(3,), daemon=True)
    thread.start()
    modes = _world_1(tmp_path, device, body)
    thread.join(timeout=120)
    assert got["error"] is None, got["error"]
    assert modes == ["full", "delta", "delta"] and got["syncs"] == modes, (modes, got)
