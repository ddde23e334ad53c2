"""The optional compiled core (kvagent/_native/_ingest.pyx, _columns.pyx, _store.pyx); everything else is in pyproject.toml.

``pip install .`` compiles it with Cython when a C compiler is there. Without one (or if the compile fails
for any other reason) the build goes on without it and kvagent runs its pure-Python path; ``kvagent
--version`` says which (``native core: yes`` / ``no (reason)``), and ``kvagent serve`` logs a warning.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_FLAGS = ["-O3"] if sys.platform != "win32" else []
NATIVE = [
    # The ingest pass: payload -> placement events, the coordinator's plain-chunk pass, the event-plane encoder.
    Extension(
        "kvagent._native._ingest",
        ["kvagent/_native/_ingest.pyx"],
        depends=["kvagent/_native/_support.h", "kvagent/_native/xxhash.h"],
        include_dirs=["kvagent/_native"],
        extra_compile_args=_FLAGS,
        optional=True,
    ),
    # The columnar ring's append and the answers encoded from its columns (index/ring.py, recovery/dump.py).
    Extension(
        "kvagent._native._columns", ["kvagent/_native/_columns.pyx"], extra_compile_args=_FLAGS, optional=True
    ),
    # The recovery index's block store (a C hash table, no Python object per block) and its apply_run loop.
    Extension(
        "kvagent._native._store", ["kvagent/_native/_store.pyx"], extra_compile_args=_FLAGS, optional=True
    ),
    Extension("kvagent._native._stream", ["kvagent/_native/_stream.pyx"], extra_compile_args=_FLAGS, optional=True),
]


class OptionalBuildExt(build_ext):
    """Builds the core if it can; any failure (no compiler, no Python headers) leaves the pure-Python path."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - whatever the toolchain raises, the install goes on
            self._skipped(error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            self._skipped(error)

    def _skipped(self, error: Exception) -> None:
        self.warn(f"kvagent: the native core was not built ({error}); installing the pure-Python path")


try:
    from Cython.Build import cythonize
except ImportError:  # a build without Cython (it is in build-system.requires, so only a hand-made one)
    extensions: list[Extension] = []
else:
    extensions = cythonize(NATIVE, compiler_directives={"language_level": "3"}, quiet=True)
    for extension in extensions:
        extension.optional = True  # cythonize does not carry the flag over

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
