"""The compiled per-change path is built wherever ``make setup`` ran (gcc and the Python headers are
there): a build that failed is a warning at install time and the differential tests of
``test_native.py`` skip, so this test is what notices it. ``CDC_NATIVE=0`` asks for the Python path."""

from __future__ import annotations

import os

import pytest

from cdc.codec.compiled import native_module, native_status


@pytest.mark.skipif(os.environ.get("CDC_NATIVE") == "0", reason="CDC_NATIVE=0: the Python path was asked for")
def test_the_compiled_path_is_built() -> None:
    assert native_module() is not None, native_status()[1]
