"""PEFT adapters under FSDP: the adapter alone, in PEFT's own format, written and read by
the one engine with ``keys=`` — nothing of the frozen base is gathered, moved or read.

Which keys belong to an adapter, and under which names PEFT stores them, is PEFT's to
say (its tuners decide structurally, per method): shardgather asks PEFT's own
``get_peft_model_state_dict`` once, on placeholders that stand for the model's tensors
(meta tensors of the right shape, nothing materialised), and maps what comes back to
the model's keys by identity. The answer is therefore what PEFT gives on the unsharded
model, for every PEFT method, adapter name and version handling it already does.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._dist import Call
from ._engine.run import gather_to_all
from ._fqn import clean_fqn
from ._options import DEFAULT_TIMEOUT, check_model
from ._plan import GatherPlan, build_plan
from ._plan.merge import Fetch, merged
from ._plan.subset import select
from ._plan.walk import walk_modules
from .api import LoadResult, load_full_state_dict, save_full_state_dict
from .errors import CheckpointError, ShardGatherError, UnsupportedModelError

WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's SAFETENSORS_WEIGHTS_NAME
CONFIG_NAME = "adapter_config.json"  # PEFT's CONFIG_NAME
# Rows of B per delta GEMM at the least: fewer take other BLAS kernels (see _Lora.delta).
MIN_DELTA_ROWS = 16


def adapter_keys(
    model: nn.Module, adapter_name: str = "default", save_embedding_layers: bool | str = "auto"
) -> dict[str, str]:
    """The model's keys that make up adapter ``adapter_name``, each with the name PEFT
    stores it under: ``{model key: adapter file key}`` (e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).

    ``model``: a ``PeftModel``, bare or wrapped (FSDP1, FSDP2, DDP, compiled, or inside
    a LightningModule); the keys are as :func:`shardgather.full_state_dict` names them.
    No process group is needed and nothing is communicated."""
    peft_model, prefix = _peft_model(model)
    _config(peft_model, adapter_name, "adapter_name")
    return _names(peft_model, prefix, build_plan(model), adapter_name, save_embedding_layers)


def _names(
    peft_model: Any,
    prefix: str,
    plan: GatherPlan,
    adapter_name: str,
    save_embedding_layers: bool | str,
) -> dict[str, str]:
    """:func:`adapter_keys` on a plan already built (one walk serves every adapter)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    raw = _raw_module_names(peft_model)
    stand_ins: dict[str, torch.Tensor] = {}  # as PEFT names the key -> a placeholder
    model_key: dict[int, str] = {}  # id(placeholder) -> the model's key
    for key in plan.keys:
        if not key.startswith(prefix):
            continue
        e = plan.entries[plan.aliases.get(key, key)]
        module, _, leaf = key[len(prefix) :].rpartition(".")
        name = f"{raw.get(module, module)}.{leaf}" if module else leaf
        t = torch.empty(e.shape, dtype=e.dtype, device="meta")
        stand_ins[name] = t
        model_key[id(t)] = key
    chosen = get_peft_model_state_dict(
        peft_model,
        state_dict=stand_ins,
        adapter_name=adapter_name,
        save_embedding_layers=save_embedding_layers,
    )
    out: dict[str, str] = {}
    for stored, t in chosen.items():
        key = model_key.get(id(t))
        if key is None:  # a tensor PEFT made itself (prompt learning): not ours to move
            raise ShardGatherError(
                f"PEFT's adapter holds {stored!r}, which is not a tensor of the model's "
                f"state dict ({peft_model.peft_config[adapter_name].peft_type}): shardgather "
                "exports adapters whose weights are model parameters (LoRA and the other "
                "tuners that inject layers); save prompt-learning adapters with PEFT"
            )
        out[key] = clean_fqn(stored)
    if not out:
        raise ShardGatherError(f"adapter {adapter_name!r} holds no tensor of the model")
    return out


def save_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    adapter_name: str = "default",
    dtype: torch.dtype | None = None,
    save_embedding_layers: bool | str = "auto",
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
) -> None:
    """Write adapter ``adapter_name`` of a (sharded) PEFT model as PEFT's
    ``save_pretrained`` does: ``path/adapter_model.safetensors`` (the tensors of
    ``get_peft_model_state_dict`` on the unsharded model, bit-exact, under its names)
    and ``path/adapter_config.json`` — loadable by ``PeftModel.from_pretrained`` and
    :func:`load_adapter`.

    Call on every rank. Only the adapter's elements move: every rank writes its own
    pieces of them (FSDP1 flat parameters that also hold the frozen base are gathered
    only in the adapter's columns), so a 200 MB adapter of a 70B model moves 200 MB —
    and every rank's slice of it is in the file (the bug this replaces kept rank 0's).

    Args:
        model: a ``PeftModel``, bare or wrapped (see :func:`adapter_keys`).
        path: the directory to write (created; its other files are kept).
        adapter_name: which adapter (PEFT's default ``"default"``).
        dtype: cast floating-point tensors (e.g. ``torch.bfloat16``).
        save_embedding_layers: as PEFT's ``save_pretrained`` (``"auto"``: embedding
            layers too when they are adapter targets or were resized).
        progress, timeout, transport: as for :func:`shardgather.save_full_state_dict`.
    """
    peft_model, prefix = _peft_model(model)
    _config(peft_model, adapter_name, "adapter_name")
    names = _names(peft_model, prefix, build_plan(model), adapter_name, save_embedding_layers)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_full_state_dict(
        model,
        os.path.join(path, WEIGHTS_NAME),
        keys=list(names),
        key_map=names.__getitem__,
        dtype=dtype,
        metadata={"format": "pt"},  # what PEFT writes
        progress=progress,
        timeout=timeout,
        transport=transport,
    )
    # The config is part of the collective save: rank 0 writes it, and a failure there
    # raises on every rank (it used to fail on rank 0 alone, after the others returned).
    with Call("save_adapter", timeout) as call:
        if call.rank == 0:
            _write_config(peft_model, adapter_name, path)
        call.round("adapter config")


def load_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    adapter_name: str = "default",
    strict: bool = True,
    save_embedding_layers: bool | str = "auto",
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
) -> LoadResult:
    """Load an adapter file (a directory ``save_pretrained``/:func:`save_adapter` wrote,
    or its ``adapter_model.safetensors``) into adapter ``adapter_name`` of a (sharded)
    PEFT model, in place: every rank reads only its own elements of the adapter's
    tensors; the base is not touched.

    ``strict``: every tensor of the adapter must be in the file and every tensor of the
    file must belong to the adapter (else ``StateDictMismatchError``, nothing loaded);
    False loads those that match and returns the rest in the ``LoadResult``."""
    names = adapter_keys(model, adapter_name, save_embedding_layers)
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, WEIGHTS_NAME)
    to_model = {stored: key for key, stored in names.items()}
    return load_full_state_dict(
        model,
        path,
        keys=list(names),
        key_map=lambda stored: to_model.get(stored, stored),
        strict=strict,
        progress=progress,
        timeout=timeout,
        transport=transport,
    )


# ------------------------------------------------------------------------------- merged


# LoRA factors a merged export holds at a time (per rank): the factors of consecutive
# layers are fetched together up to this size (one layer's alone, when it is larger).
FACTOR_BYTES = 4 * 2**20


def merging(model: nn.Module, adapter_name: str) -> Callable[[GatherPlan], GatherPlan]:
    """What ``merge_adapter=`` does to a verb's plan: every LoRA layer's base weight
    becomes ``W + scaling * (B @ A)`` — PEFT's ``merge_and_unload`` — computed by each
    rank for its own elements of ``W`` (the rows of ``B @ A`` they cover, nothing
    more), adapter tensors dropped, keys the base model's (PEFT's prefix and
    ``.base_layer`` gone). The plan moves in phases of layers: before each, every rank
    receives those layers' ``A`` and ``B`` whole (and lets the previous phase's go), so
    a rank holds about FACTOR_BYTES of factors, however large the adapter."""
    peft_model, prefix = _peft_model(model)
    layers = _lora_layers(model, peft_model, adapter_name)
    plan = build_plan(model)
    drop: set[str] = set()
    for name in peft_model.peft_config:
        drop.update(_names(peft_model, prefix, plan, name, save_embedding_layers=False))
    factors: dict[str, torch.Tensor] = {}  # the current phase's A and B, by key
    scratch = [torch.empty(0)]  # the delta slice being added, reused
    deltas = {layer.weight_key: layer.delta(factors, scratch) for layer in layers}
    of_weight = {layer.weight_key: (layer.a_key, layer.b_key) for layer in layers}
    everything = select(plan, [k for pair in of_weight.values() for k in pair])

    def prepare(weights: list[str]) -> Callable[[Any], None]:
        mine = select(everything, [k for w in weights for k in of_weight[w]])

        def fetch(call: Any) -> None:
            factors.clear()  # the previous phase's go first
            factors.update(gather_to_all(call, mine, bucket_mb=4))

        return fetch

    cost = {w: sum(plan.entries[k].nbytes for k in pair) for w, pair in of_weight.items()}
    fetch = Fetch(prepare, cost, FACTOR_BYTES)
    inner = prefix + "base_model.model."  # PeftModel -> LoraModel -> the base model
    bases = {layer.module for layer in layers}

    def rename(key: str) -> str:
        head, sep, tail = key.rpartition("base_layer.")
        if sep and head in bases:
            key = head + tail
        return prefix + key[len(inner) :] if key.startswith(inner) else key

    return lambda plan: merged(plan, deltas, drop, rename, fetch)


class _Lora:
    """One LoRA ``nn.Linear``: where its tensors are and its scaling (rsLoRA's too)."""

    def __init__(self, module: str, adapter_name: str, scaling: float) -> None:
        self.module = module  # clean key prefix of the LoRA layer, with its dot
        self.weight_key = module + "base_layer.weight"
        self.a_key = f"{module}lora_A.{adapter_name}.weight"
        self.b_key = f"{module}lora_B.{adapter_name}.weight"
        self.scaling = scaling

    def delta(
        self, factors: dict[str, torch.Tensor], scratch: list[torch.Tensor]
    ) -> Callable[[int, int], torch.Tensor]:
        """Rows of the delta, from ``factors`` as its phase fetched them, in
        ``scratch[0]`` (one float32 buffer every layer reuses: a slice of delta is
        added to its row before the next is computed)."""
        scaling = self.scaling

        def rows(r0: int, r1: int) -> torch.Tensor:
            # At least MIN_DELTA_ROWS rows go through the GEMM, the asked ones among
            # them: a product of 1-3, 5-7, 9-11 rows takes other BLAS kernels whose
            # sums round differently from PEFT's whole-weight product (seen on AVX-512).
            total = factors[self.b_key].shape[0]
            w0 = max(0, min(r0, r1 - MIN_DELTA_ROWS))
            w1 = min(total, max(r1, w0 + MIN_DELTA_ROWS))
            a, b = factors[self.a_key].float(), factors[self.b_key][w0:w1].float()
            n = b.shape[0] * a.shape[1]
            if scratch[0].numel() < n:
                scratch[0] = torch.empty(n, dtype=torch.float32)
            out = scratch[0][:n].view(b.shape[0], a.shape[1])
            # PEFT's get_delta_weight: (B @ A) * scaling, in float32 (as it does on the
            # CPU for 16-bit weights); each element the same length-r dot product.
            return torch.mm(b, a, out=out).mul_(scaling)[r0 - w0 : r1 - w0]

        return rows


def _lora_layers(model: nn.Module, peft_model: Any, adapter_name: str) -> list[_Lora]:
    """Every LoRA layer of ``adapter_name``, or UnsupportedModelError for what a merge
    here does not cover (each names the layer and says what to do)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    kind = str(_config(peft_model, adapter_name, "merge_adapter").peft_type)
    if not kind.endswith("LORA"):
        raise UnsupportedModelError(
            f"merge_adapter={adapter_name!r}: a {kind} adapter; merged exports cover LoRA "
            "(and rsLoRA). Export the adapter with save_adapter() and merge with PEFT"
        )
    out: list[_Lora] = []
    for name, mod in walk_modules(model):
        why = None
        if isinstance(mod, AuxiliaryTrainingWrapper):
            why = "modules_to_save / trainable tokens"
        elif isinstance(mod, LoraLayer) and adapter_name in mod.lora_A:
            if not isinstance(mod.get_base_layer(), nn.Linear):
                why = f"LoRA on a {type(mod.get_base_layer()).__name__} (only nn.Linear)"
            elif mod.use_dora.get(adapter_name):
                why = "DoRA (its merge renormalises every column)"
            elif getattr(mod, "fan_in_fan_out", False):
                why = "fan_in_fan_out (Conv1D) weights"
            elif getattr(mod, "lora_bias", {}).get(adapter_name):
                why = "lora_bias"
            else:
                out.append(_Lora(name, adapter_name, float(mod.scaling[adapter_name])))
        elif isinstance(mod, LoraLayer) and adapter_name in getattr(mod, "lora_embedding_A", {}):
            why = "LoRA on an embedding"
        if why is not None:
            raise UnsupportedModelError(
                f"merge_adapter={adapter_name!r}: {name.rstrip('.') or '<root>'} has {why}, "
                "which a merged export does not cover. Export the adapter with "
                "save_adapter() and merge with PEFT's merge_and_unload() on a full copy"
            )
    if not out:
        raise ShardGatherError(f"adapter {adapter_name!r} has no LoRA layer to merge")
    return out


# ------------------------------------------------------------------------------ helpers


def _peft_model(model: nn.Module) -> tuple[Any, str]:
    """The ``PeftModel`` inside ``model`` (wrappers skipped) and its key prefix."""
    check_model(model)
    try:
        from peft import PeftModel
    except ImportError:
        raise ShardGatherError("adapters need peft (pip install peft)") from None
    for prefix, module in walk_modules(model):
        if isinstance(module, PeftModel):
            return module, prefix
    raise ShardGatherError(
        f"no PeftModel in the {type(model).__name__} given (build it with "
        "peft.get_peft_model(base, config) before sharding; export a plain model's "
        "subset with keys= instead)"
    )


def _config(peft_model: Any, adapter_name: str, argument: str) -> Any:
    """Adapter ``adapter_name``'s PEFT config, or an error naming the ones there are."""
    config = peft_model.peft_config.get(adapter_name)
    if config is None:
        raise ShardGatherError(
            f"the model has no adapter {adapter_name!r} (it has "
            f"{sorted(peft_model.peft_config)}); pass {argument}="
        )
    return config


def _raw_module_names(peft_model: nn.Module) -> dict[str, str]:
    """Clean module name -> the name PEFT sees in ``peft_model.named_modules()`` (FSDP1
    and activation-checkpoint wrappers in between; PEFT strips only a leading
    ``_fsdp_wrapped_module.``), so PEFT's structural prefixes match the placeholders."""
    out: dict[str, str] = {}
    for name, _ in peft_model.named_modules():
        out.setdefault(clean_fqn(name), name.removeprefix("_fsdp_wrapped_module."))
    return out


def _base_model_class(peft_model: Any, prompt_learning: bool) -> type:
    """The base model's own class, as PEFT names it: past FSDP1's wrapper and FSDP2's
    ``FSDP<Name>`` subclass (``fully_shard`` makes one per class)."""
    module = peft_model.base_model if prompt_learning else peft_model.base_model.model
    module = getattr(module, "_fsdp_wrapped_module", module)
    cls = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch before FSDP2
        return cls
    while issubclass(cls, FSDPModule) and cls.__name__.startswith("FSDP"):
        bases = [b for b in cls.__bases__ if b is not FSDPModule]
        if not bases:
            break
        cls = bases[0]
    return cls


def _write_config(peft_model: Any, adapter_name: str, path: str) -> None:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (inference
    mode on), replaced in one step."""
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    config.inference_mode = True
    # What AutoPeftModel needs to find the base model's class when the config has no
    # task_type (PEFT's own save_pretrained writes the same).
    auto_mapping = None
    if getattr(config, "task_type", None) is None:
        cls = _base_model_class(peft_model, bool(getattr(config, "is_prompt_learning", False)))
        auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory(dir=path, prefix=".adapter-config-") as tmp:
        try:
            config.save_pretrained(tmp, auto_mapping_dict=auto_mapping)
            os.replace(os.path.join(tmp, CONFIG_NAME), os.path.join(path, CONFIG_NAME))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot write {CONFIG_NAME} ({exc})") from None
