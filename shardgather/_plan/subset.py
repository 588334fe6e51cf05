"""Subsets of a plan (``keys=``): the keys a call moves, applied to the plan itself, so
that nothing outside them is gathered, sent, staged, read or written — a LoRA adapter
of a large model moves the adapter's bytes, not the flat parameters it shares with the
frozen base (FSDP1 ``use_orig_params=True`` puts both in one flat parameter)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

from ..errors import ShardGatherError
from .types import Entry, GatherPlan, fingerprint, row_blocks

# "trainable" (parameters with requires_grad), names and prefixes ("a.b." — a trailing
# dot — selects every key under a.b), or a predicate of a plain-model key.
KeySelection = str | Collection[str] | Callable[[str], bool]


def chosen_keys(plan: GatherPlan, keys: KeySelection) -> list[str]:
    """The plan's keys ``keys`` selects, in plan order; a name or prefix matching no
    key is an error (a typo must not export an empty adapter)."""
    if isinstance(keys, str):
        if keys != "trainable":
            raise ShardGatherError(
                f"keys={keys!r}: pass a list of names or prefixes (e.g. [{keys!r}]), a "
                "predicate of the key, or 'trainable' (parameters with requires_grad)"
            )
        out = [k for k in plan.keys if plan.entries[plan.aliases.get(k, k)].trainable]
        if not out:
            raise ShardGatherError(
                "keys='trainable': no parameter of the model has requires_grad=True "
                "(frozen everywhere, or called before the adapters were added)"
            )
        return out
    if callable(keys):
        return [k for k in plan.keys if keys(k)]
    wanted = list(keys)
    if not all(isinstance(w, str) for w in wanted):
        raise ShardGatherError("keys= must hold str names or prefixes")
    names = {w for w in wanted if not w.endswith(".")}
    prefixes = tuple(w for w in wanted if w.endswith("."))
    out = [k for k in plan.keys if k in names or k.startswith(prefixes)]
    unmatched = sorted(names - set(out)) + [
        p for p in prefixes if not any(k.startswith(p) for k in out)
    ]
    if unmatched:
        example = plan.keys[0] if plan.keys else "(none)"
        raise ShardGatherError(
            f"keys= names {unmatched[:5]} which the model does not have (its keys look "
            f"like {example!r}; a prefix ends with '.')"
        )
    return out


def select(plan: GatherPlan, keys: KeySelection | None) -> GatherPlan:
    """``plan`` restricted to the keys ``keys`` selects (``plan`` itself for None).

    A tied alias kept without its primary becomes the primary. Sources keep their
    indices; the columns of each source's rows the kept entries occupy are recorded
    (``plan.columns``), so buckets gather only those."""
    if keys is None:
        return plan
    kept = chosen_keys(plan, keys)
    keep = set(kept)
    entries: dict[str, Entry] = {}
    aliases: dict[str, str] = {}
    promoted: dict[str, str] = {}  # dropped primary -> the kept alias standing in for it
    for k in kept:
        primary = plan.aliases.get(k, k)
        if primary in keep:
            if primary == k:
                entries[k] = plan.entries[k]
            else:
                aliases[k] = primary
        elif primary in promoted:
            aliases[k] = promoted[primary]
        else:
            promoted[primary] = k
            entries[k] = replace(plan.entries[primary], key=k)
    rename = {**{k: k for k in entries}, **promoted}
    identities = {i: rename[k] for i, k in plan.identities.items() if k in rename}
    sub = replace(
        plan,
        keys=kept,
        entries=entries,
        aliases=aliases,
        identities=identities,
        columns=_columns(plan, entries),
    )
    sub.fingerprint = fingerprint(sub)
    return sub


def _columns(plan: GatherPlan, kept: dict[str, Entry]) -> dict[int, list[tuple[int, int]]]:
    """Per source, the merged column ranges of its rows the kept entries occupy (every
    column of a source all of whose entries are kept; none of one with none kept)."""
    total = {i: len(es) for i, es in plan.entries_by_source().items()}
    mine_by: dict[int, list[Entry]] = {}
    for e in kept.values():
        mine_by.setdefault(e.source.index, []).append(e)
    out: dict[int, list[tuple[int, int]]] = {}
    for src in plan.sources:
        mine = mine_by.get(src.index, [])
        if not any(e.numel for e in mine):
            out[src.index] = []  # nothing kept here, or only empty tensors: nothing to move
            continue
        if src.group is None or len(mine) == total.get(src.index, 0):
            out[src.index] = [(0, src.row_numel)]
            continue
        spans: list[tuple[int, int]] = []
        p = src.row_numel
        for e in mine:
            for r in range(src.world):
                for b in row_blocks(e, r):
                    if b.numel:
                        lo = b.shard - r * p
                        spans.append((lo, lo + (b.count - 1) * b.strides[0] + b.run_numel))
        out[src.index] = _merged(spans)
    return out


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
