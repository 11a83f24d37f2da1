"""Run a benchmark with all of its ranks' traffic through an emulated link of limited bandwidth.

On one machine gloo ranks talk over loopback, where a "transfer" is a kernel memcpy done by the same CPU
cores that compute: communication never takes time the compute could hide, so schedules built to overlap
it (DualPipeV, ZeRO prefetch) cannot show what they do on a cluster, where NICs/NVLink move the bytes
while the cores compute. This wrapper gives the benchmark a network namespace of its own whose loopback
carries a token-bucket filter (``tc qdisc ... tbf``): every byte between ranks now waits for link
capacity without using CPU, like a real interconnect of ``--rate`` (shared by all ranks: one link, not one
per pair). The rest of the machine is not touched, and the namespace is removed afterwards.

``--per-rank N`` gives every rank a link of its own instead, like one NIC per GPU: N namespaces, each
joined to a bridge (in a hub namespace) by a veth pair whose two ends both carry a ``tbf`` of ``--rate``
(the rank's send and receive directions). The command runs in the host namespace with
``PIPER_RANK_NETNS`` set; ``piper_compile.testing.launch.run_local`` moves rank r into namespace r before
it connects. Traffic of different ranks no longer queues behind each other's in one shared queue.

Needs root and iproute2 (``ip``, ``tc``). ``--probe`` first measures the achieved bandwidth with a
socket pair over the link(s) and prints it (report that figure next to the benchmark's).

    python benchmarks/emulated_link.py --rate 2gbit -- python benchmarks/bench_ep_pipeline.py
    python benchmarks/emulated_link.py --rate 1gbit --per-rank 4 -- python benchmarks/bench_ep_pipeline.py
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


PROBE_PORT, PROBE_MIB = 29511, 64  # the bandwidth probe: one TCP stream of this many MiB


def _serve(port: int = PROBE_PORT, mib: int = PROBE_MIB) -> None:
    """Accept one connection on ``port`` (all addresses) and read ``mib`` MiB from it."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(1)
        conn, _ = srv.accept()
        left = mib << 20
        while left > 0:
            b = conn.recv(min(left, 1 << 20))
            if not b:
                break
            left -= len(b)
        conn.close()


def _send(host: str, port: int = PROBE_PORT, mib: int = PROBE_MIB) -> float:
    """MiB/s of one TCP stream sending ``mib`` MiB to ``host:port`` (retried while the server starts)."""
    for _ in range(100):
        try:
            cli = socket.create_connection((host, port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    else:
        raise RuntimeError(f"emulated_link: no probe server at {host}:{port}")
    chunk = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(mib):
        cli.sendall(chunk)
    cli.shutdown(socket.SHUT_WR)
    cli.recv(1)  # the server closes once it has read everything
    cli.close()
    return mib / (time.perf_counter() - t0)


def probe() -> float:
    """MiB/s through loopback in the current namespace (one TCP stream)."""
    t = threading.Thread(target=_serve)
    t.start()
    rate = _send("127.0.0.1")
    t.join()
    return rate


RANK_IF, SUBNET = "pl0", "10.77.0"


def _netns_setup(names: list[str], hub: str, rate: str, burst: str, latency: str) -> None:
    """A bridge in ``hub``; rank namespace i joined to it by a veth pair, tbf of ``rate`` on both ends."""
    _run("ip", "netns", "add", hub)
    _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", hub, "link", "set", "br0", "up")
    tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
    for i, ns in enumerate(names):
        _run("ip", "netns", "add", ns)
        a, b = f"{hub[:8]}a{i}", f"{hub[:8]}b{i}"
        _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _run("ip", "link", "set", a, "netns", ns)
        _run("ip", "link", "set", b, "netns", hub)
        _run("ip", "-n", ns, "link", "set", a, "name", RANK_IF)
        _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", RANK_IF)
        _run("ip", "-n", ns, "link", "set", RANK_IF, "mtu", "65000", "up")  # loopback-sized packets
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", hub, "link", "set", b, "master", "br0")
        _run("ip", "-n", hub, "link", "set", b, "mtu", "65000", "up")
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", RANK_IF, "root", *tbf)  # rank sends
        _run("ip", "netns", "exec", hub, "tc", "qdisc", "add", "dev", b, "root", *tbf)  # rank receives


def _probe_pair(names: list[str]) -> float:
    """MiB/s of one TCP stream from rank 0's namespace to rank 1's."""
    me = [sys.executable, os.path.abspath(__file__)]
    srv = subprocess.Popen(["ip", "netns", "exec", names[1], *me, "--serve"])
    try:
        out = subprocess.run(["ip", "netns", "exec", names[0], *me, "--send", f"{SUBNET}.2"],
                             check=True, capture_output=True, text=True).stdout
    finally:
        srv.wait(timeout=60)
    return float(out.strip())


def per_rank(a: argparse.Namespace, cmd: list[str]) -> int:
    """Run ``cmd`` in this namespace with one emulated link per rank (``--per-rank N``)."""
    hub = f"plhub{os.getpid()}"
    names = [f"plr{os.getpid()}_{i}" for i in range(a.per_rank)]
    try:
        _netns_setup(names, hub, a.rate, a.burst, a.latency)
        if a.probe:
            print(f"emulated link: {a.rate} per rank (tbf burst {a.burst}, both directions); a TCP stream rank 0 -> "
                  f"rank 1 gets {_probe_pair(names):.0f} MiB/s", flush=True)
        env = dict(os.environ, PIPER_RANK_NETNS=",".join(names), PIPER_RANK_IFNAME=RANK_IF,
                   PIPER_RANK_ADDRS=",".join(f"{SUBNET}.{i + 1}" for i in range(a.per_rank)))
        return subprocess.run(cmd, env=env).returncode if cmd else 0
    finally:
        remove_namespaces([*names, hub])


def remove_namespaces(names: list[str]) -> None:
    """Delete these network namespaces (their veth pairs go with them); missing ones are skipped."""
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", help="link bandwidth in tc units, e.g. 2gbit, 500mbit (required)")
    p.add_argument("--burst", default="256kb", help="token bucket size (>= loopback MTU of 64 KiB)")
    p.add_argument("--latency", default="200ms", help="longest a byte may queue before tbf drops it")
    p.add_argument("--probe", action="store_true", help="print the bandwidth a TCP stream achieves first")
    p.add_argument("--per-rank", type=int, default=0, metavar="N",
                   help="one link of --rate per rank for N ranks (run_local ranks), instead of one shared link")
    p.add_argument("--name", default=f"piperlink{os.getpid()}", help="network namespace name")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the re-exec inside the namespace
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # probe server (per-rank links)
    p.add_argument("--send", help=argparse.SUPPRESS)  # probe client: prints MiB/s
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run inside")
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.serve:
        return _serve()
    if a.send:
        print(f"{_send(a.send):.1f}")
        return None
    if not a.rate:
        p.error("--rate is required")
    if a.inside:
        if a.probe:
            print(f"emulated link: {a.rate} (tbf burst {a.burst}); a TCP stream gets {probe():.0f} MiB/s", flush=True)
        sys.exit(subprocess.run(cmd).returncode if cmd else 0)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("emulated_link: needs root and iproute2 (ip, tc)")
    if a.per_rank:
        sys.exit(per_rank(a, cmd))
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
