"""A minimal safetensors writer/reader for the tests (the format: an 8-byte little-endian header
size, a JSON header {name: {dtype, shape, data_offsets}}, then the bytes)."""
from __future__ import annotations

import json
import struct
from typing import Dict

import torch

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
          torch.float64: "F64", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
          torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL"}
NAMES = {v: k for k, v in DTYPES.items()}


def write(path: str, tensors: Dict[str, torch.Tensor]) -> None:
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read(path: str) -> Dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        raw = torch.frombuffer(bytearray(blob[base + b:base + end]), dtype=torch.uint8) \
            if end > b else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(NAMES[e["dtype"]]).reshape(e["shape"])
    return out
