"""The exceptions shardgather raises. Catch :class:`ShardGatherError` for all of them."""

from __future__ import annotations


class ShardGatherError(RuntimeError):
    """Base class: every error shardgather raises on purpose is one of these."""


class BuildError(ShardGatherError):
    """The compiled library could not be loaded (see the message for how to rebuild)."""


class UnsupportedModelError(ShardGatherError):
    """The model uses a setup shardgather cannot gather (e.g. a ``Partial`` DTensor placement)."""


class CollectiveError(ShardGatherError):
    """A collective failed or timed out, or the ranks disagreed about the plan."""


class ConsumerError(CollectiveError):
    """An inference-side receiver refused the layout or failed while applying weights."""


class CheckpointError(ShardGatherError):
    """A checkpoint file is missing, truncated, corrupt or not of a supported format."""


class StateDictMismatchError(ShardGatherError):
    """A checkpoint does not match the model: missing/unexpected keys, shapes or dtypes.

    Attributes:
        missing_keys: clean names the model has and the checkpoint lacks.
        unexpected_keys: clean names the checkpoint has and the model lacks.
        mismatched: ``{key: reason}`` for shape or dtype mismatches.
    """

    def __init__(
        self,
        message: str,
        missing_keys: list[str] | None = None,
        unexpected_keys: list[str] | None = None,
        mismatched: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing_keys = list(missing_keys or [])
        self.unexpected_keys = list(unexpected_keys or [])
        self.mismatched = dict(mismatched or {})


def by_name(name: str | None) -> type[ShardGatherError] | None:
    """The ShardGatherError subclass called ``name`` (as :func:`qualified` writes it),
    wherever it is defined; None when there is none. Only ShardGatherError's own
    subclasses are looked at: a name from another rank cannot reach anything else."""
    if not name:
        return None
    todo: list[type[ShardGatherError]] = [ShardGatherError]
    while todo:
        cls = todo.pop()
        if qualified(cls) == name or cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
