"""Run a benchmark with all of its ranks' traffic through an emulated link of limited bandwidth.

On one machine gloo ranks talk over loopback, where a "transfer" is a kernel memcpy done by the same CPU
cores that compute: communication never takes time the compute could hide, so schedules built to overlap
it (DualPipeV, ZeRO prefetch) cannot show what they do on a cluster, where NICs/NVLink move the bytes
while the cores compute. This wrapper gives the benchmark a network namespace of its own whose loopback
carries a token-bucket filter (``tc qdisc ... tbf``): every byte between ranks now waits for link
capacity without using CPU, like a real interconnect of ``--rate`` (shared by all ranks: one link, not one
per pair). The rest of the machine is not touched, and the namespace is removed afterwards.

Needs root and iproute2 (``ip``, ``tc``). ``--probe`` first measures the achieved bandwidth with a
socket pair inside the namespace and prints it (report that figure next to the benchmark's).

    python benchmarks/emulated_link.py --rate 2gbit -- python benchmarks/bench_ep_pipeline.py
    python benchmarks/emulated_link.py --rate 1gbit --probe -- true
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import threading
import time


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def probe(mib: int = 64) -> float:
    """MiB/s through loopback in the current namespace (one TCP stream, ``mib`` MiB)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        while True:
            b = conn.recv(1 << 20)
            if not b:
                break
            got[0] += len(b)
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    cli = socket.create_connection(("127.0.0.1", port))
    chunk = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(mib):
        cli.sendall(chunk)
    cli.close()
    t.join()
    srv.close()
    return got[0] / 2**20 / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", required=True, help="link bandwidth in tc units, e.g. 2gbit, 500mbit")
    p.add_argument("--burst", default="256kb", help="token bucket size (>= loopback MTU of 64 KiB)")
    p.add_argument("--latency", default="200ms", help="longest a byte may queue before tbf drops it")
    p.add_argument("--probe", action="store_true", help="print the bandwidth a TCP stream achieves first")
    p.add_argument("--name", default=f"piperlink{os.getpid()}", help="network namespace name")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the re-exec inside the namespace
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run inside")
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.inside:
        if a.probe:
            print(f"emulated link: {a.rate} (tbf burst {a.burst}); a TCP stream gets {probe():.0f} MiB/s", flush=True)
        sys.exit(subprocess.run(cmd).returncode if cmd else 0)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("emulated_link: needs root and iproute2 (ip, tc)")
    ns = ["ip", "netns", "exec", a.name]
    _run("ip", "netns", "add", a.name)
    try:
        _run(*ns, "ip", "link", "set", "lo", "up")
        _run(*ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", a.rate, "burst", a.burst,
             "latency", a.latency)
        inner = [sys.executable, os.path.abspath(__file__), "--inside", "--rate", a.rate, "--burst", a.burst]
        inner += ["--probe"] if a.probe else []
        code = subprocess.run([*ns, *inner, "--", *cmd]).returncode
    finally:
        subprocess.run(["ip", "netns", "del", a.name])
    sys.exit(code)


if __name__ == "__main__":
    main()
