"""Builds genie._C, the native half of the remote_accelerator device, against the installed torch.

Everything else about the package is in pyproject.toml. Install with
``pip install --no-build-isolation -e .`` so the build sees the venv's torch==2.13.0.
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "genie._C",
            ["genie/csrc/device.cpp"],
            # The kernels only move metadata: -O1 compiles much faster than -O2 and runs the same.
            extra_compile_args=["-O1", "-g0"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
