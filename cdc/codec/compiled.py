"""Whether the compiled per-change path (:mod:`cdc.codec._native`, driven by :mod:`cdc.codec.fastpath`)
is there: :func:`native_status`, what ``cdc check`` reports, without importing the codec that drives it
(the envelope, the decoders, the log store's records).
"""

from __future__ import annotations

from typing import Any

from cdc.native import load

__all__ = ["ABI", "native_module", "native_status"]

#: the compiled module's interface version (``cdc.codec._native.ABI``) :mod:`cdc.codec.fastpath` drives
ABI = 6


def _load() -> tuple[Any, str]:
    """(the compiled module or None, why not)."""
    return load("cdc.codec._native", ABI)


def native_module() -> Any:
    """The compiled module, or None (not built, or ``CDC_NATIVE=0``)."""
    return _load()[0]


def native_status() -> tuple[bool, str]:
    """(compiled, what to say): which per-change path a reader started now would run."""
    module, why = _load()
    if module is not None:
        return True, "compiled per-change path and libpq stream reader (cdc.codec._native)"
    if why == "CDC_NATIVE=0":
        return False, "Python per-change path (CDC_NATIVE=0)"
    return False, (
        f"Python per-change path: the compiled one (cdc.codec._native) is {why}; "
        "fix: install gcc and python3-dev, then `make setup` (or `pip install -e .`) again"
    )
