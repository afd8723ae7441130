"""Builds genie._C, the native half of the remote_accelerator device, against the installed torch, and
genie._C_plans, the server's native plan runner, and genie._C_keys, the server's command signatures (plain
CPython, no torch: it compiles in about a second).

Everything else about the package is in pyproject.toml. Install with
``pip install --no-build-isolation -e .`` so the build sees the venv's torch==2.13.0.
"""

import os

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "genie._C",
            ["genie/csrc/device.cpp", "genie/csrc/fastpath.cpp", "genie/csrc/host_pool.cpp", "genie/csrc/lane.cpp",
             "genie/csrc/graph.cpp", "genie/csrc/sdpa.cpp"],
            # The kernels only move metadata: -O1 compiles much faster than -O2 and runs the same.
            extra_compile_args=["-O1", "-g0"],
        ),
        # The server's native plan runner: a torch extension of its own, so genie._C stays the client device's.
        CppExtension("genie._C_plans", ["genie/csrc/server_plans.cpp"], extra_compile_args=["-O2", "-g0"]),
        Extension("genie._C_keys", ["genie/csrc/server_keys.cpp"], extra_compile_args=["-O2", "-g0", "-std=c++17"],
                  language="c++"),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
    # The extensions compile side by side, one per core (pip's builds too): 101 -> 73 s on 2 cores.
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
