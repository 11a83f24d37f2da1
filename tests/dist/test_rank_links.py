"""One emulated link per rank (``benchmarks/emulated_link.py --per-rank``): ``run_local`` moves each rank
into its own network namespace before it connects, and the ranks still form one working group."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from piper_compile.testing.launch import enter_rank_netns, run_local

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import emulated_link  # noqa: E402


def test_without_namespaces_rank0_is_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPER_RANK_NETNS", raising=False)
    assert enter_rank_netns(0, 2) == "127.0.0.1"


def test_fewer_namespaces_than_ranks_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPER_RANK_NETNS", "a,b")
    monkeypatch.setenv("PIPER_RANK_ADDRS", "10.77.0.1,10.77.0.2")
    with pytest.raises(RuntimeError, match=r"piper: .*2/2 ranks but 4 were launched.*--per-rank 4"):
        enter_rank_netns(0, 4)


def _where(rank: int, world: int) -> tuple[str, bool, float]:
    """This rank's interface list and a sum over the group (the link carries real traffic)."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open("/proc/self/net/dev") as f:
        dev = f.read()
    return os.environ.get("GLOO_SOCKET_IFNAME", ""), emulated_link.RANK_IF in dev, float(t)


def _can_make_namespaces() -> bool:
    """Root, iproute2, and a kernel/container that lets us build the links (namespaces, a bridge, veth
    pairs, tbf): probed by building one rank's link and removing it."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    names = [f"pltprobe{os.getpid()}", f"pltprobe{os.getpid()}h"]
    try:
        emulated_link._netns_setup(names[:1], names[1], "1gbit", "256kb", "200ms")
        return True
    except (subprocess.CalledProcessError, OSError):
        return False
    finally:
        emulated_link.remove_namespaces(names)


@pytest.mark.slow
def test_ranks_run_in_their_own_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _can_make_namespaces():  # probed here, not at collection: building links takes root and time
        pytest.skip("needs root, iproute2 (ip, tc) and network namespaces with veth, bridge and tbf")
    tag = f"plt{os.getpid()}"
    names = [f"{tag}_{i}" for i in range(3)]
    try:
        emulated_link._netns_setup(names, f"{tag}h", "1gbit", "256kb", "200ms")
        monkeypatch.setenv("PIPER_RANK_NETNS", ",".join(names))
        monkeypatch.setenv("PIPER_RANK_ADDRS", ",".join(f"{emulated_link.SUBNET}.{i + 1}" for i in range(3)))
        monkeypatch.setenv("PIPER_RANK_IFNAME", emulated_link.RANK_IF)
        out = run_local(_where, 3, timeout_s=120)
    finally:
        emulated_link.remove_namespaces([*names, f"{tag}h"])
    assert out == [(emulated_link.RANK_IF, True, 6.0)] * 3
    with open("/proc/self/net/dev") as f:
        assert emulated_link.RANK_IF not in f.read()  # the test process itself never moved
