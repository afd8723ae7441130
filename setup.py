"""Builds genie._C, the native half of the remote_accelerator device, against the installed torch, and
genie._C_plans, the server's native plan runner, and genie._C_keys, the server's command signatures (plain
CPython, no torch: it compiles in about a second).

Everything else about the package is in pyproject.toml. Install with
``pip install --no-build-isolation -e .`` so the build sees the venv's torch==2.13.0.
"""

import os

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "genie/csrc"  # laid out like the Python: device/ (genie._C), server/ (genie._C_plans, genie._C_keys), wire/
INCLUDE = [os.path.join(HERE, "genie", "csrc")]  # sources include "device/guard.h", "wire/msgpack.h", ...
DEVICE = ["bindings", "allocator", "pinned_allocator", "guard", "generator", "meta_kernels", "autocast", "tensor_wire",
          "fastpath", "lane", "host_pool", "graph", "sdpa"]
PLANS = ["plans_module", "runner", "runner_binding"]

setup(
    ext_modules=[
        CppExtension(
            "genie._C",
            [f"{CSRC}/device/{name}.cpp" for name in DEVICE],
            include_dirs=INCLUDE,
            # The kernels only move metadata: -O1 compiles much faster than -O2 and runs the same.
            extra_compile_args=["-O1", "-g0"],
        ),
        # The server's native plan runner: a torch extension of its own, so genie._C stays the client device's.
        CppExtension("genie._C_plans", [f"{CSRC}/server/{name}.cpp" for name in PLANS], include_dirs=INCLUDE,
                     extra_compile_args=["-O2", "-g0"]),
        Extension("genie._C_keys", [f"{CSRC}/server/keys_module.cpp"], include_dirs=INCLUDE,
                  extra_compile_args=["-O2", "-g0", "-std=c++17"], language="c++"),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
    # The extensions compile side by side, one per core (pip's builds too): 101 -> 73 s on 2 cores.
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
