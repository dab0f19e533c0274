"""A real model as the consumer of a single-copy subscriber (store.slots 1), through real daemons.

A Hugging Face `transformers` Llama-architecture causal LM (the library's own parameter names,
random init with a fixed seed) is trained with AdamW on real text (the GPL-3 text every Debian
system ships, as bytes) at lr 1e-6 after a short warm-up, so its BF16 deltas are realistic, and
published as BF16 through the TrainerApi every step. Two inference processes follow it:

- "zero-copy": a LlamaForCausalLM whose parameters are views of the subscriber's single copy
  (refit.pause.Pauser: lease released at batch boundaries, the version written in place);
- "change-sets": a LlamaForCausalLM with its own weights, loaded once and then brought forward by
  change sets only (refit.changes).

Every version, both return their logits and greedy generations for fixed prompts, which must be
bit-identical to those of a model loaded densely from the trainer's published BF16 state. The
test also shows that its comparison catches a dropped change set. It runs twice: with untied
embeddings, and with `tie_word_embeddings=True` (lm_head.weight IS model.embed_tokens.weight: the
trainer registers the state_dict(), which names it twice, and publishes it once; both engines'
tied modules fill both names from it).
Runs with the project's venv python (scripts/install-deps.sh puts transformers there).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import time

import pytest
import torch
import transformers  # the venv of scripts/install-deps.sh; a missing one fails the test

from refit.changes import apply_changes, get_changes
from refit.inference import Consumer
from refit.local import daemon_pair
from refit.pause import Pauser
from refit.trainer import Trainer

STEPS = 8
WAIT_S = 30.0
CORPUS = "/usr/share/common-licenses/GPL-3"
PROMPTS = [b"This License ", b"the Program "]


def config(tied=False):
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128,
                                    tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2)


def bf16_model(tied=False):
    torch.manual_seed(0)  # any init: every published parameter is overwritten or bound
    return transformers.LlamaForCausalLM(config(tied)).to(torch.bfloat16).eval()


def run_prompts(model):
    """(logits bytes, generated tokens) for the fixed prompts, deterministic on one thread."""
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([list(p)], dtype=torch.long)
            logits = model(ids).logits
            gen = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=1,
                                 pad_token_id=0)
            out.append((logits.view(torch.int16).numpy().tobytes(), gen[0].tolist()))
    return out


def zero_copy_engine(sub_sock, conn, tied):
    torch.set_num_threads(1)
    model = bf16_model(tied)
    with Pauser(Consumer(sub_sock, name="zero-copy"), module=model, timeout=WAIT_S) as pauser:
        while True:
            v = conn.recv()
            if v is None:
                return
            deadline = time.monotonic() + WAIT_S
            while True:
                with pauser.batch() as w:  # a batch: compute only under the lease
                    held = w.version
                    res = run_prompts(model) if held == v else None
                if held == v or time.monotonic() > deadline:
                    break
            conn.send((held, res, pauser.pauses))


def change_set_engine(sub_sock, conn, tied):
    torch.set_num_threads(1)
    model = bf16_model(tied)
    consumer = Consumer(sub_sock, name="change-sets")
    held = None
    while True:
        v = conn.recv()
        if v is None:
            return
        consumer.wait_for_version(v, timeout=WAIT_S)
        dropped = None
        if held is None:
            held = consumer.load_into(model, strict=False)  # a full, verified load once
            elements = 0
        else:
            changes = get_changes(consumer, held, v)
            assert not changes.reload_fully, changes.reason
            if v == 4:  # what the results would be had this change set been dropped
                dropped = run_prompts(model)
            elements = apply_changes(model, changes)
            held = changes.to_version
        if tied:  # still one tensor under both names
            assert model.lm_head.weight is model.model.embed_tokens.weight
        conn.send((held, run_prompts(model), elements, dropped))


@contextlib.contextmanager
def daemons(tmp_path_factory):
    """A publisher and a single-copy subscriber: yields their local sockets."""
    with daemon_pair(str(tmp_path_factory.mktemp("refitd-model")), slots=1,
                     digest_v2=True) as (pub, sub):
        yield pub.ready["local_socket"], sub.ready["local_socket"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tie_word_embeddings"])
def test_a_llama_follows_the_trainer_bit_exactly_by_views_and_by_change_sets(tmp_path_factory,
                                                                             tied):
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    master = transformers.LlamaForCausalLM(config(tied))  # fp32 master weights
    names = list(master.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert (master.lm_head.weight is master.model.embed_tokens.weight) == tied
    # The published BF16 model: a module of its own (tied like the master), so that its
    # state_dict() is what a trainer registers and updates, tied names included.
    published = transformers.LlamaForCausalLM(config(tied)).to(torch.bfloat16)
    with open(CORPUS, "rb") as f:
        text = torch.tensor(list(f.read()), dtype=torch.long)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)

    def bf16_state():
        with torch.no_grad():
            for (n, p), (m, q) in zip(published.named_parameters(), master.named_parameters()):
                assert n == m
                p.copy_(q)
        return published.state_dict()

    ctx = mp.get_context("spawn")
    with daemons(tmp_path_factory) as (pub_sock, sub_sock):
        trainer = Trainer(pub_sock, client="rank0")
        trainer.register(bf16_state())
        # A tied model's state_dict() names the embedding twice: published once.
        assert trainer.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
        assert "lm_head.weight" in trainer.tensors or tied
        assert trainer.publish().version == 1
        engines = []
        for target in (zero_copy_engine, change_set_engine):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(sub_sock, child, tied), daemon=True)
            proc.start()
            engines.append((parent, proc))
        try:
            rates = []
            for v in range(1, STEPS + 1):
                if v > 1:
                    # Warm-up at 1e-3 for two steps, then 1e-6: realistic RL-sized deltas.
                    for g in opt.param_groups:
                        g["lr"] = 1e-3 if v <= 3 else 1e-6
                    start = (v * 977) % (len(text) - 65)
                    batch = text[start:start + 64].unsqueeze(0)
                    loss = master(batch, labels=batch).loss
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    before = {n: t.clone() for n, t in trainer.tensors.items()}
                    trainer.update(bf16_state())
                    changed = sum(int((trainer.tensors[n].view(torch.int16) !=
                                       before[n].view(torch.int16)).sum()) for n in before)
                    rates.append(changed / sum(t.numel() for t in before.values()))
                    assert trainer.publish().version == v
                reference = bf16_model(tied)
                reference.load_state_dict(bf16_state(), strict=False)
                want = run_prompts(reference)
                for conn, _ in engines:
                    conn.send(v)
                held, got, pauses = engines[0][0].recv()
                assert held == v, f"zero-copy engine holds {held}, not {v}"
                assert got == want, f"zero-copy engine differs from the dense load at {v}"
                held, got, elements, dropped = engines[1][0].recv()
                assert held == v, f"change-set engine holds {held}, not {v}"
                assert got == want, f"change-set engine differs from the dense load at {v}"
                if dropped is not None:
                    assert dropped != want, "a dropped change set went unnoticed"
                if v > 3:  # after the warm-up: O(changed)
                    total = sum(p.numel() for p in master.parameters())
                    assert 0 < elements < total // 20, f"change set of {elements} elements at {v}"
            assert pauses >= 1, "the zero-copy engine never granted a pause"
            late = rates[2:]
            assert late and all(0.001 < r < 0.1 for r in late), f"change rates {rates}"
            print(f"BF16 change rate per step after warm-up: {[round(r, 4) for r in late]}")
        finally:
            for conn, proc in engines:
                with contextlib.suppress(Exception):
                    conn.send(None)
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
