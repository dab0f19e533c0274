"""Functions the FP8 tests run inside the engine's worker process (LLM.collective_rpc with
VLLM_ALLOW_INSECURE_SERIALIZATION=1; conftest puts this directory on the workers' PYTHONPATH).
Each takes the worker first."""
from __future__ import annotations

import glob
import os

import torch


def fresh_fp8_model(worker, model_dir, prefix):
    """A fresh FP8 load of `model_dir` by vLLM's own loading code, as BaseModelLoader.load_model
    does it: the engine's model class and quantization config (online fp8_per_block), the
    checkpoint's load_weights, then vLLM's post-load processing (quantization, the CPU kernel's
    packing)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import (initialize_model,
                                                        process_weights_after_loading)
    from vllm.utils.torch_utils import set_default_torch_dtype
    cfg = worker.vllm_config
    device = torch.device(cfg.device_config.device)
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
        with device:
            model = initialize_model(vllm_config=cfg, model_config=cfg.model_config,
                                     prefix=prefix)
        state = {}
        for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
            state.update(load_file(f))
        with torch.no_grad():
            model.load_weights(iter(sorted(state.items())))
        process_weights_after_loading(model, cfg.model_config, device)
    return model


def _tensors(model):
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def compare_with_fresh_load(worker, model_dir):
    """(names whose runtime bytes differ from a fresh FP8 load of model_dir, how many tensors
    were compared, how many of them hold FP8 codes)."""
    worker._refit_fp8_count = getattr(worker, "_refit_fp8_count", 0) + 1
    ref = fresh_fp8_model(worker, model_dir, f"refit_fp8_ref{worker._refit_fp8_count}")
    got, want = _tensors(worker.model_runner.get_model()), _tensors(ref)
    bad = sorted(n for n in want if n not in got or got[n].dtype != want[n].dtype
                 or got[n].shape != want[n].shape
                 or not torch.equal(got[n].detach().reshape(-1).view(torch.uint8),
                                    want[n].detach().reshape(-1).view(torch.uint8)))
    bad += sorted(n for n in got if n not in want)
    fp8 = sum(1 for t in want.values() if t.dtype == torch.float8_e4m3fn)
    return bad, len(want), fp8


def set_torn(worker, torn):
    worker.weight_transfer_engine._fp8_torn = bool(torn)
    return True


def last_update(worker):
    return dict(worker.weight_transfer_engine.last_update)


def map_error(worker, specs):
    """The error Fp8Map.build gives for the engine's model and `specs` (name -> (dtype name,
    shape)), or None."""
    from refit.vllm.fp8 import Fp8Map
    try:
        Fp8Map.build(worker.model_runner.get_model(),
                     {n: (getattr(torch, d), tuple(s)) for n, (d, s) in specs.items()})
    except ValueError as e:
        return str(e)
    return None


def layouts(worker):
    from refit.vllm.fp8 import Fp8Map, probe_layout
    out = {}
    for prefix, m in Fp8Map.fp8_modules(worker.model_runner.get_model()).items():
        lay, how = probe_layout(m, int(m.output_size_per_partition),
                                int(m.input_size_per_partition))
        out[prefix] = how
    return out
