#!/usr/bin/env python3
"""Runs both examples against a local refitd publisher and subscriber (loopback, ports chosen by
the OS, everything in a temporary directory), and checks that the inference loop reached the
trainer's last version with the trainer's exact BF16 weights.

    PYTHONPATH=<build>/python/gen:python REFITD_BIN=<build>/daemon/cli/refitd \\
        python3 examples/run_local.py --steps 20
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = ap.parse_args()

    from refit.local import Daemon, publisher_yaml, subscriber_yaml  # needs PYTHONPATH

    d = tempfile.mkdtemp(prefix="refit-examples-")
    pub = Daemon("publisher", "pub", d, publisher_yaml("pub", d))
    sub = None
    ok = False
    want = None
    try:
        pub_ready = pub.start()
        sub = Daemon("subscriber", "sub", d, subscriber_yaml("sub", d, pub_ready["listen"]))
        sub_ready = sub.start()
        strip = lambda a: a[len("unix:"):] if a.startswith("unix:") else a  # noqa: E731
        inference = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "inference_loop.py"), "--socket",
             strip(sub_ready["local_socket"]), "--versions", str(args.steps)],
            stdout=subprocess.PIPE, text=True)
        trainer = subprocess.run(
            [sys.executable, os.path.join(HERE, "trainer_loop.py"), "--socket",
             strip(pub_ready["local_socket"]), "--steps", str(args.steps)],
            stdout=subprocess.PIPE, text=True, timeout=300)
        sys.stdout.write(trainer.stdout)
        out, _ = inference.communicate(timeout=300)
        sys.stdout.write(out)
        last = [l for l in out.splitlines() if l.startswith("version ")]
        steps = [l for l in trainer.stdout.splitlines() if l.startswith("step ")]
        want = steps[-1].rsplit("weights ", 1)[-1] if steps else None
        got = last[-1].rsplit("weights ", 1)[-1] if last else None
        ok = (trainer.returncode == 0 and inference.returncode == 0 and bool(last) and
              last[-1].startswith(f"version {args.steps}:") and want is not None and got == want)
        if not ok:
            print(f"run_local: FAILED (trainer exit {trainer.returncode}, inference exit "
                  f"{inference.returncode}, last line {last[-1] if last else None!r}, trainer's "
                  f"weights {want}); logs in {d}", file=sys.stderr)
    finally:
        if sub is not None:
            sub.stop()
        pub.stop()
        if ok and not args.keep:
            import shutil
            shutil.rmtree(d, ignore_errors=True)
    if ok:
        print(f"run_local: OK: the inference loop reloaded up to version {args.steps}, weights "
              f"identical to the trainer's (sha256 {want})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
