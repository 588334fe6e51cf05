"""Loads the compiled ops and records what was built.

``SHARDGATHER_ALLOW_FALLBACK=1`` lets shardgather run on the pure-torch reference
(slow, same results) when the compiled library cannot be loaded: it then warns once
instead of raising :class:`~shardgather.errors.BuildError`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .errors import BuildError

_LOADED: bool | None = None
_LOAD_ERROR: str | None = None
_WARNED = False


def _load() -> bool:
    global _LOADED, _LOAD_ERROR
    if _LOADED is None:
        try:
            from . import _C  # noqa: F401  (registers torch.ops.shardgather.*)

            _LOADED = True
        except ImportError as exc:  # missing .so, ABI mismatch with this torch, ...
            _LOADED = False
            _LOAD_ERROR = f"{type(exc).__name__}: {exc}"
    return _LOADED


def compiled_available() -> bool:
    """Whether the compiled ops are loaded (``torch.ops.shardgather.*`` exist)."""
    return _load()


def require_compiled() -> bool:
    """True when the compiled ops can be used; False when falling back (warned once).

    Raises:
        BuildError: the library is missing and the fallback was not asked for.
    """
    global _WARNED
    if _load():
        return True
    if os.environ.get("SHARDGATHER_ALLOW_FALLBACK", "") == "1":
        if not _WARNED:
            warnings.warn(
                f"shardgather: compiled ops unavailable ({_LOAD_ERROR}); using the slow "
                "pure-torch reference because SHARDGATHER_ALLOW_FALLBACK=1",
                RuntimeWarning,
                stacklevel=3,
            )
            _WARNED = True
        return False
    raise BuildError(
        f"shardgather's compiled library could not be loaded ({_LOAD_ERROR}). It must be "
        f"built against the installed torch {torch.__version__}: run "
        "`pip install --no-build-isolation -e .` in the shardgather checkout (set "
        "TORCH_CUDA_ARCH_LIST when no GPU is visible), or set SHARDGATHER_ALLOW_FALLBACK=1 "
        "to run on the slow pure-torch reference."
    )


def build_info() -> dict[str, Any]:
    """What this installation was built with and what is loaded now.

    Returns:
        ``{"compiled": bool, "with_cuda": bool, "cuda_arch_list": str, "built_torch": str,
        "torch": str, "load_error": str | None}``.

    Example:
        >>> import shardgather
        >>> shardgather.build_info()["compiled"]
        True
    """
    info: dict[str, Any] = {
        "compiled": _load(),
        "with_cuda": False,
        "cuda_arch_list": "",
        "built_torch": None,
        "torch": torch.__version__,
        "load_error": _LOAD_ERROR,
    }
    try:
        from . import _build_info

        info["cuda_arch_list"] = _build_info.CUDA_ARCH_LIST
        info["built_torch"] = _build_info.TORCH_VERSION
    except ImportError:
        pass
    if info["compiled"]:
        from . import _C

        info["with_cuda"] = bool(_C.with_cuda())
    return info
