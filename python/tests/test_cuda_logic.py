"""The CUDA IPC logic that needs no GPU: UUID forms, choosing the local device by UUID, region
checks, error wording, and a consumer given a CUDA layout on a machine that cannot map it."""
from __future__ import annotations

import uuid

import pytest
import torch

from refit import RefitError, _cuda
from refit._proto import common_pb2, local_pb2
from refit.inference import Consumer

RAW = bytes(range(0x10, 0x20))
TEXT = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
OTHER = bytes(range(0xA0, 0xB0))


def test_uuid_forms():
    assert _cuda.uuid_text(RAW) == TEXT
    for form in (RAW, bytearray(RAW), TEXT, TEXT.upper().replace("GPU-", "GPU-"),
                 TEXT[len("GPU-"):], TEXT.replace("-", "").replace("GPU", "GPU-"),
                 "MIG-" + TEXT[len("GPU-"):], uuid.UUID(bytes=RAW), f"  {TEXT}\n"):
        assert _cuda.uuid_bytes(form) == RAW, form

    class CUuuid:  # PyTorch >= 2: get_device_properties(i).uuid, .bytes a list of ints
        bytes = list(RAW)

        def __str__(self):
            return TEXT[len("GPU-"):]

    assert _cuda.uuid_bytes(CUuuid()) == RAW
    assert _cuda.uuid_bytes(_cuda.uuid_text(OTHER)) == OTHER  # round trip
    for bad in (b"\x00" * 15, "GPU-1234", "GPU-10111213-1415-1617-1819-1a1b1c1d1e1g", ""):
        with pytest.raises(ValueError):
            _cuda.uuid_bytes(bad)
    with pytest.raises(ValueError, match="16 bytes, not 3"):
        _cuda.uuid_text(b"abc")


def test_choose_ordinal_remaps_by_uuid():
    # The daemon sees this GPU as its ordinal 0; with CUDA_VISIBLE_DEVICES=1,0 here it is ordinal 1.
    devices = [(0, OTHER), (1, RAW)]
    assert _cuda.choose_ordinal(RAW, devices) == 1
    assert _cuda.choose_ordinal(OTHER, devices) == 0
    assert _cuda.choose_ordinal(RAW, [(0, TEXT)]) == 0  # any UUID form on either side
    assert _cuda.choose_ordinal(RAW, [(0, OTHER)]) is None
    assert _cuda.choose_ordinal(RAW, []) is None


def test_visible_devices_text():
    assert _cuda.visible_devices_text({}) == "CUDA_VISIBLE_DEVICES unset"
    assert _cuda.visible_devices_text({"CUDA_VISIBLE_DEVICES": "2,3"}) == "CUDA_VISIBLE_DEVICES=2,3"
    assert _cuda.visible_devices_text({"CUDA_VISIBLE_DEVICES": ""}) == "CUDA_VISIBLE_DEVICES=''"
    assert (_cuda.visible_devices_text({"CUDA_VISIBLE_DEVICES": "GPU-ab cd"}) ==
            "CUDA_VISIBLE_DEVICES='GPU-ab cd'")


def test_messages_name_tensor_gpu_and_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    msg = _cuda.not_visible_message("layers.0.w", RAW, [(0, OTHER)], env)
    assert "tensor 'layers.0.w'" in msg and TEXT in msg and "CUDA_VISIBLE_DEVICES=3" in msg
    assert f"cuda:0 {_cuda.uuid_text(OTHER)}" in msg and "docs/CUDA_IPC.md" in msg
    assert "visible GPUs: none" in _cuda.not_visible_message("w", RAW, [], env)
    msg = _cuda.cuda_unavailable_message("w", RAW, None, {})
    assert "tensor 'w'" in msg and TEXT in msg and "CPU-only PyTorch" in msg
    assert "CUDA_VISIBLE_DEVICES unset" in msg
    assert "built with CUDA 12.1" in _cuda.cuda_unavailable_message("w", RAW, "12.1", {})
    msg = _cuda.open_failed_message("w", RAW, 2, "CUDA_ERROR_INVALID_VALUE", env)
    assert "tensor 'w'" in msg and "cuda:2" in msg and TEXT in msg
    assert "CUDA_VISIBLE_DEVICES=3" in msg and "CUDA_ERROR_INVALID_VALUE" in msg
    assert "IPC namespace" in msg


def test_region_checks():
    h = b"\x01" * 64
    _cuda.check_cuda_region("w", h, RAW, offset=512, size_bytes=1024, allocation_bytes=1536,
                            expected_bytes=1024)          # ends exactly at the allocation's end
    _cuda.check_cuda_region("w", h, RAW, 1 << 40, 1024, 0, 1024)  # size unknown: not checked
    with pytest.raises(ValueError, match=r"'w'.*\[513, 1537\).*1536 bytes"):
        _cuda.check_cuda_region("w", h, RAW, 513, 1024, 1536, 1024)
    with pytest.raises(ValueError, match="'w'.*1000 bytes.*1024 bytes"):
        _cuda.check_cuda_region("w", h, RAW, 0, 1000, 0, 1024)
    with pytest.raises(ValueError, match="'w'.*handle of 63 bytes"):
        _cuda.check_cuda_region("w", h[:63], RAW, 0, 1024, 0, 1024)
    with pytest.raises(ValueError, match="'w'.*UUID of 4 bytes"):
        _cuda.check_cuda_region("w", h, b"abcd", 0, 1024, 0, 1024)


def cuda_layout(uuid_bytes: bytes, offset: int = 0, allocation_bytes: int = 1 << 20):
    layout = local_pb2.Layout(version=7)
    loc = layout.tensors.add()
    loc.spec.name = "blocks.3.attn.w"
    loc.spec.dtype = common_pb2.DTYPE_BF16
    loc.spec.shape.extend([16, 32])
    r = loc.cuda_ipc
    r.ipc_handle = b"\x07" * 64
    r.device_uuid = uuid_bytes
    r.offset = offset
    r.size_bytes = 16 * 32 * 2
    r.allocation_bytes = allocation_bytes
    return layout


def test_consumer_refuses_a_cuda_layout_it_cannot_map(tmp_path):
    """No GPU: CUDA unavailable. With GPUs: a UUID none of them has. Either way a RefitError
    naming the tensor, the GPU and this process's CUDA_VISIBLE_DEVICES, before any handle is
    opened. (CUDA_VISIBLE_DEVICES is not changed here: it would stick to torch's CUDA state.)"""
    c = Consumer(str(tmp_path / "nobody.sock"), name="t")  # never connects
    missing = bytes(16)  # all-zero UUID: no real GPU has it
    with pytest.raises(RefitError) as e:
        c._tensors_of(cuda_layout(missing))
    msg = str(e.value)
    assert "tensor 'blocks.3.attn.w'" in msg and _cuda.uuid_text(missing) in msg
    assert _cuda.visible_devices_text() in msg
    assert e.value.code is None
    if torch.cuda.is_available():
        assert "not visible to this process" in msg
    else:
        assert "CUDA is not available" in msg
    # A region outside its allocation is refused before CUDA is touched.
    with pytest.raises(ValueError, match="outside its allocation"):
        c._tensors_of(cuda_layout(missing, offset=(1 << 20) - 100))
    c.close()
