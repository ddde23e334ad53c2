"""The optional compiled core (kvagent/_native/_ingest.pyx, _columns.pyx, _store.pyx); everything else is in pyproject.toml.

``pip install .`` compiles it with Cython when a C compiler is there. Without one (or if the compile fails
for any other reason) the build goes on without it and kvagent runs its pure-Python path; ``kvagent
--version`` says which (``native core: yes`` / ``no (reason)``), and ``kvagent serve`` logs a warning.

XXH3 (the per-block token hash of ``_ingest.pyx``) comes from the system's libxxhash when its header is found
(Debian: libxxhash-dev; pkg-config's flags when it knows the library), compiled in from that header; else the
native pass calls the ``xxhash`` package (a dependency anyway). ``KVAGENT_XXHASH=system`` requires the
library (the build of ``_ingest`` fails without it), ``KVAGENT_XXHASH=package`` skips it (to measure the
fallback: docs/performance.md).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_FLAGS = ["-O3"] if sys.platform != "win32" else []
NATIVE = [
    # The ingest pass: payload -> placement events, the coordinator's plain-chunk pass, the event-plane encoder.
    Extension(
        "kvagent._native._ingest",
        ["kvagent/_native/_ingest.pyx"],
        depends=["kvagent/_native/_support.h"],
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


XXHASH_PROBE = """
#define XXH_INLINE_ALL
#include <xxhash.h>
int main(void) { return (int)(XXH3_64bits_withSeed("kvagent", 7, 1337) & 1); }
"""


def pkg_config_xxhash() -> list[str]:
    """pkg-config's compile flags for libxxhash ([] when pkg-config or its .pc file is absent)."""
    if shutil.which("pkg-config") is None:
        return []
    found = subprocess.run(
        ["pkg-config", "--cflags", "libxxhash"], capture_output=True, text=True, check=False
    )
    return shlex.split(found.stdout) if found.returncode == 0 else []


class OptionalBuildExt(build_ext):
    """Builds the core if it can; any failure (no compiler, no Python headers) leaves the pure-Python path."""

    def build_extensions(self) -> None:
        for ext in self.extensions:
            if ext.name == "kvagent._native._ingest":
                self._use_system_xxhash(ext)
        super().build_extensions()

    def _use_system_xxhash(self, ext: Extension) -> None:
        """Compile libxxhash's XXH3 into ``ext`` when its header compiles here; else the package fallback."""
        choice = os.environ.get("KVAGENT_XXHASH", "")
        if choice == "package":
            self.announce("kvagent: XXH3 from the xxhash package (KVAGENT_XXHASH=package)", level=2)
            return
        flags = pkg_config_xxhash()
        includes = [flag[2:] for flag in flags if flag.startswith("-I")]
        if self._compiles(XXHASH_PROBE, includes):
            ext.include_dirs = [*ext.include_dirs, *includes]
            ext.define_macros = [*ext.define_macros, ("KVAGENT_SYSTEM_XXHASH", "1")]
            self.announce("kvagent: XXH3 from the system's libxxhash", level=2)
        elif choice == "system":
            raise RuntimeError("KVAGENT_XXHASH=system but libxxhash's header (xxhash.h) does not compile")
        else:
            self.warn("kvagent: libxxhash not found (Debian: libxxhash-dev); XXH3 from the xxhash package")

    def _compiles(self, source: str, include_dirs: list[str]) -> bool:
        with tempfile.TemporaryDirectory() as scratch:
            probe = Path(scratch) / "xxhash_probe.c"
            probe.write_text(source)
            try:
                self.compiler.compile([str(probe)], output_dir=scratch, include_dirs=include_dirs)
            except Exception:  # noqa: BLE001 - CompileError, or no usable compiler at all
                return False
        return True

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
