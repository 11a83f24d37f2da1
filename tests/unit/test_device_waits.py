"""Which communication waits block the host (and so get ``options["timeout"]`` and a message naming the
instruction): every wait except NCCL's on CUDA -- a shared GPU's gloo ranks included, whose untimed
waits hung the GPU check's pipeline tests without a word."""
from __future__ import annotations

import torch
import torch.distributed as dist

from piper_compile.runtime.executor import device_waits
from piper_compile.testing.launch import free_port


def test_only_nccl_on_cuda_waits_on_the_device():
    assert not device_waits(torch.device("cpu"))
    assert not device_waits(torch.device("cuda"))  # no process group yet
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert not device_waits(torch.device("cuda"))  # ranks sharing a GPU over gloo: the host blocks
        assert not device_waits(torch.device("cpu"))
    finally:
        dist.destroy_process_group()
