"""The control plane of every call: one failure latch, bounded agreements, and the
group that host bytes travel on.

Every public verb runs inside one :class:`Call`. Ranks synchronise only through

- **rounds** (:meth:`Call.round`): each rank posts that it arrived (with a payload and
  its failure, if any) to the job's store and waits — polling, never longer than the
  call's timeout — until every rank has arrived *or any rank has failed*. A round that
  completes with a failure raises the same error on every rank, naming each failed
  rank; a round that times out names the ranks that never arrived (stuck or dead).
  Rounds use the store, not collectives: torch's object collectives have no timeout of
  their own on gloo, and a collective cannot name the rank it is waiting for.
- **data waits** (:meth:`Call.wait`) on point-to-point messages and bucket gathers,
  bounded by the call's timeout.

**The latch.** A rank that fails at any point posts its error to the store at once
(:meth:`Call.fail`) and leaves. Ranks waiting in a round see it within milliseconds.
Ranks blocked in a data wait on it are released at once too: the failing rank closes
shardgather's own gloo group (:func:`data_group`), on which host bytes travel, so
every pending message to or from it errors; each of them then reads the latch and
raises the agreed error. Gloo cannot cancel one wait, but a wait that times out
closes every connection of its group (gloo ``unbound_buffer.cc``: "Application timeout
caused pair closure") — which is exactly what a one-millisecond wait on a message
nobody sends does, deliberately. The user's own process groups (FSDP's, the default
one) are never used for shardgather's host messages, so a failed or timed-out call
leaves them untouched; the next call agrees to build a fresh data group (every rank
at the same point) and works.

Every rank must make the same shardgather calls in the same order (as with any
collective): a call is identified by its rank of order.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import json
import os
import pickle
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from . import errors
from .errors import CollectiveError, ShardGatherError

# Counters a test or benchmark reads around a call: rounds (store agreements), messages
# posted on the data group and their bytes, gathers (bucket collectives on device
# rows), data groups made, tensor bytes a load read from files.
STATS = {
    "calls": 0,
    "rounds": 0,
    "messages": 0,
    "bytes_sent": 0,
    "bytes_received": 0,
    "gathers": 0,
    "data_groups": 0,
    "bytes_read": 0,
}

_PREFIX = "shardgather/"
_SEP = "\x1f"  # between a round's name, its ``same`` value and its ``agree`` arguments


def _arrival_default() -> datetime.timedelta:
    raw = os.environ.get("SHARDGATHER_ARRIVAL_TIMEOUT_S", "60")
    try:
        seconds = float(raw)
    except ValueError:
        raise ShardGatherError(
            f"SHARDGATHER_ARRIVAL_TIMEOUT_S must be a number of seconds, got {raw!r}"
        ) from None
    return datetime.timedelta(seconds=seconds if seconds > 0 else 60)


# How long the first round of a call waits for ranks that are in no shardgather call,
# or in another one, before it says so: a mistake (one rank calling, ranks calling
# different verbs) is reported within this bound instead of after the data timeout.
# Ranks already inside the same call are waited for up to the call's timeout.
_ARRIVAL = {"timeout": _arrival_default()}


def set_arrival_timeout(timeout: datetime.timedelta | float) -> datetime.timedelta:
    """How long a collective call waits for ranks that have not entered it (default 60 s,
    or ``SHARDGATHER_ARRIVAL_TIMEOUT_S``); returns the previous bound. Raise it when one
    rank legitimately reaches its shardgather call much later than the others (e.g. rank
    0 alone runs a long evaluation first). Ranks already in the same call are waited for
    up to the call's own ``timeout``."""
    if not isinstance(timeout, datetime.timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ShardGatherError(
                f"set_arrival_timeout takes seconds or a datetime.timedelta, got {timeout!r}"
            )
        timeout = datetime.timedelta(seconds=timeout)
    if timeout.total_seconds() <= 0:
        raise ShardGatherError(f"the arrival timeout must be positive, got {timeout}")
    previous = _ARRIVAL["timeout"]
    _ARRIVAL["timeout"] = timeout
    return previous


_POISON_TAG = 2**31 - 7  # no message of ours ever uses it


def distributed() -> bool:
    """Whether there are other ranks to agree with."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _store() -> Any:
    """The job's store (the one the default process group was initialised with)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - very old torch
        raise ShardGatherError("shardgather needs torch.distributed's default store (torch >= 2.0)")
    return getter()


class _Counter:
    """Calls of this process, in order: the same number on every rank for the same call."""

    def __init__(self) -> None:
        self.next = 0
        self.owner: tuple[int, int] | None = None

    def take(self) -> int:
        # A new default process group (destroy + init again) starts a new numbering:
        # its store is new too.
        owner = (id(dist.group.WORLD), world_size())
        if owner != self.owner:
            self.owner, self.next = owner, 0
            _KEYS.clear()
        n = self.next
        self.next += 1
        return n


_CALLS = _Counter()
# Store keys this process created and may delete once every rank is past them.
_KEYS: list[str] = []


def _failure_record(exc: BaseException, where: int) -> dict[str, Any]:
    """What other ranks learn of a failure: its class (kept when it is one of ours)
    and message, and a mismatch's key lists."""
    cls = errors.qualified(type(exc)) if isinstance(exc, ShardGatherError) else None
    rec: dict[str, Any] = {"rank": where, "type": cls, "message": _describe(exc)}
    if getattr(exc, "_shardgather_missing", False):
        rec["missing"] = True
    if isinstance(exc, errors.StateDictMismatchError):
        rec["fields"] = [exc.missing_keys, exc.unexpected_keys, exc.mismatched]
    return rec


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ShardGatherError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def agreed_error(what: str, records: list[dict[str, Any]], missing: list[int]) -> ShardGatherError:
    """The one error every rank raises: the class of the failures when all are one of
    shardgather's own (e.g. a CheckpointError every rank found), else CollectiveError;
    the message names every failed and every missing rank."""
    parts = [f"rank {r['rank']}: {r['message']}" for r in sorted(records, key=lambda r: r["rank"])]
    # A rank that gave up waiting already said why the others are missing (in no call,
    # in another one, or in this one but stuck): only a bare wait needs this line.
    explained = any(r.get("missing") for r in records)
    if missing and not explained:
        parts.append(
            f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
            "arrive within the timeout (still busy in its previous step, stuck, or gone)"
        )
    types = {r["type"] for r in records}
    name = types.pop() if len(types) == 1 and not missing else None
    cls = errors.by_name(name) or CollectiveError
    message = f"{what} failed: " + "; ".join(parts)
    if issubclass(cls, errors.StateDictMismatchError):
        fields = next((r["fields"] for r in records if "fields" in r), [[], [], {}])
        err: ShardGatherError = cls(message, *fields)
    else:
        err = cls(message)
    err._shardgather_agreed = True  # type: ignore[attr-defined]
    return err


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` is the error every rank of a failed call raises."""
    return bool(getattr(exc, "_shardgather_agreed", False))


class Call:
    """One collective call of shardgather on this rank: its rounds, its latch, its
    data waits. Use as a context manager around the whole verb::

        with Call("save_full_state_dict", timeout) as call:
            ...
            call.round("plan", same=plan.fingerprint)

    An exception escaping the block is posted to the latch (other ranks raise the same
    error) and re-raised here — as the agreed class: this rank's own ShardGatherError
    unchanged, any other error as a CollectiveError chained to it.
    """

    def __init__(self, what: str, timeout: datetime.timedelta) -> None:
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ShardGatherError(
                f"timeout must be a positive datetime.timedelta, got {timeout!r}"
            )
        self.what = what
        self.timeout = timeout
        self.distributed = distributed()
        self.rank = rank()
        self.world = world_size()
        self.store = _store() if self.distributed else None
        self.id = _CALLS.take() if self.distributed else 0
        self.rounds = 0
        self.failure: BaseException | None = None
        self.consequence = False  # self.failure only followed another rank's
        self.uses_data_group = False
        self.poisoned = False
        self.marked_broken = False
        self.count = 0  # the sum of the last round's counts
        STATS["calls"] += 1

    # ----------------------------------------------------------------- the latch

    def __enter__(self) -> Call:
        # Where this rank is, for a peer that waits for it in vain (see _missing_ranks),
        # and the facts about this rank a peer may need before any round (see facts).
        if self.distributed:
            keys = [_where_key(self.rank), _fact_key("host", self.rank)]
            values = [f"{self.id}:{self.what}", host_id()]
            with contextlib.suppress(Exception):
                _multi_set(self.store, keys, values)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.distributed:
            with contextlib.suppress(Exception):
                self.store.set(_where_key(self.rank), "")
        if exc is None:
            return False
        self.latch(exc)
        if self.uses_data_group:  # release the peers still blocked on a message from us
            _poison_data_group(self)
        if is_agreed(exc):
            return False
        if self.consequence:
            self.raise_failures(own=False)
        return self._reraise(exc)

    def latch(self, exc: BaseException) -> None:
        """Post ``exc`` to the latch unless every rank knows already. Call it before
        cleaning up after a failure (removing temporaries): a peer that trips over
        what the cleanup removed must find this rank's error first, not report its own
        FileNotFoundError as the cause. Idempotent; ``__exit__`` calls it too."""
        if is_agreed(exc) or self.failure is not None:
            return
        if self.distributed and isinstance(exc, Exception):
            # Another rank failed first: what broke here (a message to it refused, the
            # data group closed under us, its temporaries gone) is its consequence.
            try:
                earlier = self._failures()
            except Exception:  # the store is gone too: report our own
                earlier = []
            if earlier:
                self.failure = exc
                self.consequence = True
                return
        # Post first, then close the data group: a peer released by the closing must
        # find this rank's error in the latch, not guess at a dead rank.
        self.fail(exc)

    def _reraise(self, exc: BaseException) -> bool:
        """The error this rank raises for its own failure (``__exit__``'s result)."""
        if not isinstance(exc, Exception) or isinstance(exc, ShardGatherError):
            return False  # KeyboardInterrupt & co. as they are; ours unchanged
        raise CollectiveError(f"{self.what} failed on rank {self.rank}: {_describe(exc)}") from exc

    def fail(self, exc: BaseException) -> None:
        """Latch this rank's failure: post it for every other rank at once, and close
        the data group if this call used it (releasing every peer blocked on us)."""
        if self.failure is not None:
            return
        self.failure = exc
        if not self.distributed:
            return
        try:
            self._set(f"failed/{self.rank}", json.dumps(_failure_record(exc, self.rank)))
            self.store.add(self._key("nfailed"), 1)
            # Wake the ranks waiting in a round: they are in this rank's current round
            # or the next one (no rank passes a round this rank has not reached).
            for k in (self.rounds, self.rounds + 1):
                self._set(f"{k}/all", b"1")
        except Exception:  # the store is gone (rank 0 died): nothing more to tell
            pass
        if self.uses_data_group:
            _poison_data_group(self)

    def _key(self, name: str) -> str:
        return f"{_PREFIX}{self.id}/{name}"

    def counter_key(self, name: str) -> str:
        """A store key of this call that ranks may ``add`` to (e.g. progress counts);
        rank 0 deletes it with the call's other keys, once every rank is past it."""
        key = self._key(name)
        if self.rank == 0:
            _KEYS.append(key)
        return key

    def any_failed(self) -> bool:
        """Whether any rank has posted a failure of this call (the next round raises)."""
        return bool(self.distributed and self.store.add(self._key("nfailed"), 0) > 0)

    def _set(self, name: str, value: str | bytes) -> None:
        key = self._key(name)
        self.store.set(key, value)
        _KEYS.append(key)

    def _failures(self) -> list[dict[str, Any]]:
        n = self.store.add(self._key("nfailed"), 0)
        if n <= 0:
            return []
        keys = [self._key(f"failed/{r}") for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        return [json.loads(v) for v in self.store.multi_get(present)] if present else []

    def raise_failures(self, missing: list[int] | None = None, *, own: bool = True) -> None:
        """Raise the agreed error if any rank failed (or some never arrived); ``own``:
        name this rank's failure too (not when it is only a consequence of theirs)."""
        records = self._failures() if self.distributed else []
        if own and self.failure is not None and not any(r["rank"] == self.rank for r in records):
            records.append(_failure_record(self.failure, self.rank))
        if records or missing:
            raise agreed_error(self.what, records, missing or []) from self.failure

    # ----------------------------------------------------------------- facts

    def post_fact(self, name: str, value: str) -> None:
        """Publish a fact about this rank (its host, what it can open) for the peers that
        need it before a round can tell them. A fact is no agreement and no history:
        posting it again posts the same value, and it outlives the call (one key per
        rank and name), so a rank that reads it never depends on which earlier calls of
        this process completed — the hazard of a per-process cache of a round's result,
        which ranks leaving a failed call at different points fill differently."""
        if self.distributed:
            self.store.set(_fact_key(name, self.rank), value)

    def facts(self, name: str, ranks: list[int]) -> list[str | None]:
        """The facts ``name`` of ``ranks`` (in that order), waiting for those not yet
        posted: released at once by any rank's failure (raises the agreed error), up to
        the arrival bound for ranks in no call or another one (raises, naming them),
        and up to the call's timeout for ranks in this call. A rank that went on to
        this call's next round without posting will not post it (its plan differs, and
        that round says so): its fact is ``None``."""
        if not self.distributed or not ranks:
            return [None] * len(ranks)
        keys = [_fact_key(name, r) for r in ranks]
        start = time.monotonic()
        arrival = min(self.timeout, _ARRIVAL["timeout"]).total_seconds()
        skipped: set[int] = set()
        while True:
            waiting = [k for r, k in zip(ranks, keys) if r not in skipped]
            try:
                if waiting:
                    self.store.wait(waiting, _FACT_POLL)
                break
            except Exception:
                pass
            if self.any_failed():
                self.raise_failures()
            missing = [
                r for r, k in zip(ranks, keys) if r not in skipped and not self.store.check([k])
            ]
            nxt = f"{self.rounds + 1}/at/"
            skipped.update(r for r in missing if self.store.check([self._key(nxt + str(r))]))
            missing = [r for r in missing if r not in skipped]
            spent = time.monotonic() - start
            late = spent > arrival and not all(self._in_this_call(r) for r in missing)
            if missing and (late or spent > self.timeout.total_seconds()):
                self.fail(self._missing_error(f"{name} facts", missing))
                self.raise_failures(missing)
        present = [k for r, k in zip(ranks, keys) if r not in skipped]
        got = dict(zip(present, self.store.multi_get(present))) if present else {}
        return [got[k].decode() if k in got else None for k in keys]

    # ----------------------------------------------------------------- rounds

    def round(
        self,
        name: str,
        *,
        same: str | None = None,
        payload: Any = None,
        gather: str = "none",
        count: int | None = None,
        agree: dict[str, str] | None = None,
    ) -> list[Any] | Any:
        """One bounded agreement of every rank.

        Args:
            name: what the ranks agree on (named in errors).
            same: a value every rank must hold (e.g. the plan fingerprint); a rank
                holding another one fails the round with a CollectiveError.
            payload: posted by this rank (pickled; small).
            gather: ``"none"``; ``"rank0"`` returns rank 0's payload; ``"all"`` returns
                every rank's, in rank order; ``"to0"``: every rank's to rank 0, rank
                0's to the others.
            count: an integer each rank adds; the sum over ranks is ``self.count``
                after the round (e.g. how many ranks can see a file).
            agree: arguments every rank must have passed alike (e.g. ``{"path": ...}``);
                a rank holding other values fails the round, the error naming both.

        Raises:
            The agreed error (see :class:`Call`) when any rank failed, now or earlier
            in this call, or did not arrive within the timeout.
        """
        self.rounds += 1
        STATS["rounds"] += 1
        if not self.distributed:
            if self.failure is not None:
                self.raise_failures()
            self.count = count or 0
            return [payload] if gather in ("all", "to0") else payload
        k = f"{self.rounds}/"
        try:
            if count is not None:
                self.store.add(self._key(k + "count"), int(count))
            if self.rounds == 1 and self.failure is None:
                self._same_verb()  # first: ranks in different verbs differ in all else too
            if self.failure is None:
                # Every round carries its name: ranks whose calls took different
                # sequences of rounds get one error naming both, never a payload of one
                # round read as another's.
                args = json.dumps(agree, sort_keys=True) if agree else ""
                mine = f"{name}{_SEP}{same or ''}{_SEP}{args}".encode()
                first = self.store.compare_set(self._key(k + "same"), "", mine)
                if first != mine:
                    self.fail(self._disagreement(name, same, agree, first.decode()))
            self._set(k + f"at/{self.rank}", pickle.dumps(payload))
            if self.rank == 0:  # counters every rank touched: rank 0 removes them later
                _KEYS.extend(self._key(k + s) for s in ("n", "same", "all"))
            if self.store.add(self._key(k + "n"), 1) == self.world:
                self.store.set(self._key(k + "all"), b"1")
            missing = self._wait_all(k)
        except ShardGatherError:
            raise
        except Exception as exc:  # the store itself failed: its host (rank 0) is gone
            self.failure = self.failure or exc
            raise agreed_error(
                self.what,
                [
                    {
                        "rank": self.rank,
                        "type": None,
                        "message": f"lost the store ({_describe(exc)})",
                    }
                ],
                [],
            ) from exc
        if missing or self.failure is not None or self.store.add(self._key("nfailed"), 0) > 0:
            if missing:
                self.fail(self._missing_error(name, missing))
            self.raise_failures(missing)
        if count is not None:
            self.count = self.store.add(self._key(k + "count"), 0)
            if self.rank == 0:
                _KEYS.append(self._key(k + "count"))
        if self.rounds == 1:
            _forget_earlier_calls(self)
        # Payloads come from the other ranks of this job, through its own store: as
        # trusted as torch's object collectives, which pickle the same way.
        if gather == "rank0" or (gather == "to0" and self.rank != 0):
            return pickle.loads(self.store.get(self._key(k + "at/0")))
        if gather in ("all", "to0"):
            keys = [self._key(k + f"at/{r}") for r in range(self.world)]
            return [pickle.loads(v) for v in self.store.multi_get(keys)]
        return None

    def _disagreement(
        self, name: str, same: str | None, agree: dict[str, str] | None, theirs: str
    ) -> CollectiveError:
        their_name, _, rest = theirs.partition(_SEP)
        their_same, _, their_args = rest.partition(_SEP)
        if their_name == name and their_same == (same or ""):
            other = json.loads(their_args) if their_args else {}
            mine = agree or {}
            label = next(k for k in sorted({*mine, *other}) if mine.get(k) != other.get(k))
            return CollectiveError(
                f"ranks passed different {label}s to {self.what}: {other.get(label)!r} on "
                f"another rank, {mine.get(label)!r} on rank {self.rank}. Every rank must "
                f"pass the same {label} (rank 0's would otherwise win silently)."
            )
        if their_name != name:
            return CollectiveError(
                f"ranks took different steps in {self.what}: its round {self.rounds} is "
                f"{their_name!r} on another rank and {name!r} on rank {self.rank}. This is a "
                "bug of shardgather's (every rank must decide its rounds alike): please "
                "report it; the next call starts afresh."
            )
        return CollectiveError(
            f"ranks hold different {name} ({their_same} on another rank, "
            f"{same} here): the model is not the same on every rank (different "
            "wrapping, shapes, process groups, or an optimizer's param "
            "groups). Every rank must call shardgather with the same "
            "sharded model (and optimizer)."
        )

    def _wait_all(self, k: str) -> list[int]:
        """Wait until every rank arrived at round ``k`` or any rank failed (returns [];
        the caller reads the latch), or the timeout passed (returns who is missing).

        A blocking wait in the store (it answers the moment the key appears, no polling
        delay): a failing rank sets this key itself after posting its error (see
        :meth:`fail`), so waiters wake at once and find the latch set."""
        done = self._key(k + "all")
        first = min(self.timeout, _ARRIVAL["timeout"]) if self.rounds == 1 else self.timeout
        try:
            self.store.wait([done], first)
            return []
        except Exception:
            if self.store.check([done]):  # raised only now (and the store answers)
                return []
        missing = self._absent(k)
        if first < self.timeout and missing and all(self._in_this_call(r) for r in missing):
            # They are in this very call (building their plan...): a slow rank, not a
            # mistake. Wait for them up to the call's own timeout.
            try:
                self.store.wait([done], self.timeout - first)
                return []
            except Exception:
                if self.store.check([done]):
                    return []
            missing = self._absent(k)
        return missing

    def _absent(self, k: str) -> list[int]:
        return [r for r in range(self.world) if not self.store.check([self._key(k + f"at/{r}")])]

    def _where(self, r: int) -> str:
        """Which shardgather call rank ``r`` is in ("<id>:<verb>"; "": none)."""
        try:
            key = _where_key(r)
            return self.store.get(key).decode() if self.store.check([key]) else ""
        except Exception:
            return ""

    def _in_this_call(self, r: int) -> bool:
        return self._where(r) == f"{self.id}:{self.what}"

    def _missing_error(self, name: str, missing: list[int]) -> CollectiveError:
        err = CollectiveError(self._missing_message(name, missing))
        err._shardgather_missing = True  # type: ignore[attr-defined]
        return err

    def _missing_message(self, name: str, missing: list[int]) -> str:
        where = []
        for r in missing:
            at = self._where(r)
            verb = at.split(":", 1)[1] if at else ""
            if not at:
                where.append(f"rank {r} is not in any shardgather call")
            elif at == f"{self.id}:{self.what}":
                where.append(
                    f"rank {r} is in {verb} too but still busy in an earlier step (its next "
                    f"one: {name!r}): slow, or stuck"
                )
            else:
                n = at.split(":", 1)[0]
                where.append(
                    f"rank {r} is in another shardgather call ({verb}, its call #{n}; "
                    f"this is call #{self.id})"
                )
        waited = min(self.timeout, _ARRIVAL["timeout"]) if self.rounds == 1 else self.timeout
        call_text = self.what if "." in self.what else f"sg.{self.what}"
        return (
            f"gave up waiting for the other ranks after {waited}: "
            + "; ".join(where)
            + f". Rank {self.rank} is in {self.what}: every rank of the process group must "
            "make the same shardgather calls in the same order (they are collective: not "
            f"`if rank == 0: {call_text}(...)` — every rank calls it, and "
            "rank 0 writes or receives). A rank that legitimately arrives later: "
            "sg.set_arrival_timeout(seconds)."
        )

    def _same_verb(self) -> None:
        """The ranks are in the same verb: a mismatch (one rank saving, another loading,
        or one call missing on some rank) is named here, before any payload is read."""
        mine = self.what.encode()
        first = self.store.compare_set(self._key("verb"), "", mine)
        if self.rank == 0:
            _KEYS.append(self._key("verb"))
        if first != mine:
            self.fail(
                CollectiveError(
                    f"ranks are in different shardgather calls: {first.decode()} on another "
                    f"rank, {self.what} on rank {self.rank}. Every rank of the process group "
                    "must make the same shardgather calls in the same order."
                )
            )

    # ----------------------------------------------------------------- data waits

    def wait(self, work: Any, what: str, peer: int | None = None) -> None:
        """Wait for one data transfer (bounded by the timeout). When it fails — a peer
        failed (and closed the data group), died, or is stuck — raise the agreed error."""
        try:
            ok = work.wait(self.timeout)
            cause: BaseException | None = None
        except Exception as exc:
            ok, cause = False, exc
        if ok is not False:
            return
        mark_data_group_broken(self)
        # A peer that failed posted its error before closing the group: name it.
        records = self._failures() if self.distributed else []
        if not records:
            who = f"rank {peer}" if peer is not None else "a peer"
            reason = _describe(cause) if cause is not None else "timed out"
            self.fail(
                CollectiveError(
                    f"{what}: no data from {who} within {self.timeout} ({reason}): it is "
                    "stuck, dead, or failed"
                )
            )
        self.raise_failures()


def _where_key(r: int) -> str:
    return f"{_PREFIX}where/{r}"


def _fact_key(name: str, r: int) -> str:
    return f"{_PREFIX}fact/{name}/{r}"


# How often a wait for facts looks at the latch (the wait itself ends when they appear).
_FACT_POLL = datetime.timedelta(milliseconds=50)


def _multi_set(store: Any, keys: list[str], values: list[str]) -> None:
    """One store operation where the store has it (torch >= 2.3), else one per key."""
    if hasattr(store, "multi_set"):
        store.multi_set(keys, values)
    else:  # pragma: no cover - older torch
        for k, v in zip(keys, values):
            store.set(k, v)


def _forget_earlier_calls(call: Call) -> None:
    """Delete the store keys of this process's earlier calls: every rank has arrived at
    this call's first round, so none will read them again (the store would otherwise
    grow with every call of a long training run)."""
    mine = f"{_PREFIX}{call.id}/"
    keep = [k for k in _KEYS if k.startswith(mine)]
    for key in _KEYS:
        if not key.startswith(mine):
            try:
                call.store.delete_key(key)
            except Exception:
                break  # a store without deletion: keys simply stay
    _KEYS[:] = keep
    if call.rank == 0:
        _KEYS.append(call._key("nfailed"))


# ------------------------------------------------------------------------ data group

_DATA: dict[str, Any] = {"group": None, "generation": -1, "owner": None}


def data_group(call: Call) -> Any:
    """shardgather's own gloo group over every rank, on which host bytes travel.

    It is not one of torch's registered groups: a ``ProcessGroupGloo`` on the job's
    store under a prefix of ours, so making one changes nothing the training sees
    (torch's group numbering included). Its generation is a counter in the store that
    any rank bumps when the group breaks (a failed or timed-out call), before leaving
    that call: every rank reads the same value here, after the plan round, and a new
    generation means a new group. Collective: every rank calls it at the same point of
    the same call (the engine: right after the plan round, when the agreed transport
    needs it); making a group is preceded by a round, so that a rank that failed since
    the plan round is noticed at once rather than by the connect's timeout.
    """
    if not call.distributed:
        return None  # one rank: nothing travels
    call.uses_data_group = True
    owner = (id(dist.group.WORLD), call.world)
    generation = int(call.store.add(f"{_PREFIX}data-generation", 0))
    if _DATA["owner"] == owner and _DATA["generation"] == generation and _DATA["group"]:
        return _DATA["group"]
    # The old one is dropped; the generation is recorded only with a group made, so a
    # rank that failed in between builds anew with the others next time.
    _DATA.update(group=None, generation=-1, owner=owner)
    call.round("data group")
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = call.timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    store = dist.PrefixStore(f"{_PREFIX}data/{generation}/", call.store)
    group = dist.ProcessGroupGloo(store, call.rank, call.world, opts)
    _DATA.update(group=group, generation=generation)
    STATS["data_groups"] += 1
    return group


@atexit.register
def _drop_data_group() -> None:
    """Destroy the data group while the interpreter is still whole. Left to the end of
    the process, the group (not one of torch's: destroy_process_group() does not know
    it) was torn down with its gloo threads still running, and about one exit in four
    aborted with "terminate called without an active exception" — SIGABRT after a
    successful script, which torchrun reports as a failed job."""
    group = _DATA["group"]
    _DATA.update(group=None, owner=None, generation=-1)
    if group is None:
        return
    with contextlib.suppress(Exception):
        group.shutdown()
    del group
    gc.collect()


def send(group: Any, t: torch.Tensor, dst: int, tag: int) -> Any:
    """Post one message on the data group (global ranks; ``t`` contiguous, on the CPU)."""
    STATS["messages"] += 1
    STATS["bytes_sent"] += t.numel() * t.element_size()
    return group.send([t], dst, tag)


def recv(group: Any, t: torch.Tensor, src: int, tag: int) -> Any:
    STATS["messages"] += 1
    STATS["bytes_received"] += t.numel() * t.element_size()
    return group.recv([t], src, tag)


def mark_data_group_broken(call: Call) -> None:
    """The next call makes a new data group (every rank: see :func:`data_group`)."""
    if call.distributed and call.uses_data_group and not call.marked_broken:
        call.marked_broken = True
        with contextlib.suppress(Exception):
            call.store.add(f"{_PREFIX}data-generation", 1)


def _poison_data_group(call: Call) -> None:
    """Close every connection of the data group from this rank (see the module doc)."""
    if call.poisoned:
        return
    call.poisoned = True
    mark_data_group_broken(call)
    group = _DATA["group"]
    if group is None:
        return
    peer = (call.rank + 1) % call.world
    with contextlib.suppress(Exception):
        group.recv([torch.empty(1)], peer, _POISON_TAG).wait(datetime.timedelta(milliseconds=1))


# ------------------------------------------------------------------------ hosts


def host_id() -> str:
    """What identifies "the same host" (a shared page cache and memory). Hostname plus
    boot id; ``SHARDGATHER_HOST_ID`` overrides it (containers sharing one hostname but
    not memory, or tests that pretend ranks live on several hosts)."""
    override = os.environ.get("SHARDGATHER_HOST_ID")
    if override:
        return override
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """``with counting() as c: ...`` then ``c["rounds"]`` etc.: what the block issued."""
    before = dict(STATS)
    out: dict[str, int] = {}
    try:
        yield out
    finally:
        out.update({k: STATS[k] - before[k] for k in STATS})
