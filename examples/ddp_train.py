"""A small DDP training run (gloo, CPU): a linear model on synthetic data.

Every rank prints its loss per step and, at the end, a hash of the model's parameters, which
must be identical on every rank after DDP's gradient all-reduce.

    nodeops launch cluster.yaml -- examples/ddp_train.py --steps 20
    --fail-rank R --fail-step S   makes rank R exit 1 at step S (to rehearse fail-fast)
    --sleep SECONDS               sleep per step (to keep a job alive for stop/Ctrl-C tests)
"""

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-step", type=int, default=-1)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    print(f"rank {rank}/{world} on {os.uname().nodename} NODE_RANK={os.environ.get('NODE_RANK')}", flush=True)
    for step in range(args.steps):
        if rank == args.fail_rank and step == args.fail_step:
            print(f"rank {rank}: failing on purpose at step {step}", flush=True)
            sys.exit(1)
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.sleep)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()  # no numpy needed
    digest = hashlib.sha256(repr(flat).encode()).hexdigest()
    print(f"final param hash {digest[:16]}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
