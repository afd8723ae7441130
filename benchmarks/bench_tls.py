"""What TLS costs on the bulk path: 64 MiB up and down through genie, plain TCP vs TLS.

    python benchmarks/bench_tls.py [--mib 64] [--repeat 5]

An in-process DataPlaneServer (two CPU devices, a cluster token in both runs)
and the real client (NodeConnection) on loopback; each run uploads a tensor
and syncs, then fetches it back. Prints medians and the TLS/plain ratios
taken in the same run. Certificates are made on the spot with ``cryptography``.
Client and server share one process (and its GIL), as in genie's own tests;
the ratio is what to read, not the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from genie_tcp import TcpTransport  # noqa: E402

from genie.config import ClusterConfig  # noqa: E402
from genie.device.connection import NodeConnection  # noqa: E402
from genie.security import ClientSecurity  # noqa: E402
from genie.server import DataPlaneServer  # noqa: E402
from genie.transport.base import Channel  # noqa: E402
from genie.wire.handshake import secure_client_channel  # noqa: E402
from genie.wire.messages import CMD_FREE, hello_body  # noqa: E402
from tests.security.certs import make_pki  # noqa: E402

TOKEN = "bench-token"


def measure(server_options: dict, client_options: dict, nbytes: int, repeat: int) -> tuple[float, float]:
    server = DataPlaneServer(TcpTransport(), "127.0.0.1", 0, [torch.device("cpu")],
                             ClusterConfig.from_sources({}, auth_token=TOKEN, **server_options))
    server.start()
    try:
        security = ClientSecurity.from_config(ClusterConfig.from_sources({}, auth_token=TOKEN, **client_options))
        channel: Channel = TcpTransport().connect("127.0.0.1", server.port, timeout=5)
        channel.settimeout(30)
        if security.tls is not None:
            channel = secure_client_channel(channel, security.tls, server_hostname="127.0.0.1", where="bench")
        conn = NodeConnection(channel, node_id="bench", address="bench", op_timeout=60)
        conn.handshake(hello_body(node_id="bench", role="client", backends=["tcp"]), 5, token=security.token)
        data = torch.randn(nbytes // 4)
        ups, downs = [], []
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            conn.upload(i + 1, 0, data, overwrite=False)
            conn.sync()
            t1 = time.perf_counter()
            # [storage_id, dtype code (0: float32), sizes, strides, offset, storage_nbytes]
            back = conn.fetch(0, [i + 1, 0, [data.numel()], [1], 0, data.nbytes], torch.empty_like(data))
            t2 = time.perf_counter()
            conn.command([CMD_FREE, [i + 1]])
            if i:  # the first run warms up allocators and TLS session state
                ups.append(t1 - t0)
                downs.append(t2 - t1)
        assert torch.equal(back, data)
        conn.close()
        return statistics.median(ups), statistics.median(downs)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib << 20
    pki = make_pki(Path(tempfile.mkdtemp(prefix="genie-bench-tls-")))
    plain = measure({}, {}, nbytes, args.repeat)
    tls = measure({"tls_cert": pki.server_cert, "tls_key": pki.server_key}, {"tls_ca": pki.ca}, nbytes, args.repeat)
    print(f"{args.mib} MiB through genie on loopback, median of {args.repeat}")
    print(f"{'':10} {'upload':>12} {'download':>12}")
    for name, (up, down) in (("plain", plain), ("tls", tls)):
        print(f"{name:10} {args.mib / up:9.0f} MiB/s {args.mib / down:9.0f} MiB/s   "
              f"({up * 1000:.1f} ms, {down * 1000:.1f} ms)")
    print(f"{'tls/plain':10} {tls[0] / plain[0]:11.2f}x {tls[1] / plain[1]:11.2f}x   (time ratio; >1 is slower)")


if __name__ == "__main__":
    main()
