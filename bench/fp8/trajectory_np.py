"""A numpy port of refit::model::Trajectory (daemon/model/trajectory.{h,cc}): AdamW on fp32
master weights shaped and initialised like a transformer, with the same synthetic gradient model,
publishing the BF16 rounding of every step.

It follows the C++ operation by operation in float32 (the C++ is built with -ffp-contract=off, so
no fused multiply-adds; numpy rounds every float32 operation too), so its BF16 versions are meant
to be byte-identical to the C++ generator's. bench/fp8/run.py checks that against
`make_safetensors_pair OUT PRESET` (versions 0 and 1) before using it, because the bench's C++
targets write only those two versions and the FP8 study needs several steps.

Only the pieces the FP8 study needs: presets, options at their defaults (seed and lr can be set).
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
F32 = np.float32
U64 = np.uint64

PRESETS = {  # daemon/model/trajectory.cc PresetShape
    "tiny": dict(vocab=2048, hidden=128, layers=4, ffn=384, heads=4, kv_heads=2),
    "small": dict(vocab=8192, hidden=512, layers=8, ffn=1408, heads=8, kv_heads=8),
    "medium": dict(vocab=32000, hidden=768, layers=12, ffn=1792, heads=12, kv_heads=12),
    "500m": dict(vocab=32000, hidden=1536, layers=18, ffn=4096, heads=12, kv_heads=4),
}


def mix64(x: int) -> int:
    """splitmix64 finaliser on a Python int (mod 2^64)."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def mix64_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> U64(30))
    x = x * U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> U64(27))
    x = x * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


def fast_log(x: np.ndarray) -> np.ndarray:
    """Cephes-style logf of trajectory.cc FastLog, float32 op for op."""
    b = x.view(np.uint32)
    e = (b >> np.uint32(23)).astype(np.int32) - np.int32(126)
    f = ((b & np.uint32(0x007FFFFF)) | np.uint32(0x3F000000)).view(np.float32)
    small = f < F32(0.70710678118654752)
    e = e - small.astype(np.int32)
    f = np.where(small, (f + f) - F32(1.0), f - F32(1.0))
    z = f * f
    y = np.full_like(f, F32(7.0376836292e-2))
    y = y * f - F32(1.1514610310e-1)
    y = y * f + F32(1.1676998740e-1)
    y = y * f - F32(1.2420140846e-1)
    y = y * f + F32(1.4249322787e-1)
    y = y * f - F32(1.6668057665e-1)
    y = y * f + F32(2.0000714765e-1)
    y = y * f - F32(2.4999993993e-1)
    y = y * f + F32(3.3333331174e-1)
    y = (y * f) * z
    ef = e.astype(np.float32)
    y = y + F32(-2.12194440e-4) * ef
    y = y + F32(-0.5) * z
    return (f + y) + F32(0.693359375) * ef


def cos_turns(t: np.ndarray) -> np.ndarray:
    k = (t + F32(2.5)).astype(np.int32) - np.int32(2)
    y = t - k.astype(np.float32)
    a = F32(6.28318530717958648) * (F32(0.25) - np.abs(y))
    a2 = a * a
    p = np.full_like(a, F32(2.7557319e-6))
    p = p * a2 - F32(1.9841270e-4)
    p = p * a2 + F32(8.3333333e-3)
    p = p * a2 - F32(1.6666667e-1)
    p = p * a2 + F32(1.0)
    return a * p


def radius_and_u2(h: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The two halves of NormalFromBits: sqrt(-2 log u1) and u2."""
    u1 = ((h >> U64(40)).astype(np.int32).astype(np.float32) + F32(0.5)) * F32(2.0 ** -24)
    u2 = (h & U64(0xFFFFFF)).astype(np.int32).astype(np.float32) * F32(2.0 ** -24)
    return np.sqrt(F32(-2.0) * fast_log(u1)), u2


def normal_from_bits(h: np.ndarray, phase) -> np.ndarray:
    r, u2 = radius_and_u2(h)
    return r * cos_turns(u2 - F32(phase))


def to_bf16(w: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even BF16 bits (uint16) of finite float32 values."""
    b = w.view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def plan_tensors(s: dict, qkv_bias: bool = True, tie: bool = False) -> List[Tuple[str, Tuple[int, ...], str]]:
    h = s["hidden"]
    head_dim = h // s["heads"]
    q_out, kv_out = s["heads"] * head_dim, s["kv_heads"] * head_dim
    out = [("model.embed_tokens.weight", (s["vocab"], h), "normal")]
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        out.append((p + "self_attn.q_proj.weight", (q_out, h), "normal"))
        if qkv_bias:
            out.append((p + "self_attn.q_proj.bias", (q_out,), "zeros"))
        out.append((p + "self_attn.k_proj.weight", (kv_out, h), "normal"))
        if qkv_bias:
            out.append((p + "self_attn.k_proj.bias", (kv_out,), "zeros"))
        out.append((p + "self_attn.v_proj.weight", (kv_out, h), "normal"))
        if qkv_bias:
            out.append((p + "self_attn.v_proj.bias", (kv_out,), "zeros"))
        out.append((p + "self_attn.o_proj.weight", (h, q_out), "normal"))
        out.append((p + "mlp.gate_proj.weight", (s["ffn"], h), "normal"))
        out.append((p + "mlp.up_proj.weight", (s["ffn"], h), "normal"))
        out.append((p + "mlp.down_proj.weight", (h, s["ffn"]), "normal"))
        out.append((p + "input_layernorm.weight", (h,), "ones"))
        out.append((p + "post_attention_layernorm.weight", (h,), "ones"))
    out.append(("model.norm.weight", (h,), "ones"))
    if not tie:
        out.append(("lm_head.weight", (s["vocab"], h), "normal"))
    return out


class Trajectory:
    """TrajectoryOptions defaults: 20 warm-up steps at 1e-4, then `lr` per step(); beta1 0.9,
    beta2 0.999, eps 1e-8, weight decay 0.01, grad_noise 2.5, drift period 500."""

    CHUNK = 1 << 18

    def __init__(self, preset: str = "small", seed: int = 1, lr: float = 1e-6,
                 warmup_steps: int = 20, warmup_lr: float = 1e-4):
        self.opt = dict(seed=seed, lr=lr, warmup_steps=warmup_steps, warmup_lr=warmup_lr,
                        beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_noise=2.5,
                        drift_period=500.0)
        self.specs = plan_tensors(PRESETS[preset])
        self.t = 0
        self.version = 0
        self.state = []
        for i, (name, shape, init) in enumerate(self.specs):
            key = mix64(mix64(seed ^ 0x7472616A65637431) + (i + 1) * GOLDEN)
            hs = mix64(key ^ 0x5343414C45)
            scale = float(F32(1e-3 * math.exp2(-2.0 + 4.0 * (hs >> 11) * 2.0 ** -53)))
            n = int(np.prod(shape))
            idx = np.arange(1, n + 1, dtype=U64)
            if init == "normal":
                h = mix64_np(U64(mix64(key ^ 0x494E4954)) + idx * U64(GOLDEN))
                w = F32(0.02) * normal_from_bits(h, 0.0)
            elif init == "ones":
                w = np.ones(n, np.float32)
            else:
                w = np.zeros(n, np.float32)
            # The persistent gradient component's (r, u2), fixed per element: cached.
            r, u2 = radius_and_u2(mix64_np(U64(mix64(key ^ 0x50455253)) + idx * U64(GOLDEN)))
            self.state.append(dict(name=name, shape=shape, key=key, scale=F32(scale), w=w,
                                   m=np.zeros(n, np.float32), v=np.zeros(n, np.float32),
                                   r=r, u2=u2))
        for _ in range(warmup_steps):
            self._adam(warmup_lr)

    def _adam(self, lr: float) -> None:
        o = self.opt
        self.t += 1
        t = self.t
        b1, b2 = F32(o["beta1"]), F32(o["beta2"])
        ob1, ob2 = F32(1.0 - o["beta1"]), F32(1.0 - o["beta2"])
        decay = F32(1.0 - lr * o["weight_decay"])
        step = F32(lr / (1.0 - math.pow(o["beta1"], float(t))))
        ibc2 = F32(1.0 / math.sqrt(1.0 - math.pow(o["beta2"], float(t))))
        eps = F32(o["eps"])
        turns = t / o["drift_period"]
        phase = F32(turns - math.floor(turns))
        noise = F32(o["grad_noise"])
        step_key = mix64(((t * GOLDEN) & MASK64) ^ 0x4E4F495345)
        for st in self.state:
            nkey = U64(mix64(st["key"] + step_key))
            n = st["w"].size
            for lo in range(0, n, self.CHUNK):
                hi = min(n, lo + self.CHUNK)
                idx = np.arange(lo + 1, hi + 1, dtype=U64)
                p = st["r"][lo:hi] * cos_turns(st["u2"][lo:hi] - phase)
                q = normal_from_bits(mix64_np(nkey + idx * U64(GOLDEN)), 0.0)
                g = st["scale"] * (p + noise * q)
                m = b1 * st["m"][lo:hi] + ob1 * g
                v = b2 * st["v"][lo:hi] + ob2 * (g * g)
                st["m"][lo:hi] = m
                st["v"][lo:hi] = v
                denom = np.sqrt(v) * ibc2 + eps
                w = st["w"][lo:hi] * decay
                st["w"][lo:hi] = w - step * (m / denom)

    def step(self) -> None:
        self._adam(self.opt["lr"])
        self.version += 1

    def bf16(self) -> Dict[str, Tuple[Tuple[int, ...], np.ndarray]]:
        """name -> (shape, BF16 bits as uint16) of the current version."""
        return {st["name"]: (st["shape"], to_bf16(st["w"])) for st in self.state}
