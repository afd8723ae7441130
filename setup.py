"""Builds genie._C, the native half of the remote_accelerator device, against the installed torch, and
genie._C_plans, the server's native plan runner, and genie._C_keys, the server's command signatures (plain
CPython, no torch: it compiles in about a second).

Everything else about the package is in pyproject.toml. Install with
``pip install --no-build-isolation -e .`` so the build sees the venv's torch==2.13.0.
"""

import os
import shutil
import sys

from setuptools import Extension, setup

# Building imports torch, whose backend autoload would import an installed genie (an editable install: this
# tree) with its previous genie._C, which may lack what the new Python code calls: the build fails. Not needed
# to build.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "genie/csrc"  # laid out like the Python: device/ (genie._C), server/ (genie._C_plans, genie._C_keys), wire/
INCLUDE = [os.path.join(HERE, "genie", "csrc")]  # sources include "device/guard.h", "wire/msgpack.h", ...
DEVICE = ["bindings", "allocator", "pinned_allocator", "guard", "generator", "meta_kernels", "autocast", "tensor_wire",
          "fastpath", "lane", "host_pool", "graph", "sdpa"]
PLANS = ["plans_module", "runner", "runner_binding", "graph_program"]

# ninja compiles every source file of an extension side by side (genie._C has 13); the venv's own ninja
# (scripts/bootstrap installs it) is found when pip runs this from a shell whose PATH lacks the venv.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# torch forces a rebuild under ninja (ninja's own records then skip what is up to date); GENIE_BUILD_NINJA=0 keeps
# setuptools' check instead, for a tree whose extensions were compiled elsewhere (tests/cli/test_core_install.py).
NINJA = shutil.which("ninja") is not None and os.environ.get("GENIE_BUILD_NINJA", "1") != "0"
os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

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
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=NINJA)},
    # Without ninja, the extensions compile side by side, one per core (101 -> 73 s on 2 cores), each file after
    # the other; with it, one extension at a time, its files MAX_JOBS at once.
    options={"build_ext": {"parallel": 1 if NINJA else os.cpu_count() or 1}},
)
