"""refit.digest: tensor digest v2 in torch equals the checked-in golden values of the C++ codec
(daemon/codec/testdata/digest_golden.txt), at every length there, and tells changed bytes apart."""
import os

import torch

from refit.digest import digest_v2

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "daemon", "codec", "testdata",
                      "digest_golden.txt")
M = (1 << 64) - 1


def golden_content(n: int) -> bytes:
    st, out = 0x5265666974476F6C, bytearray()
    while len(out) < n:
        st = (st + 0x9E3779B97F4A7C15) & M
        z = st
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        out += (z ^ (z >> 31)).to_bytes(8, "little")
    return bytes(out[:n])


def golden():
    with open(GOLDEN) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                n, _v1, v2 = line.split()
                yield int(n), int(v2, 16)


def test_digest_v2_matches_the_golden_values():
    rows = list(golden())
    assert len(rows) >= 10
    longest = golden_content(max(n for n, _ in rows))
    for n, want in rows:
        t = torch.frombuffer(bytearray(longest[:n]), dtype=torch.uint8) if n else \
            torch.empty(0, dtype=torch.uint8)
        assert digest_v2(t) == want, f"{n} bytes: {digest_v2(t):016x} != {want:016x}"


def test_digest_v2_reads_dtype_and_layout_as_bytes():
    x = torch.randn(37, 11).to(torch.bfloat16)
    assert digest_v2(x) == digest_v2(x.view(torch.uint8))
    assert digest_v2(x.t().contiguous()) != digest_v2(x)
    assert digest_v2(x.t()) == digest_v2(x.t().contiguous())  # row-major of what it shows
    y = x.clone()
    y.view(torch.int16)[5, 3] += 1  # one ULP
    assert digest_v2(y) != digest_v2(x)


def test_digest_v2_updates_from_the_changed_words_alone():
    from refit.digest import apply_delta, word_sum
    x = torch.randn(1000, 3).to(torch.bfloat16)  # 6000 bytes: 750 words
    y = x.clone()
    flat = y.view(-1).view(torch.int16)
    changed = torch.tensor([0, 5, 6, 7, 2999])
    flat[changed] += 1
    words = torch.unique(changed // 4)  # 4 bf16 elements per 8-byte word
    old = x.view(-1).view(torch.int64)[words]
    new = y.view(-1).view(torch.int64)[words]
    delta = (word_sum(words, new) - word_sum(words, old)) & ((1 << 64) - 1)
    assert apply_delta(digest_v2(x), 6000, delta) == digest_v2(y)
    assert apply_delta(digest_v2(x), 6000, 0) == digest_v2(x)
