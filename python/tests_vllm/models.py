"""Small Hugging Face models created locally (no hub) for the vLLM tests and benchmark: a
tokenizer trained on real text, two architectures with fixed-seed random init, trained with AdamW
on that text so that consecutive BF16 versions differ as RL steps do.

- "qwen2": Qwen2ForCausalLM with tied embeddings (no lm_head in the checkpoint) and q/k/v
  biases (vLLM fuses q/k/v into one qkv_proj at load);
- "phi3": Phi3ForCausalLM, whose checkpoint itself holds fused qkv_proj and gate_up_proj.
"""
from __future__ import annotations

import os
from typing import Dict, Iterator

import torch

CORPUS = "/usr/share/common-licenses/GPL-3"
VOCAB = 512
MAX_LEN = 256


def corpus_text() -> str:
    with open(CORPUS, encoding="utf-8") as f:
        return f.read()


def train_tokenizer(out_dir: str):
    """A byte-level BPE tokenizer trained on the corpus, saved as a transformers fast
    tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import transformers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return fast


def config(arch: str, **sizes):
    """The model's config; `sizes` override hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads (the tests' defaults: 4 heads of 80: vLLM's CPU
    attention takes its AMX kernel for head sizes divisible by 32, which needs AMX enabled for
    the process)."""
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=320, intermediate_size=640,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=MAX_LEN, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, torch_dtype="bfloat16")
    common.update(sizes)
    if arch == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True,
                                        architectures=["Qwen2ForCausalLM"], **common)
    if arch == "phi3":
        return transformers.Phi3Config(tie_word_embeddings=False,
                                       architectures=["Phi3ForCausalLM"], **common)
    raise ValueError(f"unknown architecture {arch!r} (qwen2, phi3)")


def create(arch: str, seed: int = 0, **sizes):
    import transformers
    torch.manual_seed(seed)
    cfg = config(arch, **sizes)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "phi3": transformers.Phi3ForCausalLM}[arch]
    model = cls(cfg).float()
    return model


def bf16_state(model) -> Dict[str, torch.Tensor]:
    """The BF16 state a trainer publishes: one entry per distinct tensor (a tied lm_head is the
    embedding, published once), contiguous, detached copies."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and name == "lm_head.weight":
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().to(torch.bfloat16).contiguous().clone()
    return out


def training_steps(model, tokenizer, steps: int, lr: float = 1e-5,
                   warmup_lr: float = 1e-3, warmup: int = 3) -> Iterator[int]:
    """AdamW on the corpus: `warmup` steps at warmup_lr, then lr; yields the step number after
    each optimizer step (the model's fp32 masters hold the new weights)."""
    ids = tokenizer(corpus_text(), return_tensors="pt").input_ids[0]
    opt = torch.optim.AdamW(model.parameters(), lr=warmup_lr, betas=(0.9, 0.999))
    seq, batch = 64, 4
    g = torch.Generator().manual_seed(1)
    model.train()
    for step in range(warmup + steps):
        for group in opt.param_groups:
            group["lr"] = warmup_lr if step < warmup else lr
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([ids[s:s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= warmup:
            yield step - warmup + 1


def save_version(model, tokenizer, out_dir: str) -> Dict[str, torch.Tensor]:
    """Writes a loadable HF model directory (config, tokenizer, BF16 safetensors) of the
    model's current weights; returns the BF16 state written."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    state = bf16_state(model)
    model.config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return state


def start(arch: str, root: str, steps: int, **sizes):
    """A test's starting point: the tokenizer and the initial weights in root/v0, root/d for the
    daemons; returns (tokenizer, model, its training steps: an iterator of `steps`)."""
    tok = train_tokenizer(os.path.join(root, "v0"))
    model = create(arch, **sizes)
    save_version(model, tok, os.path.join(root, "v0"))
    os.makedirs(os.path.join(root, "d"))
    return tok, model, training_steps(model, tok, steps)


class Versions:
    """Rank 0 of a trainer publishing `model` through the publisher daemon `pub`: registers the
    model's BF16 state, then each publish() trains one of `steps`, sends the state as the next
    version and saves it as the checkpoint directory root/v<step> (`dirs[version]`, what a fresh
    load of that version reads)."""

    def __init__(self, pub, model, tokenizer, root: str, steps: Iterator[int]):
        from refit.trainer import Trainer
        self.trainer = Trainer(pub.ready["local_socket"].removeprefix("unix:"), client="rank0")
        self.trainer.register(bf16_state(model))
        self._model, self._tokenizer, self._root, self._steps = model, tokenizer, root, steps
        self.dirs: Dict[int, str] = {}

    def publish(self) -> int:
        step = next(self._steps)
        self.trainer.update(bf16_state(self._model))
        v = self.trainer.publish().version
        self.dirs[v] = os.path.join(self._root, f"v{step}")
        save_version(self._model, self._tokenizer, self.dirs[v])
        return v
