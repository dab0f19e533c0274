#!/usr/bin/env python3
"""An inference loop that reloads its weights from refitd on every new version (CPU, torch).

    python3 examples/inference_loop.py --socket /tmp/refitd/subscriber.sock --versions 20

It waits for each version the subscriber announces (the subscriber has already checked every
tensor's digest against the publisher's), copies the new weights into its own module under a read
lease (so it never sees a torn version), and runs a forward pass. Versions that arrive faster than
it reloads are skipped: it always loads the newest. `attach()` gives zero-copy views instead, for
engines that read the subscriber's memory directly.
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from refit.inference import Consumer


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64)).to(torch.bfloat16)


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over the parameters' bytes in name order (as the trainer example prints it)."""
    h = hashlib.sha256()
    params = dict(module.named_parameters())
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="the subscriber's local_socket (ConsumerApi)")
    ap.add_argument("--versions", type=int, default=10, help="stop after this version")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait per version")
    args = ap.parse_args()

    model = make_model()
    x = torch.randn(4, 64).to(torch.bfloat16)
    with Consumer(args.socket, name="inference-example") as consumer:
        version = 0
        while version < args.versions:
            version = consumer.wait_for_version(version + 1, timeout=args.timeout)
            loaded = consumer.load_into(model, version)
            with torch.no_grad():
                y = model(x)
            print(f"version {loaded}: weights loaded, output norm {y.float().norm():.4f}, "
                  f"weights {weights_sha256(model)}", flush=True)
            version = loaded
    return 0


if __name__ == "__main__":
    sys.exit(main())
