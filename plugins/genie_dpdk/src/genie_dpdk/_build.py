"""Compile the DPDK shim (``shim.c``) into ``genie_dpdk/_shim*.so`` with cffi's API mode.

Run at install by the plugin's hatch build hook (``hatch_build.py``) and by hand as
``python -m genie_dpdk._build`` (it prints where the module went, or why not). It
needs a C compiler and DPDK's development files (Debian: ``apt install
libdpdk-dev``, found through ``pkg-config libdpdk``). Without them nothing is built:
the plugin still installs and its probe says "DPDK headers/libs not found".
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = "_shim"

CDEF = """
typedef struct gd_chan gd_chan;
int gd_eal_init(int argc, char **argv);
const char *gd_strerror(int err);
const char *gd_version(void);
int gd_port_open(const char *name, const char *args, uint32_t mtu, uint32_t nmbufs);
int gd_port_mac(uint16_t port, uint8_t *out);
int gd_port_link_up(uint16_t port);
void gd_port_close(uint16_t port, const char *name);
gd_chan *gd_chan_new(uint16_t port, uint32_t id, uint8_t dir, const uint8_t *peer_mac, uint32_t mss, int ctl_fd);
int gd_chan_peer_gone(gd_chan *c);
void gd_chan_set_loss(gd_chan *c, uint32_t ppm, uint64_t seed);
void gd_chan_close(gd_chan *c);
void gd_chan_free(gd_chan *c);
int gd_chan_stats(gd_chan *c, uint64_t *out);
int gd_send_post(gd_chan *c, const uint8_t *buf, uint64_t len);
int gd_send_wait(gd_chan *c, double slice);
void gd_fail(gd_chan *c);
int64_t gd_recv(gd_chan *c, uint8_t *buf, uint64_t len, double slice);
int gd_engine_start(void);
int gd_faults_recovered(void);
void gd_engine_stop(void);
int gd_engine_running(void);
"""

#: Libraries the shim links beyond ``pkg-config --libs libdpdk`` (vdev hot-plug lives in a bus driver).
EXTRA_LIBS = ("rte_bus_vdev",)


def pkg_config() -> tuple[list[str], list[str]] | None:
    """(cflags, libs) of libdpdk, or None when pkg-config or libdpdk-dev is missing."""
    if shutil.which("pkg-config") is None:
        return None
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "libdpdk"], capture_output=True, text=True, check=True,
                                timeout=30).stdout.split()
        libs = subprocess.run(["pkg-config", "--libs", "libdpdk"], capture_output=True, text=True, check=True,
                              timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return cflags, libs


def ffibuilder() -> object | None:
    """The cffi builder of the shim, or None when DPDK's development files are missing."""
    flags = pkg_config()
    if flags is None:
        return None
    import cffi

    cflags, libs = flags
    # -march=corei7 from DPDK's pkg-config is what Debian's DPDK was built for; keep it.
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        f"genie_dpdk.{MODULE}", '#include "shim.c"',
        include_dirs=[str(HERE)],
        extra_compile_args=[*cflags, "-O2", "-Wno-unused-function", "-Wno-deprecated-declarations"],
        extra_link_args=[*libs, *(f"-l{lib}" for lib in EXTRA_LIBS)],
    )
    return ffi


def build(target_dir: Path | None = None) -> Path | None:
    """Compile the shim into ``target_dir`` (default: this package's directory); its path, or None."""
    ffi = ffibuilder()
    if ffi is None:
        return None
    with tempfile.TemporaryDirectory(prefix="genie-dpdk-build-") as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))  # type: ignore[attr-defined]
        dest = (target_dir or HERE) / built.name
        shutil.copy2(built, dest)
    return dest


def main() -> int:
    path = build()
    if path is None:
        print("genie-dpdk: DPDK development files not found (pkg-config libdpdk): apt install libdpdk-dev; "
              "the shim was not built", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
