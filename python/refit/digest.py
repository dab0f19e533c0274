"""Tensor digest v2 (docs/ARCHITECTURE.md "Tensor digest, version 2") computed with torch, so that
an inference process can prove that the weights it serves hold a version's bytes: the digest of a
tensor's bytes must equal the subscriber's (`Weights.digests`, the layout's per-tensor digests,
when the subscriber verifies with digest v2, its default).

All arithmetic is modulo 2^64 on int64 tensors (torch's integer multiply and add wrap); right
shifts are made logical by masking. Memory: a bounded number of words at a time.
"""
from __future__ import annotations

import torch

_M = (1 << 64) - 1
_A, _B = 0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93
_M1, _M2, _M3 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xFF51AFD7ED558CCD
_F1, _F2 = 0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D
_P2, _P3 = 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_SEED = 0x5265666974446732
_CHUNK_WORDS = 1 << 20


def _s(u: int) -> int:
    """A u64 as the int64 with the same bits."""
    u &= _M
    return u - (1 << 64) if u >> 63 else u


def _xs(x: torch.Tensor, r: int) -> torch.Tensor:
    return x ^ ((x >> r) & ((1 << (64 - r)) - 1))


def _mix_sum(words: torch.Tensor, first: int) -> int:
    """Sum of Mix(i, w) over consecutive words numbered from `first`."""
    i = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device)
    return word_sum(i, words)


def _xs_int(x: int, r: int) -> int:
    return x ^ (x >> r)


def _avalanche(h: int) -> int:
    h = (_xs_int(h, 33) * _P2) & _M
    h = (_xs_int(h, 29) * _P3) & _M
    return _xs_int(h, 32)


def _finish(s: int, n: int) -> int:
    x = s ^ _avalanche(n ^ _SEED)
    x = (_xs_int(x, 31) * _F1) & _M
    x = (_xs_int(x, 29) * _F2) & _M
    return _xs_int(x, 32)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order, as a flat uint8 tensor on its device (a copy only
    when it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def digest_v2(t: torch.Tensor) -> int:
    """Digest v2 of the tensor's bytes (row-major), an unsigned 64-bit int."""
    data = tensor_bytes(t)
    n = int(data.numel())
    full = n // 8
    s = 0
    for first in range(0, full, _CHUNK_WORDS):
        count = min(_CHUNK_WORDS, full - first)
        words = data[8 * first:8 * (first + count)].view(torch.int64)
        s = (s + _mix_sum(words, first)) & _M
    if n % 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[:n % 8] = data[8 * full:]
        s = (s + _mix_sum(tail.view(torch.int64), full)) & _M
    return _finish(s, n)


def _inv_xs(x: int, r: int) -> int:
    y = x
    for _ in range(64 // r + 1):
        y = x ^ (y >> r)
    return y


_F1_INV = pow(_F1, -1, 1 << 64)
_F2_INV = pow(_F2, -1, 1 << 64)


def _unfinish(d: int, n: int) -> int:
    x = _inv_xs(d, 32)
    x = (x * _F2_INV) & _M
    x = _inv_xs(x, 29)
    x = (x * _F1_INV) & _M
    x = _inv_xs(x, 31)
    return x ^ _avalanche(n ^ _SEED)


def word_sum(word_index: torch.Tensor, words: torch.Tensor) -> int:
    """Sum of Mix(i, w) over the given words (int64 tensors of equal length), mod 2^64."""
    if word_index.numel() == 0:
        return 0
    i = word_index.to(device=words.device, dtype=torch.int64)
    z = (words ^ (i * _s(_A))) * _s(_M1)
    z = (_xs(z, 32) + i * _s(_B)) * _s(_M2)
    z = _xs(z, 29) * _s(_M3)
    return int(_xs(z, 32).sum()) & _M


def apply_delta(digest: int, nbytes: int, delta: int) -> int:
    """The digest v2 of a tensor of `nbytes` bytes whose digest was `digest` after its words
    changed with mix-sum difference `delta` (word_sum(new) - word_sum(old) of the changed
    words, each word once)."""
    return _finish((_unfinish(digest, nbytes) + delta) & _M, nbytes)
