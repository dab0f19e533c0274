"""A small tied-weights language model for the tests: lm_head.weight IS embed.weight (one
Parameter under two names, as `tie_word_embeddings` makes it), so state_dict() lists it twice and
named_parameters() once."""
from __future__ import annotations

import torch

from refit._common import module_tensors

VOCAB, DIM = 512, 64


class TiedLM(torch.nn.Module):
    def __init__(self, tied: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM).to(torch.bfloat16)
        self.proj = torch.nn.Linear(DIM, DIM).to(torch.bfloat16)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False).to(torch.bfloat16)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))


def step(model: torch.nn.Module, seed: int) -> None:
    """About 1.65% of each parameter's elements moved by one bf16 ULP (an RL-sized step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied parameter once
            bits = p.data.view(torch.int16)
            bits[torch.rand(p.shape, generator=g) < 0.0165] += 1
        model.steps.add_(seed)


def every_name(module: torch.nn.Module) -> dict:
    """name -> a copy of the tensor, under every name (tied ones under each of theirs)."""
    return {n: t.detach().clone() for n, t in module_tensors(module).items()}


def assert_bits(got: dict, want: dict, what: str) -> None:
    """got[n] equals want[n] bit for bit for every n in want (same dtype and shape)."""
    missing = sorted(set(want) - set(got))
    assert not missing, f"{what}: missing {missing}"
    for n, w in want.items():
        g = got[n].detach()
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), f"{what}: {n}"
        gb, wb = g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)
        if not torch.equal(gb, wb):
            raise AssertionError(f"{what}: {n}: {int((gb != wb).sum())} of {wb.numel()} bytes "
                                 "differ")
