"""Builds the compiled per-change path (:mod:`cdc.codec._native`, Cython -> C), the batch's compiled
records (:mod:`cdc.logstore._records`) and the embedded store's compiled append
(:mod:`cdc.logstore.embedded._pack`); everything else is
in pyproject.toml. Without a C compiler or Cython the package still installs: cdc then runs its
Python path and says so (``cdc check``)."""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed build of the extension is a warning, not an install failure (CDC_NATIVE_REQUIRED=1
    makes it one: CI, to notice a machine that lost its compiler)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            self._failed(exc)

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc)

    @staticmethod
    def _failed(exc: Exception) -> None:
        if os.environ.get("CDC_NATIVE_REQUIRED") == "1":
            raise exc
        sys.stderr.write(
            f"warning: the compiled per-change path (cdc.codec._native) was not built: {exc}; "
            "cdc runs its Python path (install gcc and python3-dev, then `make setup` again)\n"
        )


def extensions() -> list:  # type: ignore[type-arg]
    try:
        from Cython.Build import cythonize
    except ImportError:
        sys.stderr.write("warning: Cython is not installed: cdc.codec._native is not built\n")
        return []
    return cythonize(
        ["cdc/logstore/_records.pyx", "cdc/codec/_native.pyx", "cdc/logstore/embedded/_pack.pyx"],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
