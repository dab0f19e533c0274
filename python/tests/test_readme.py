"""python/README.md's snippets, executed as written against a tied model (lm_head.weight IS
embed.weight) and real daemons (a single-copy subscriber): the Trainer snippet, the Inference one
(attach + load_into) and the single-copy ones (Pauser, change sets). Only the socket paths are
substituted; the names a snippet leaves to the reader (model, steps, train_step, x, serving,
inputs) are given here. The consumers' modules are checked bit for bit against the trainer's
model, under every name, at every version they reach."""
from __future__ import annotations

import os
import re
import time

import torch

from _tied import TiedLM, assert_bits, every_name, step
from refit.inference import Consumer
from refit.local import daemon_pair

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
PUB = "/run/refitd/publisher-local.sock"
SUB = "/run/refitd/subscriber-local.sock"
WAIT_S = 20.0


def snippets() -> list:
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def snippet(*needles: str) -> str:
    found = [s for s in snippets() if all(n in s for n in needles)]
    assert len(found) == 1, f"README: {len(found)} python snippets with {needles}"
    return found[0]


class Serving:
    """`while serving:` — each test asks `hook` whether to go on."""

    def __init__(self, hook):
        self.hook = hook

    def __bool__(self) -> bool:
        return bool(self.hook())


def run(code: str, ns: dict, pub: str, sub: str) -> dict:
    code = code.replace(f'"{PUB}"', repr(pub)).replace(f'"{SUB}"', repr(sub))
    exec(compile(code, README, "exec"), ns)  # noqa: S102 - the README's own code
    return ns


def test_readme_snippets_with_a_tied_model(tmp_path_factory):
    torch.manual_seed(21)
    with daemon_pair(str(tmp_path_factory.mktemp("refitd-readme")), slots=1,
                     digest_v2=True) as (pub_d, sub_d):
        pub, sub = pub_d.ready["local_socket"], sub_d.ready["local_socket"]
        watcher = Consumer(sub, name="readme-watcher")
        snapshots = {}

        # ---- Trainer ----
        steps_done = [0]

        def train_step(model):
            steps_done[0] += 1
            step(model, steps_done[0])

        tr = run(snippet("Trainer(", "state_dict()"),
                 {"model": TiedLM(), "steps": 3, "train_step": train_step}, pub, sub)
        trainer, master = tr["trainer"], tr["model"]
        assert trainer.aliases == {"lm_head.weight": "embed.weight"}
        assert "lm_head.weight" not in trainer.tensors and tr["r"].version == 3
        snapshots[3] = every_name(master)
        assert watcher.wait_for_version(3, timeout=WAIT_S) == 3

        def publish_next() -> int:  # the Trainer snippet's loop body
            train_step(master)
            trainer.update(master.state_dict())
            v = trainer.publish().version
            snapshots[v] = every_name(master)
            return v

        # ---- Inference: attach + load_into ----
        x = torch.randn(4, 64).to(torch.bfloat16)
        inf = run(snippet("consumer.attach()", "load_into(model)"),
                  {"model": TiedLM(), "x": x}, pub, sub)
        assert inf["version"] == 3 and inf["v"] >= 1
        assert inf["model"].lm_head.weight is inf["model"].embed.weight
        assert_bits(every_name(inf["model"]), snapshots[3], "README load_into")
        want_y = x @ snapshots[3]["proj.weight"].T
        assert torch.equal(inf["y"].view(torch.int16), want_y.view(torch.int16))

        # ---- Single copy: Pauser ----
        ns: dict = {"model": TiedLM(), "inputs": torch.arange(0, 512, 5)}
        state = {"v": 3, "last": 6, "deadline": time.monotonic() + WAIT_S, "checked": []}

        def pause_hook():
            pauser = ns.get("pauser")
            if pauser is None or "logits" not in ns or pauser.version != state["v"]:
                assert time.monotonic() < state["deadline"], f"v{state['v']} never served"
                return True
            # Between batches, the lease on v still held: the module IS version v.
            assert ns["model"].lm_head.weight is ns["model"].embed.weight
            assert_bits(every_name(ns["model"]), snapshots[state["v"]], f"Pauser v{state['v']}")
            ref = TiedLM()
            ref.load_state_dict(snapshots[state["v"]])
            assert torch.equal(ns["logits"].view(torch.int16),
                               ref(ns["inputs"]).view(torch.int16))
            state["checked"].append(state["v"])
            if state["v"] == state["last"]:
                return False
            state["v"] = publish_next()
            ns.pop("logits")
            state["deadline"] = time.monotonic() + WAIT_S
            return True

        ns["serving"] = Serving(pause_hook)
        run(snippet("Pauser(", "pauser.batch()"), ns, pub, sub)
        assert state["checked"] == [3, 4, 5, 6] and ns["pauser"].pauses >= 1

        # ---- Single copy: change sets ----
        ns = {"model": TiedLM()}
        plan = iter([1, 1, 2, 1])  # versions to publish before each round (2: one skipped)
        checked = []

        def changes_hook():
            held = ns["held"]
            assert_bits(every_name(ns["model"]), snapshots[held], f"change sets v{held}")
            assert ns["model"].lm_head.weight is ns["model"].embed.weight
            checked.append(held)
            n = next(plan, None)
            if n is None:
                return False
            for _ in range(n):
                v = publish_next()
            assert watcher.wait_for_version(v, timeout=WAIT_S) == v
            return True

        ns["serving"] = Serving(changes_hook)
        run(snippet("get_changes(consumer, held)"), ns, pub, sub)
        assert checked == [6, 7, 8, 10, 11]
        trainer.close()
        watcher.close()
