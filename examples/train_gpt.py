"""Train a small GPT with piper on 4 local CPU ranks: 2 pipeline stages x 2 data-parallel replicas,
1F1B over 8 micro-batches, token embedding tied to the LM head (used by the first and last stage).

    python examples/train_gpt.py                          # spawns 4 gloo processes itself
    torchrun --nproc-per-node 4 examples/train_gpt.py     # or under torchrun

Every rank prints nothing but rank 0, which prints the loss of each step. At the end the same
training is replayed eagerly in one process on the concatenated global batch, and the losses and
all parameters are compared (the run fails if they differ).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

import piper_compile as piper
from piper_compile.testing.models import GPT, GPTConfig
from piper_compile.testing.parity import assert_parity

STAGES, REPLICAS = 2, 2


def make_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=4, layers=args.layers))


def optimizer_factory(args: argparse.Namespace) -> functools.partial:
    return functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01)


def global_batch(model: GPT, args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return model.make_batch(REPLICAS * args.batch, torch.Generator().manual_seed(step))


def train(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank's training loop. Rank r holds stage r % 2 of replica r // 2."""
    model = make_model(args)
    model.annotate_stages(STAGES)  # blocks[:L/2] -> PP=0, blocks[L/2:] -> PP=1, no model code edited
    directives = [
        *piper.pipeline(stages=STAGES, ranks=[[0, 2], [1, 3]]),  # PP0 on ranks 0,2 and PP1 on ranks 1,3
        piper.replicate({"PP": "*"}),  # data parallel over each stage's group
        piper.split(microbatches=args.microbatches),
        *piper.schedules.one_f_one_b(stages=STAGES, microbatches=args.microbatches),
    ]
    step = torch.compile(model, backend="piper", fullgraph=True, dynamic=True,
                         options={"directives": directives, "optimizer": optimizer_factory(args),
                                  "codegen": args.codegen})
    replica = rank // STAGES
    losses = []
    for s in range(args.steps):
        tokens, labels = global_batch(model, args, s)
        lo, hi = replica * args.batch, (replica + 1) * args.batch
        t0 = time.perf_counter()
        loss = step(tokens[lo:hi], labels[lo:hi])  # one whole step: 8 micro-batches fwd+bwd, grad sync, AdamW
        losses.append(loss.item())
        if rank == 0:  # piper.stats: step time, throughput, TFLOP/s, MFU and where the time went
            print(f"step {s:3d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.2f}s)  "
                  f"{piper.stats(step).line()}", flush=True)
    if rank == 0:
        print(piper.explain(step).splitlines()[0])
    # For the parity check: the parameters this rank updates, by position in model.parameters().
    cs = piper.compiled_steps(step)[0]
    program = cs.plans[False].programs[rank]
    owned = {f for i in program.instrs if i.node.kind.value == "UPDATE" for f in i.node.op.params}
    ids = {id(p): f for f, p in cs.joint.params.items()}
    params = {k: p.detach().clone() for k, p in enumerate(model.parameters()) if ids.get(id(p)) in owned}
    return {"losses": losses, "params": params, "eval_loss": None}


def eager_reference(args: argparse.Namespace) -> dict:
    model = make_model(args)
    opt = optimizer_factory(args)(model.parameters())
    losses = []
    for s in range(args.steps):
        loss = model(*global_batch(model, args, s))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "eval_loss": None}


def check(results: list[dict], args: argparse.Namespace) -> None:
    ref = eager_reference(args)
    # Losses agree to ~1e-6. AdamW divides each gradient element by its own running RMS, so an element
    # whose gradient is ~0 can move by up to lr on fp32 rounding noise (Inductor fuses and reorders
    # sums); parameters are therefore compared to within lr/20 -- still far below one update step.
    assert_parity(results, ref, rtol=1e-5, atol=args.lr / 20, loss_tol=1e-5)
    print(f"parity: piper PP{STAGES} x DP{REPLICAS} 1F1B matches eager single-process training "
          f"(losses {results[0]['losses'][0]:.4f} -> {results[0]['losses'][-1]:.4f}, all parameters match)")


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    return train(rank, world, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="local batch per replica")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    args = p.parse_args()
    world = STAGES * REPLICAS
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        if dist.get_world_size() != world:
            sys.exit(f"piper example: run with --nproc-per-node {world}")
        torch.set_num_threads(1)
        out = train(dist.get_rank(), world, args)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, out)
        if dist.get_rank() == 0:
            check(gathered, args)
        dist.destroy_process_group()
        return
    from piper_compile.testing.launch import run_local

    check(run_local(_worker, world, args), args)


if __name__ == "__main__":
    main()
