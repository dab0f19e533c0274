"""What bench/vllm/run.py measures inside the vLLM worker process (LLM.collective_rpc with
VLLM_ALLOW_INSECURE_SERIALIZATION=1; run.py puts this directory on the workers' PYTHONPATH). Each
function takes the worker first. Peak extra memory: the process's peak RSS (VmHWM) is reset
(/proc/self/clear_refs 5) before the measured step and read after it, minus the RSS before.
REFIT_BENCH_PROFILE=1 prints a cProfile of the in-place apply."""
from __future__ import annotations

import ctypes
import gc
import os
import time

import torch
from worker_fns import _plain_model  # python/tests_vllm: the loader-built model


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def hwm_reset(worker=None) -> int:
    """Returns freed heap memory to the system (malloc_trim: otherwise a step's allocations reuse
    pages an earlier step left and do not show), resets the peak RSS; returns the RSS now, in
    bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def hwm_read(worker=None) -> int:
    return _status_kb("VmHWM") * 1024


def _measure(fn):
    before = hwm_reset()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, seconds, max(0, hwm_read() - before)


def setup(worker, model_dir, single_copy_socket):
    """Three loader-built models (the parameters before vLLM's CPU repacking): one for the
    refitd in-place path (an engine of the `refitd` backend of its own, on the single-copy
    subscriber), one for vLLM's sparse patch loader, one for full load_weights."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from refit.inference import Consumer
    from refit.vllm.engine import RefitInitInfo, RefitWeightTransferEngine
    worker._b_inplace = _plain_model(worker, model_dir, "bench_inplace")
    worker._b_sparse = _plain_model(worker, model_dir, "bench_sparse")
    worker._b_full = _plain_model(worker, model_dir, "bench_full")
    eng = RefitWeightTransferEngine(WeightTransferConfig(backend="refitd"), worker.vllm_config,
                                    torch.device("cpu"), worker._b_inplace)
    eng.init_transfer_engine(RefitInitInfo(socket=single_copy_socket, consumer="bench-inplace",
                                           hold_version=False))
    worker._b_engine = eng
    worker._b_consumer = Consumer(single_copy_socket, name="bench")
    worker._b_version = None
    return True


def first_load(worker, version):
    """Every model loads `version` fully (unmeasured): the engine through its map, the others by
    load_weights from a lease."""
    from refit.vllm.engine import RefitUpdateInfo
    worker._b_engine.receive_weights(RefitUpdateInfo(version=version))
    with worker._b_consumer.attach(version) as w, torch.no_grad():
        items = sorted(w.items())
        worker._b_sparse.load_weights(iter(items))
        worker._b_full.load_weights(iter(items))
    worker._b_version = version
    return worker._b_engine.last_update["path"]


def update_all(worker, version):
    """One version by each path, from the same change set (fetched once, outside the
    measurements): the refitd engine's in-place apply (its own code: write, digest check, undo
    record), vLLM's load_checkpoint_weight_patches (a full-shape NaN tensor per patched tensor,
    load_weights with a NaN-masked copy_), and the model's own load_weights of every tensor."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)
    from refit.changes import get_changes
    cs = get_changes(worker._b_consumer, worker._b_version, version)
    if cs.reload_fully:
        raise RuntimeError(f"no change set {worker._b_version} -> {version}: {cs.reason}")
    nbytes = cs.nbytes()
    out = {"version": version, "changed_elements": cs.changed_elements(),
           "change_set_bytes": nbytes}
    eng = worker._b_engine
    if os.environ.get("REFIT_BENCH_PROFILE"):
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
    _, sec, peak = _measure(lambda: eng._apply_change_set(cs, time.monotonic()))
    if os.environ.get("REFIT_BENCH_PROFILE"):
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    assert eng.last_update["path"] == "in_place", eng.last_update
    out["refitd_in_place"] = {"seconds": sec, "peak_extra_bytes": peak,
                              "undo_bytes": eng.last_update["undo_bytes"],
                              "verified_tensors": len(eng.last_update["verified"])}
    patches = [CheckpointWeightPatch(n, c.shape, c.values.dtype, c.values, c.indices)
               for n, c in sorted(cs.tensors.items()) if c.indices.numel()]
    _, sec, peak = _measure(lambda: load_checkpoint_weight_patches(worker._b_sparse, patches))
    out["vllm_sparse_patch"] = {"seconds": sec, "peak_extra_bytes": peak}
    with worker._b_consumer.attach(version) as w:
        items = sorted(w.items())
        with torch.no_grad():
            _, sec, peak = _measure(lambda: worker._b_full.load_weights(iter(items)))
    out["full_load_weights"] = {"seconds": sec, "peak_extra_bytes": peak}
    worker._b_version = version
    return out


def same_weights(worker) -> list:
    """Names where the in-place, sparse and full models disagree (all must hold one version)."""
    a = dict(worker._b_inplace.named_parameters())
    b = dict(worker._b_sparse.named_parameters())
    c = dict(worker._b_full.named_parameters())
    return sorted(n for n in a if not (torch.equal(a[n], b[n]) and torch.equal(a[n], c[n])))


def engine_hwm_reset(worker):
    return hwm_reset()


def engine_hwm_read(worker):
    return hwm_read()


def last_update_of_engine(worker):
    return dict(worker.weight_transfer_engine.last_update)
