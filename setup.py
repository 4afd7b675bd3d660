"""attnkit's metadata is in pyproject.toml; this file only builds its C++ kernels ahead of time, when asked:

    ATTNKIT_BUILD_KERNELS=1 pip install --no-build-isolation -c constraints.txt -e .

(``--no-build-isolation``: the kernels build against the torch already installed, never one pip would fetch). Each
kernel is built from ``src/attnkit/csrc`` as ``attnkit/csrc/_<name>_<hash>``, the hash of what it was built from
(:func:`attnkit.csrc.source_hash`), so that a source changed later is built anew on first use instead. Without the
variable nothing is built here, and each kernel is built on first use (:func:`attnkit.csrc.load`)."""

import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("ATTNKIT_BUILD_KERNELS") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))
    from attnkit import csrc

    for name, source in csrc.KERNELS.items():
        ext_modules.append(
            CppExtension(
                f"attnkit.csrc._{name}_{csrc.source_hash(name)}",
                [os.path.join("src", "attnkit", "csrc", source)],
                include_dirs=[os.path.join("src", "attnkit", "csrc")],
                extra_compile_args=csrc.compile_flags(),
                extra_link_args=["-fopenmp"],
            )
        )
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
