"""Hatch build hook: compile genie-dpdk's C shim (cffi API mode) when DPDK's development files are here.

Without ``libdpdk-dev`` (``pkg-config libdpdk``) or a C compiler the wheel is built
without the shim: genie-dpdk installs, and its probe says "DPDK headers/libs not
found" with the fix. See ``src/genie_dpdk/_build.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ShimBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        package = Path(self.root) / "src" / "genie_dpdk"
        spec = importlib.util.spec_from_file_location("_genie_dpdk_build", package / "_build.py")
        assert spec is not None and spec.loader is not None
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        try:
            built = builder.build(package)  # in place: an editable install imports it from src/
        except Exception as exc:  # a compiler error must not stop the install: the probe explains
            print(f"genie-dpdk: the DPDK shim did not compile ({exc}); the data path is unavailable", file=sys.stderr)
            return
        if built is None:
            print("genie-dpdk: DPDK development files not found (apt install libdpdk-dev pkg-config); "
                  "installing without the data path", file=sys.stderr)
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            build_data["force_include"][str(built)] = f"genie_dpdk/{built.name}"
