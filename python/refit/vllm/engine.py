"""The `refitd` vLLM weight-transfer engine (worker side): each update takes a version from the
local refitd subscriber, never from the trainer, applies it atomically and proves it.

A version is applied by vLLM's own layerwise reload, fed zero-copy views of the subscriber's
store (a read lease), and only for the layers the version touches: the tensors whose digests
differ from those of the version the engine holds. vLLM then re-runs its per-layer processing
(on CPU it repacks linear weights out of the parameters; online quantization runs there too), so
this is correct whatever the runtime does to weights after loading. Nothing of the model is
copied in this process beyond vLLM's own weights.

Atomic: the engine keeps a read lease on the version it serves (a subscriber with store.slots
>= 2, the default, stages the next version beside it). If loading, processing or verification
of a new version fails part way, the same layers are reloaded from the held version, so the
engine serves the previous version bit for bit, and the error is raised naming what failed.

Verified: after every update (verify "every", the default) each runtime parameter that holds a
checkpoint tensor as it is (same name, shape and dtype: embeddings, norms, and on GPU the
unfused weights) is hashed with tensor digest v2 and compared with the subscriber's digest of
that tensor; a mismatch reloads those tensors once and fails the update if it persists. The
tensors vLLM repacks, fuses or converts are verified as the store's views they were loaded from
(the subscriber verified them). `last_update` reports the coverage.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Dict, List, Optional, Set

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo, layerwise_groups)

from refit.digest import digest_v2

logger = logging.getLogger("refit.vllm")

MODES = ("auto", "reload")
VERIFY = ("every", "off")


@dataclasses.dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """init_info of the `refitd` backend."""
    socket: str                 # the subscriber's local socket (subscriber.local_socket)
    consumer: str = "vllm"      # this engine's consumer name at the subscriber
    mode: str = "auto"          # how versions are applied: auto | reload
    verify: str = "every"       # in-engine verification after each update: every | off
    timeout: float = 60.0       # seconds for each call to the subscriber

    def __post_init__(self):
        if not isinstance(self.socket, str) or not self.socket:
            raise ValueError("refitd init_info.socket: the subscriber's local socket path is "
                             "required")
        if self.mode not in MODES:
            raise ValueError(f"refitd init_info.mode {self.mode!r}: expected one of {MODES}")
        if self.verify not in VERIFY:
            raise ValueError(f"refitd init_info.verify {self.verify!r}: expected one of "
                             f"{VERIFY}")
        if not self.timeout > 0:
            raise ValueError(f"refitd init_info.timeout {self.timeout!r}: must be > 0")


@dataclasses.dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """update_info of the `refitd` backend."""
    version: int = 0            # the version to apply; 0: the newest verified one
    verify_only: bool = False   # check the held version in the runtime, apply nothing

    def __post_init__(self):
        if not isinstance(self.version, int) or isinstance(self.version, bool) or \
                self.version < 0:
            raise ValueError(f"refitd update_info.version {self.version!r}: a version "
                             f"number >= 0 (0: the newest)")


class VerificationError(RuntimeError):
    """The runtime parameters do not hold the version's bytes."""


@dataclasses.dataclass
class _Held:
    """The version the engine serves, with the lease that keeps it in the store."""
    version: int
    weights: Dict[str, torch.Tensor]
    digests: Dict[str, int]
    specs: Dict[str, tuple]
    stack: contextlib.ExitStack


def _specs(weights) -> Dict[str, tuple]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in weights.items()}


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: Optional[RefitInitInfo] = None
        self._consumer = None
        self._held: Optional[_Held] = None
        self._digest_v2: Optional[bool] = None  # whether the subscriber's digests are v2
        self.last_update: dict = {}

    # ---- the WeightTransferEngine interface ------------------------------------------------

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        from refit.inference import Consumer
        self._release_held()
        if self._consumer is not None:
            self._consumer.close()
        self._info = init_info
        self._consumer = Consumer(init_info.socket, name=init_info.consumer,
                                  timeout=init_info.timeout)
        logger.info("refitd: consumer %r of %s, mode %s, verify %s", init_info.consumer,
                    init_info.socket, init_info.mode, init_info.verify)

    def start_weight_update(self) -> None:
        self._require_init()

    def finish_weight_update(self) -> None:
        pass  # each update is applied and verified, or undone, inside receive_weights

    def update_weights(self, update_info: dict) -> None:
        # The base class would synchronize an accelerator; receive_weights does its own.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        self._require_init()
        if update_info.verify_only:
            self._verify_held()
            return
        self._update(update_info.version)

    def shutdown(self) -> None:
        self._release_held()
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    # ---- one update ------------------------------------------------------------------------

    def _require_init(self) -> None:
        if self._consumer is None:
            raise RuntimeError("refitd weight transfer engine: init_weight_transfer_engine "
                               "has not been called")

    def _update(self, version: int) -> None:
        t0 = time.monotonic()
        stack = contextlib.ExitStack()
        try:
            new = stack.enter_context(self._consumer.attach(version or None))
        except BaseException:
            stack.close()
            raise
        held = self._held
        if held is not None and new.version == held.version:
            stack.close()
            self.last_update = {"version": new.version, "path": "none", "reloaded": [],
                                "seconds": time.monotonic() - t0}
            return
        new_held = _Held(new.version, dict(new), dict(new.digests), _specs(new), stack)
        names, reason = self._plan(new_held)
        try:
            self._check_digest_format(new_held)
            self._reload(new_held, names)
            self._synchronize()
            covered = self._verify(new_held, fix=True)
        except BaseException as err:
            self._undo(names, new_held, err)
            stack.close()
            raise
        self._release_held()
        self._held = new_held
        self.last_update = {"version": new.version, "path": "reload", "reason": reason,
                            "reloaded": sorted(names), "verified": covered,
                            "tensors": len(new_held.weights),
                            "seconds": time.monotonic() - t0}
        logger.info("refitd: version %d applied by layerwise reload of %d of %d tensors (%s); "
                    "%d verified in the runtime by digest v2, %.3f s", new.version, len(names),
                    len(new_held.weights), reason, len(covered), self.last_update["seconds"])

    def _plan(self, new: _Held):
        """The checkpoint tensors to load: every tensor of each layer group (vLLM's
        layerwise_groups: one per decoder layer, plus the pre and post blocks) that holds a
        tensor whose digest changed since the held version; all of them for a first load or a
        changed manifest."""
        held = self._held
        if held is None:
            return set(new.weights), "first load"
        if held.specs != new.specs:
            return set(new.weights), "the tensors' names, dtypes or shapes changed"
        changed = {n for n, d in new.digests.items() if held.digests.get(n) != d}
        names: Set[str] = set()
        for group in layerwise_groups(sorted(new.weights)):
            if changed.intersection(group):
                names.update(group)
        return names, f"{len(changed)} tensors changed since version {held.version}"

    # ---- applying: vLLM's layerwise reload --------------------------------------------------

    def _reload(self, source: _Held, names: Set[str]) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check)
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
        if not names:
            return
        tied = self._tied_modules()
        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                self.model.load_weights((n, source.weights[n]) for n in sorted(names))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        self._reprocess_tied(tied, names)

    def _tied_modules(self) -> List[tuple]:
        """(module, partner module names) for modules with a quantization method whose weight is
        another module's parameter (a tied LM head): vLLM loads no checkpoint tensor for them, so
        its reload leaves what they derived from the shared weight (on CPU a packed copy) stale."""
        owners: Dict[int, List[str]] = {}
        for mname, module in self.model.named_modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(mname)
        out = []
        for mname, module in self.model.named_modules():
            if getattr(module, "quant_method", None) is None:
                continue
            partners = {o for p in module.parameters(recurse=False)
                        for o in owners.get(id(p), []) if o != mname}
            if partners:
                out.append((mname, module, partners))
        return out

    def _reprocess_tied(self, tied: List[tuple], names: Set[str]) -> None:
        for mname, module, partners in tied:
            if any(n.startswith(p + ".") for p in partners for n in names):
                module.quant_method.process_weights_after_loading(module)
                logger.info("refitd: %s re-processed (its weight is %s's, reloaded)", mname,
                            ", ".join(sorted(partners)))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _undo(self, names: Set[str], failed: _Held, err: BaseException) -> None:
        held = self._held
        if held is None:
            logger.error("refitd: version %d failed on first load (%s); the engine holds no "
                         "refitd version", failed.version, err)
            return
        try:
            self._reload(held, names)
            self._synchronize()
            self._verify(held, fix=False)
        except BaseException as undo_err:
            self._release_held()
            raise RuntimeError(f"refitd: version {failed.version} failed ({err!r}) and "
                               f"restoring version {held.version} failed too ({undo_err!r}): "
                               f"the next update reloads every tensor") from err
        logger.error("refitd: version %d failed (%s); version %d restored in the %d reloaded "
                     "tensors and verified", failed.version, err, held.version, len(names))

    # ---- verification -----------------------------------------------------------------------

    def _check_digest_format(self, v: _Held) -> None:
        if self._info.verify == "off" or self._digest_v2 is not None or not v.weights:
            return
        name = min(v.weights, key=lambda n: (v.weights[n].numel(), n))
        self._digest_v2 = digest_v2(v.weights[name]) == v.digests[name]
        if not self._digest_v2:
            raise VerificationError(
                f"refitd: the subscriber's digest of '{name}' (version {v.version}) is not "
                f"tensor digest v2 of its bytes: in-engine verification needs a subscriber "
                f"that verifies with digest v2 (store.digest_v2: true, the default); or set "
                f"init_info verify: off")

    def _runtime_tensors(self, v: _Held) -> Dict[str, torch.Tensor]:
        """Checkpoint name -> the runtime parameter or buffer holding it as it is."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        out = {}
        for name, (dtype, shape) in v.specs.items():
            p = params.get(name)
            if p is not None and p.dtype == dtype and tuple(p.shape) == shape and p.numel():
                out[name] = p
        return out

    def _mismatches(self, v: _Held) -> tuple:
        runtime = self._runtime_tensors(v)
        bad = sorted(n for n, p in runtime.items() if digest_v2(p) != v.digests[n])
        return sorted(runtime), bad

    def _verify(self, v: _Held, *, fix: bool) -> List[str]:
        if self._info.verify == "off":
            return []
        covered, bad = self._mismatches(v)
        if bad and fix:
            logger.error("refitd: version %d: digest mismatch in the runtime for %s; reloading "
                         "them", v.version, ", ".join(bad))
            self._reload(v, set(bad))
            self._synchronize()
            covered, bad = self._mismatches(v)
        if bad:
            raise VerificationError(
                f"refitd: version {v.version}: the runtime parameters of {len(bad)} tensors do "
                f"not hold the version's bytes (digest v2 differs from the subscriber's): "
                f"{', '.join(bad)}")
        return covered

    def _verify_held(self) -> None:
        if self._held is None:
            raise RuntimeError("refitd: verify: the engine holds no refitd version yet")
        if self._info.verify == "off":
            raise RuntimeError("refitd: verify: init_info verify is 'off'")
        covered = self._verify(self._held, fix=True)
        self.last_update = dict(self.last_update, verified=covered,
                                verify_version=self._held.version)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        try:
            held.stack.close()
        except Exception as e:  # the lease died with the subscriber: nothing left to release
            logger.warning("refitd: releasing the lease on version %d: %s", held.version, e)
