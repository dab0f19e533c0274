#!/usr/bin/env python3
"""A trainer that publishes its policy to refitd after every optimizer step (CPU, torch).

    python3 examples/trainer_loop.py --socket /tmp/refitd/publisher.sock --steps 20

The model trains in fp32 with AdamW; after each step its BF16 copy (what rollouts use) is written
into the tensors registered with the publisher (shared memory, no copy through the socket) and
published as the next version. Publish returns once the publisher has its snapshot, so the next
step starts at once while the publisher encodes and ships the delta.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch

from refit.trainer import Trainer


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def weights_sha256(tensors) -> str:
    """sha256 over the tensors' bytes in name order (the inference example prints the same)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="the publisher's local_socket (TrainerApi)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    target = torch.nn.Linear(64, 64)  # the function to learn
    with Trainer(args.socket, client="rank0") as trainer:
        trainer.register({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
        for step in range(1, args.steps + 1):
            x = torch.randn(128, 64)
            loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
            bf16 = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            trainer.update(bf16)
            t0 = time.monotonic()
            r = trainer.publish()
            print(f"step {step}: loss {loss.item():.4f}, published version {r.version} "
                  f"(snapshot {r.snapshot_micros / 1000:.1f} ms, returned after "
                  f"{(time.monotonic() - t0) * 1000:.1f} ms), weights {weights_sha256(bf16)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
