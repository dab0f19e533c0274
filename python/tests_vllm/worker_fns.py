"""Functions the vLLM tests run inside the engine's worker process (LLM.collective_rpc with
VLLM_ALLOW_INSECURE_SERIALIZATION=1; conftest puts this directory on the workers' PYTHONPATH so
that they are pickled by reference). Each takes the worker first."""
from __future__ import annotations

import glob
import os

import torch


def corrupt_embedding(worker):
    w = worker.model_runner.get_model().model.embed_tokens.weight
    with torch.no_grad():
        w[:64].view(torch.int16).add_(7)
    return True


def last_update(worker):
    return dict(worker.weight_transfer_engine.last_update)


def _plain_model(worker, model_dir, prefix):
    """The model as vLLM's loader builds it from `model_dir`'s safetensors, before any
    post-load processing (vLLM's CPU runtime would then repack its linear weights)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    cfg = worker.vllm_config
    # As vLLM's loader does (BaseModelLoader.load_model), before its post-load processing.
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), \
            torch.device(cfg.device_config.device):
        model = initialize_model(vllm_config=cfg, model_config=cfg.model_config, prefix=prefix)
    state = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        state.update(load_file(f))
    with torch.no_grad():
        model.load_weights(iter(sorted(state.items())))
    return model


def plain_start(worker, model_dir):
    """A loader-built model (from model_dir) becomes the engine's update target."""
    worker._refit_plain = _plain_model(worker, model_dir, "refit_plain")
    worker._refit_count = 0
    return True


def plain_apply(worker, version, corrupt=False):
    """Applies `version` to the loader-built model through the engine's own update code; with
    `corrupt`, one value of the change set is altered first. Returns (last_update, error)."""
    from refit.vllm.engine import RefitUpdateInfo
    import refit.changes
    engine = worker.weight_transfer_engine
    engine.set_weight_update_target(worker._refit_plain, engine.model_config)
    original = refit.changes.get_changes

    def altered(*args, **kwargs):
        cs = original(*args, **kwargs)
        for c in cs.tensors.values():
            if c.values.numel():
                c.values.view(torch.int16)[0] += 1
                break
        return cs

    if corrupt:
        refit.changes.get_changes = altered
    try:
        engine.receive_weights(RefitUpdateInfo(version=int(version)))
        err = None
    except Exception as e:  # reported to the test
        err = f"{type(e).__name__}: {e}"
    finally:
        refit.changes.get_changes = original
        engine.reset_weight_update_target()
    return dict(engine.last_update), err


def plain_compare(worker, model_dir):
    """Names of the loader-built model's parameters and buffers whose bytes differ from those of
    a model loaded fully from `model_dir` by the model's own load_weights, and how many were
    compared."""
    worker._refit_count += 1
    ref = _plain_model(worker, model_dir, f"refit_ref{worker._refit_count}")
    got = dict(worker._refit_plain.named_parameters(remove_duplicate=False))
    got.update(worker._refit_plain.named_buffers(remove_duplicate=False))
    want = dict(ref.named_parameters(remove_duplicate=False))
    want.update(ref.named_buffers(remove_duplicate=False))
    assert all(t.dtype != torch.float32 for n, t in want.items() if n.endswith("weight")), \
        "the loader-built model is not in the engine's dtype"
    bad = sorted(n for n in want if n not in got or got[n].dtype != want[n].dtype
                 or got[n].shape != want[n].shape
                 or not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                    want[n].reshape(-1).view(torch.uint8)))
    return bad, len(want)
