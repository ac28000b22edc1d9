"""A small DDP training run (gloo, CPU): a linear model on synthetic data.

Every rank prints its loss per step and, at the end, a hash of the model's parameters, which
must be identical on every rank after DDP's gradient all-reduce.

    nodeops launch cluster.yaml -- examples/ddp_train.py --steps 20
    --fail-rank R --fail-step S   makes rank R exit 1 at step S (to rehearse fail-fast); R 'all':
                                  every rank raises there (a bug in the script, not the cluster)
    --sleep SECONDS               sleep per step (to keep a job alive for stop/Ctrl-C tests)
    --hang-rank R --hang-step S   makes rank R block forever at step S while the others wait for
                                  it in all_reduce (to rehearse `nodeops stacks` and --hang-timeout)
    --quiet-step S --quiet-for T  every rank prints nothing for T seconds at step S, touching
                                  $NODEOPS_PROGRESS_FILE each second (progress without output)
    --checkpoint PATH             rank 0 saves the model there every --checkpoint-every steps
                                  (atomically) and every run resumes from it when it exists, so a
                                  run restarted by nodeops (launch.restarts) goes on where it was;
                                  the final hash equals an uninterrupted run's on the same world size
"""

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def stuck_forever(rank: int, step: int) -> None:
    print(f"rank {rank}: blocking forever at step {step}", flush=True)
    while True:
        time.sleep(1)


def quiet(seconds: float) -> None:
    """Print nothing for a while, but say progress the way nodeops' hang watchdog reads it."""
    progress = os.environ.get("NODEOPS_PROGRESS_FILE")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if progress:
            with open(progress, "a"):
                os.utime(progress)
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fail-rank", default="-1")
    ap.add_argument("--fail-step", type=int, default=-1)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-step", type=int, default=-1)
    ap.add_argument("--quiet-step", type=int, default=-1)
    ap.add_argument("--quiet-for", type=float, default=0.0)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = torch.nn.Linear(16, 1)
    first = torch.zeros(1, dtype=torch.long)
    if rank == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        module.load_state_dict(saved["model"])
        first[0] = saved["step"]
        print(f"resumed from {args.checkpoint} at step {saved['step']}", flush=True)
    dist.broadcast(first, 0)  # every rank starts where rank 0's checkpoint ends
    model = DDP(module)  # DDP gives every rank rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # no momentum: no optimizer state to keep
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(int(first[0])):  # the data the earlier steps used, so the rest is the same
        torch.randn(32, 16, generator=gen)
    print(f"rank {rank}/{world} on {os.uname().nodename} NODE_RANK={os.environ.get('NODE_RANK')} "
          f"restart {os.environ.get('NODEOPS_RESTART_COUNT', 0)}", flush=True)  # fmt: skip
    for step in range(int(first[0]), args.steps):
        if args.fail_rank == "all" and step == args.fail_step:
            raise RuntimeError(f"rank {rank}: a bug on every rank at step {step}")
        if args.fail_rank == str(rank) and step == args.fail_step:
            print(f"rank {rank}: failing on purpose at step {step}", flush=True)
            sys.exit(1)
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == args.hang_rank and step == args.hang_step:
            stuck_forever(rank, step)
        if step == args.quiet_step:
            quiet(args.quiet_for)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the mean loss, for the log
        if rank == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} mean {mean.item() / world:.4f}", flush=True)
        if rank == 0 and args.checkpoint and (step + 1) % args.checkpoint_every == 0:
            torch.save({"step": step + 1, "model": model.module.state_dict()}, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        time.sleep(args.sleep)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()  # no numpy needed
    digest = hashlib.sha256(repr(flat).encode()).hexdigest()
    print(f"final param hash {digest[:16]}", flush=True)
    # Every rank reaches this point before any tears gloo down: a rank that destroys its
    # process group while a peer's gloo thread still talks to it can abort the peer
    # ("terminate called without an active exception") and fail a run that was done. The
    # barrier alone is not enough (gloo's own open issue 155: a barrier then teardown can
    # still fail a peer whose last writes are in flight; seen once on the Slurm sandbox):
    # give them a moment to drain first.
    dist.barrier()
    time.sleep(1.0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
