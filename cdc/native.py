"""cdc's compiled modules (Cython, built from their ``.pyx`` by ``make setup`` / ``pip install -e .``):
each keeps a Python reference path, which runs where the module is not there."""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["load"]


def load(name: str, abi: int) -> tuple[Any, str]:
    """(the compiled module ``name``, or None, and why not): None with ``CDC_NATIVE=0`` (the
    reference paths, forced), when it was not built, or when it was built from an older source (its
    ``ABI`` is not ``abi``, the interface its caller drives)."""
    if os.environ.get("CDC_NATIVE", "1") == "0":
        return None, "CDC_NATIVE=0"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, f"not built: {exc}"
    if getattr(module, "ABI", None) != abi:
        return None, f"built from an older source (ABI {getattr(module, 'ABI', None)}, not {abi})"
    return module, ""
