"""The optional compiled ingest core (kvagent/_native/_ingest.pyx); everything else is in pyproject.toml.

``pip install .`` compiles it with Cython when a C compiler is there. Without one (or if the compile fails)
the build goes on without it — ``optional=True`` — and kvagent runs its pure-Python path; ``kvagent
--version`` says which (``native core: yes`` / ``no (reason)``).
"""

from __future__ import annotations

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # a build without Cython (it is in build-system.requires, so only a hand-made one)
    extensions = []
else:
    extensions = cythonize(
        [
            Extension(
                "kvagent._native._ingest",
                ["kvagent/_native/_ingest.pyx"],
                depends=["kvagent/_native/_support.h", "kvagent/_native/xxhash.h"],
                include_dirs=["kvagent/_native"],
                extra_compile_args=["-O3"],
                optional=True,
            )
        ],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )

setup(ext_modules=extensions)
