"""The `refitd` vLLM weight-transfer engine (worker side): each update takes a version from the
local refitd subscriber, never from the trainer, applies it atomically and proves it.

Two ways to apply a version, chosen per model and runtime (init_info mode "auto"), the reason
logged and reported in `last_update`:

In place, O(changed): when every checkpoint tensor reaches the runtime parameters unchanged
(refit.vllm.param_map: the model's own load_weights run once on probe tensors maps checkpoint
elements to runtime storage, through fused qkv/gate_up and shards), the change set from the held
version (GetChanges, composed by the subscriber for skipped versions; a single-copy subscriber,
store.slots 1) is written straight into the parameters (refit.vllm.inplace), verified from the
touched words by digest v2, and undone from the overwritten values on any failure. A first load,
or a change set the subscriber cannot give, copies every tensor through the same map from a
lease of the version and verifies each tensor read back from the runtime.

Layerwise reload, for runtimes that repack or quantize weights after loading (vLLM on CPU packs
linear weights out of the parameters; online FP8). A version is applied by vLLM's own layerwise
reload, fed zero-copy views of the subscriber's store (a read lease), and only for the layers the
version touches: the tensors whose digests differ from those of the version the engine holds. vLLM then re-runs its per-layer processing
(on CPU it repacks linear weights out of the parameters; online quantization runs there too), so
this is correct whatever the runtime does to weights after loading. Nothing of the model is
copied in this process beyond vLLM's own weights.

Atomic: on this path the engine keeps a read lease on the version it serves (init_info
hold_version, default on; a subscriber with store.slots >= 2, the default, stages the next
version beside it; a single-copy subscriber needs hold_version off, and a failed reload is then
retried from the new version rather than undone). If loading, processing or verification
of a new version fails part way, the same layers are reloaded from the held version, so the
engine serves the previous version bit for bit, and the error is raised naming what failed.

Verified: after every update (verify "every", the default) the runtime tensors are hashed with
tensor digest v2 and compared with the subscriber's digests: in place every tensor, read back
through the map (a change set: from its touched words alone); on the reload path each runtime
parameter that holds a checkpoint tensor as it is (same name, shape and dtype: embeddings,
norms); a mismatch reloads those tensors once and fails the update if it persists. The
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

MODES = ("auto", "reload", "in_place")
VERIFY = ("every", "off")


@dataclasses.dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """init_info of the `refitd` backend."""
    socket: str                 # the subscriber's local socket (subscriber.local_socket)
    consumer: str = "vllm"      # this engine's consumer name at the subscriber
    mode: str = "auto"          # how versions are applied: auto | reload | in_place
    verify: str = "every"       # in-engine verification after each update: every | off
    timeout: float = 60.0       # seconds for each call to the subscriber
    hold_version: bool = True   # reload path: keep a lease on the served version (the undo)

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
    stack: Optional[contextlib.ExitStack]   # the lease, when one is held


def _specs(weights) -> Dict[str, tuple]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in weights.items()}


def _whole_groups(names: Set[str], specs: Dict[str, tuple]) -> Set[str]:
    """`names` grown to whole layer groups (vLLM's layerwise_groups: a layer is processed once
    all its tensors arrived, so a reload loads all of them)."""
    out: Set[str] = set()
    for group in layerwise_groups(sorted(specs)):
        if names.intersection(group):
            out.update(group)
    return out


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
        self._map = None       # refit.vllm.param_map.ParamMap of self.model
        self._map_key = None
        self._fp8_key = None   # id of the model _fp8_any was found for
        self._fp8_any = False  # whether the model holds FP8 block-quantized weights
        self._fp8_map = None   # (specs key, refit.vllm.fp8.Fp8Map)
        self._fp8_torn = False  # tests only: write FP8 codes without their scales
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

    def _reconnecting(self, call):
        """call(consumer); once more on a new channel when the subscriber was unreachable (a
        restarted subscriber: gRPC's channel may still be backing off from the dead one)."""
        import grpc
        from refit._common import RefitError
        try:
            return call(self._consumer)
        except RefitError as e:
            if e.code != grpc.StatusCode.UNAVAILABLE:
                raise
        from refit.inference import Consumer
        with contextlib.suppress(Exception):
            self._consumer.close()
        info = self._info
        self._consumer = Consumer(info.socket, name=info.consumer, timeout=info.timeout)
        return call(self._consumer)

    def _update(self, version: int) -> None:
        t0 = time.monotonic()
        held = self._held
        note = ""
        if self._serves_fp8():
            self._update_fp8(version, t0)
            return
        if held is not None and self._path_for(held.specs)[0] == "in_place":
            from refit.changes import get_changes
            changes = self._reconnecting(lambda c: get_changes(c, held.version, version))
            if not changes.reload_fully:
                self._apply_change_set(changes, t0)
                return
            note = f"; the subscriber gives no change set ({changes.reason})"
        self._update_from_lease(version, t0, note)

    def _update_from_lease(self, version: int, t0: float, note: str) -> None:
        """Applies a version from a lease of it: the layers it touches by layerwise reload, or
        (in place) its changed tensors copied through the map."""
        stack = contextlib.ExitStack()
        try:
            new = self._reconnecting(
                lambda c: stack.enter_context(c.attach(version or None)))
        except BaseException:
            stack.close()
            raise
        held = self._held
        if held is not None and new.version == held.version:
            stack.close()
            self._report_nothing_to_do(new.version, t0)
            return
        new_held = _Held(new.version, dict(new), dict(new.digests), _specs(new), stack)
        path, why = self._path_for(new_held.specs)
        names, reason = self._plan(new_held, path)
        try:
            self._check_digest_format(new_held)
            self._load(path, new_held, names)
            covered = self._verify(new_held, fix=True)
        except BaseException as err:
            rolled_forward = self._undo(path, names, new_held, err)
            stack.close()
            if not rolled_forward:
                raise
            self._report(new.version, path, why + note, f"{reason}; loaded twice, the first "
                         f"attempt failed: {err!r}", names, self._runtime_names(new_held), t0)
            return
        self._release_held()
        if path == "in_place" or not self._info.hold_version:
            new_held.weights, new_held.stack = {}, None
            stack.close()
        self._held = new_held
        if path == "in_place":
            # Registers as a change-set consumer holding this version: a single-copy subscriber
            # keeps the change sets from here on for it.
            from refit.changes import get_changes
            self._reconnecting(lambda c: get_changes(c, new.version, new.version))
        self._report(new.version, path, why + note, reason, names, covered, t0)

    def _report(self, version, path, why, reason, names, covered, t0, **extra) -> None:
        self.last_update = dict({"version": version, "path": path, "why": why,
                                 "reason": reason, "loaded": sorted(names),
                                 "verified": covered, "seconds": time.monotonic() - t0},
                                **extra)
        logger.info("refitd: version %d applied %s (%s): %d tensors (%s); %d verified in the "
                    "runtime by digest v2, %.3f s", version, path.replace("_", " "), why,
                    len(names), reason, len(covered), self.last_update["seconds"])

    def _report_nothing_to_do(self, version: int, t0: float) -> None:
        """The engine holds `version` already: nothing loaded."""
        self.last_update = {"version": version, "path": "none", "loaded": [],
                            "seconds": time.monotonic() - t0}

    # ---- in place ---------------------------------------------------------------------------

    def _path_for(self, specs: Dict[str, tuple]) -> tuple:
        """("in_place" | "reload", why) for the engine's model and a version of `specs`."""
        mode = self._info.mode
        if mode == "reload":
            return "reload", "init_info mode reload"
        pmap = self._param_map(specs)
        if pmap.complete():
            return "in_place", "every tensor reaches the runtime parameters unchanged"
        why = f"not every tensor reaches the runtime parameters unchanged: {pmap.why_not()}"
        if mode == "in_place":
            raise ValueError(f"refitd: init_info mode in_place: {why}")
        return "reload", why

    def _param_map(self, specs: Dict[str, tuple]):
        from refit.vllm import param_map
        key = (id(self.model), tuple(sorted((n, str(d), s) for n, (d, s) in specs.items())))
        if self._map_key != key:
            self._map = param_map.build(self.model, specs)
            self._map_key = key
            logger.info("refitd: checkpoint -> runtime map: %d of %d tensors reachable in place%s",
                        len(specs) - len(self._map.unreachable), len(specs),
                        "" if self._map.complete() else f" ({self._map.why_not()})")
        return self._map

    def _apply_change_set(self, changes, t0: float) -> None:
        from refit.vllm.inplace import InPlaceWriter, undo_bytes
        held = self._held
        if changes.to_version == held.version:
            self._report_nothing_to_do(held.version, t0)
            return
        writer = InPlaceWriter(self._map)
        writer.check(changes)  # nothing is written unless every tensor can be
        undo, digests, bad = writer.apply(changes, held.digests)
        try:
            if bad and self._info.verify != "off":
                raise VerificationError(
                    f"refitd: version {changes.to_version}: after writing the change set from "
                    f"version {changes.from_version}, the runtime words of {len(bad)} tensors "
                    f"do not give the subscriber's digest v2: {', '.join(bad)}")
            self._synchronize()
        except BaseException:
            writer.undo(undo)
            self._synchronize()
            logger.error("refitd: change set %d -> %d undone", changes.from_version,
                         changes.to_version)
            raise
        new_digests = dict(held.digests)
        new_digests.update(digests)
        self._held = _Held(changes.to_version, {}, new_digests, held.specs, None)
        nbytes = changes.nbytes()
        self._report(changes.to_version, "in_place", "change set from version "
                     f"{changes.from_version}", f"{changes.changed_elements()} elements changed",
                     [n for n, c in changes.tensors.items() if c.indices.numel()],
                     [] if self._info.verify == "off" else sorted(digests), t0,
                     change_set_bytes=nbytes, undo_bytes=undo_bytes(undo))

    def _plan(self, new: _Held, path: str):
        """The checkpoint tensors to load: those whose digest changed since the held version (in
        place), or every tensor of each layer group (vLLM's layerwise_groups: one per decoder
        layer, plus the pre and post blocks) holding one (reload); all of them for a first load
        or a changed manifest."""
        held = self._held
        if held is None:
            return set(new.weights), "first load"
        if held.specs != new.specs:
            return set(new.weights), "the tensors' names, dtypes or shapes changed"
        changed = {n for n, d in new.digests.items() if held.digests.get(n) != d}
        reason = f"{len(changed)} tensors changed since version {held.version}"
        if path == "in_place":
            return changed, reason
        return _whole_groups(changed, new.specs), reason

    # ---- FP8 delivery -----------------------------------------------------------------------

    def _serves_fp8(self) -> bool:
        """Whether the model holds FP8 block-quantized weights that versions are delivered to as
        FP8 codes and scales (refit.vllm.fp8), unless init_info mode is reload."""
        if self._info.mode == "reload":
            return False
        if self._fp8_key != id(self.model):
            from refit.vllm.fp8 import Fp8Map
            self._fp8_key = id(self.model)
            self._fp8_any = bool(Fp8Map.fp8_modules(self.model))
            self._fp8_map = None
        return self._fp8_any

    def _fp8_writer(self, specs: Dict[str, tuple]):
        from refit.vllm.fp8 import Fp8Map, Fp8Writer
        key = tuple(sorted((n, str(d), s) for n, (d, s) in specs.items()))
        if self._fp8_map is None or self._fp8_map[0] != key:
            fmap = Fp8Map.build(self.model, specs)
            self._fp8_map = (key, fmap)
            logger.info("refitd: FP8 delivery: %d FP8 block-quantized modules (%s), %d tensors "
                        "kept in BF16", len(fmap.modules),
                        ", ".join(sorted({m.layout.name for m in fmap.modules.values()})),
                        len(fmap.bf16))
        return Fp8Writer(self._fp8_map[1])

    def _update_fp8(self, version: int, t0: float) -> None:
        """A version as FP8 codes and scales of the blocks it touches (the change set from the
        held version; every block of the changed tensors without one; all for a first load),
        quantized from the subscriber's BF16 version, plus the changed BF16-kept tensors, all
        written in place in this one call (the engine is paused) and undone on any failure."""
        from refit.changes import get_changes
        from refit.vllm.fp8 import Stats
        held = self._held
        changes, note = None, ""
        if held is not None:
            changes = self._reconnecting(lambda c: get_changes(c, held.version, version))
            if changes.reload_fully:
                note = f"; no change set ({changes.reason}): every block of the changed tensors"
                changes = None
            elif changes.to_version == held.version:
                self._report_nothing_to_do(held.version, t0)
                return
        target = changes.to_version if changes is not None else version
        with contextlib.ExitStack() as stack:
            new = self._reconnecting(lambda c: stack.enter_context(c.attach(target or None)))
            if held is not None and new.version == held.version:
                self._report_nothing_to_do(new.version, t0)
                return
            specs = _specs(new)
            writer = self._fp8_writer(specs)
            fmap = writer.map
            full = held is None or held.specs != specs
            if full:
                changed = set(specs)
                reason = "first load" if held is None else "the tensors' names, dtypes or " \
                                                           "shapes changed"
            else:
                changed = {n for n, d in new.digests.items() if held.digests.get(n) != d}
                reason = f"{len(changed)} tensors changed since version {held.version}"
            if changes is not None:
                blocks = writer.touched_blocks(changes)
            else:
                blocks = writer.all_blocks(sorted({fmap.of_tensor[n][0] for n in changed
                                                   if n in fmap.of_tensor}))
            stats = Stats(blocks_total=writer.blocks_total())
            undo, undo16 = [], []
            bf16 = sorted(n for n in changed if n in fmap.bf16)
            try:
                self._check_digest_format(_Held(new.version, dict(new), dict(new.digests),
                                                specs, None))
                undo, bad = writer.write(blocks, new, stats,
                                         write_scales=not self._fp8_torn)
                for n in bf16:
                    c = changes.tensors.get(n) if changes is not None else None
                    if c is None:
                        stats.bf16_elements += writer.write_bf16(n, None, new[n], undo16)
                    elif c.indices.numel():
                        stats.bf16_elements += writer.write_bf16(n, c.indices, c.values, undo16)
                self._synchronize()
                covered = self._verify_fp8(new, writer, bad, bf16, full)
                reprocessed = writer.reprocess(bf16)
                self._reprocess_tied(self._tied_modules(), set(bf16))
                self._synchronize()
            except BaseException:
                writer.undo(undo)
                writer.undo_bf16(undo16)
                writer.reprocess(bf16)
                self._reprocess_tied(self._tied_modules(), set(bf16))
                self._synchronize()
                logger.error("refitd: FP8 delivery of version %d undone", new.version)
                raise
        self._release_held()
        self._held = _Held(new.version, {}, dict(new.digests), specs, None)
        # Registers as a change-set consumer holding this version (a single-copy subscriber then
        # keeps the change sets from here on for it).
        self._reconnecting(lambda c: get_changes(c, new.version, new.version))
        self._report(new.version, "fp8_in_place",
                     "FP8 block-quantized weights: codes and scales of the touched blocks" + note,
                     reason, sorted(changed), covered, t0,
                     fp8=dict(dataclasses.asdict(stats), reprocessed=reprocessed,
                              change_set_bytes=changes.nbytes() if changes is not None else None,
                              layouts=sorted({m.layout.name for m in fmap.modules.values()})))

    def _check_bf16_kept(self, version: int, writer, names, digests: Dict[str, int]) -> None:
        """The runtime parameters of the tensors the engine keeps in BF16 (`names`) hold the
        version's bytes: their digests v2 equal the subscriber's (`digests`)."""
        wrong = sorted(n for n in names if digest_v2(writer.bf16_runtime(n)) != digests[n])
        if wrong:
            raise VerificationError(
                f"refitd: version {version}: the runtime parameters of {len(wrong)} tensors "
                f"kept in BF16 do not hold the version's bytes: {', '.join(wrong)}")

    def _verify_fp8(self, new, writer, bad: List[str], bf16: List[str], full: bool) -> List[str]:
        """The written blocks read back equal the quantizer's output (`bad` lists the modules
        where they do not: codes without their scale, a lost write); the written BF16-kept
        tensors' digests v2 equal the subscriber's; after a full load, the digests of every FP8
        tensor's codes and scales equal those of the quantized BF16 version."""
        if self._info.verify == "off":
            return []
        if bad:
            raise VerificationError(
                f"refitd: version {new.version}: the FP8 codes and scales read back from "
                f"{len(bad)} modules are not the quantizer's output for the version's BF16 "
                f"weights (a torn or lost write): {', '.join(bad)}")
        self._check_bf16_kept(new.version, writer, bf16, new.digests)
        covered = list(bf16)
        if full:
            covered += self._fp8_full_check(new, writer)
        return covered

    def _fp8_full_check(self, weights, writer) -> List[str]:
        want, got = writer.digests(weights)
        wrong = sorted(p for p in want if want[p] != got[p])
        if wrong:
            raise VerificationError(
                f"refitd: version {weights.version}: digests of the runtime FP8 codes/scales of "
                f"{len(wrong)} modules differ from those of the version's BF16 weights quantized "
                f"as the engine does: {', '.join(wrong)}")
        return [f"{p}.weight" for p in want] + [f"{p}.weight_scale_inv" for p in want]

    # ---- applying from a lease -------------------------------------------------------------

    def _load(self, path: str, source: _Held, names: Set[str]) -> None:
        if path == "in_place":
            from refit.vllm.inplace import InPlaceWriter
            writer = InPlaceWriter(self._param_map(source.specs))
            for n in sorted(names):
                writer.write_full(n, source.weights[n])
        else:
            self._reload(source, _whole_groups(names, source.specs))
        self._synchronize()

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

    def _undo(self, path: str, names: Set[str], failed: _Held, err: BaseException) -> bool:
        """After a failed load of `failed`: the same tensors again from the held version's lease
        (bit for bit the previous version; returns False), or, with no lease held, from `failed`
        once more (rolling forward, never a mix; returns True: the engine holds `failed` now,
        complete and verified). Raises when neither works; the engine then holds no refitd
        version and the next update loads every tensor."""
        held = self._held
        back = held is not None and bool(held.weights)
        source = held if back else failed
        try:
            self._load(path, source, names)
            self._verify(source, fix=False)
        except BaseException as undo_err:
            self._release_held()
            what = f"restoring version {held.version}" if back else "loading it again"
            raise RuntimeError(f"refitd: version {failed.version} failed ({err!r}); {what} "
                               f"failed too ({undo_err!r}): the engine holds no refitd version, "
                               f"the next update loads every tensor") from err
        if back:
            logger.error("refitd: version %d failed (%s); version %d restored in the %d loaded "
                         "tensors and verified", failed.version, err, held.version, len(names))
            return False
        logger.error("refitd: version %d failed once (%s); loaded again and verified",
                     failed.version, err)
        self._release_held()
        self._held = _Held(failed.version, {}, dict(failed.digests), failed.specs, None)
        return True

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

    def _runtime_tensors(self, v: _Held) -> Dict[str, object]:
        """Checkpoint name -> a callable giving the tensor as the runtime holds it: read back
        through the map (in place), or the runtime parameter or buffer holding it as it is."""
        path = self._path_for(v.specs)[0]
        if path == "in_place":
            return {n: (lambda n=n: self._map.gather(n)) for n in v.specs}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        out = {}
        for name, (dtype, shape) in v.specs.items():
            p = params.get(name)
            if p is not None and p.dtype == dtype and tuple(p.shape) == shape and p.numel():
                out[name] = (lambda p=p: p)
        return out

    def _runtime_names(self, v: _Held) -> List[str]:
        return [] if self._info.verify == "off" else sorted(self._runtime_tensors(v))

    def _mismatches(self, v: _Held) -> tuple:
        runtime = self._runtime_tensors(v)
        bad = sorted(n for n, read in runtime.items() if digest_v2(read()) != v.digests[n])
        return sorted(runtime), bad

    def _verify(self, v: _Held, *, fix: bool) -> List[str]:
        if self._info.verify == "off":
            return []
        covered, bad = self._mismatches(v)
        if bad and fix:
            logger.error("refitd: version %d: digest mismatch in the runtime for %s; loading "
                         "them again", v.version, ", ".join(bad))
            self._load(self._path_for(v.specs)[0], v, set(bad))
            covered, bad = self._mismatches(v)
        if bad:
            raise VerificationError(
                f"refitd: version {v.version}: the runtime parameters of {len(bad)} tensors do "
                f"not hold the version's bytes (digest v2 differs from the subscriber's): "
                f"{', '.join(bad)}")
        return covered

    def _verify_held(self) -> None:
        """Checks every tensor the runtime holds as it is (or, in place, all of them) against
        the held version's digests; mismatches are loaded again from a lease of that version."""
        held = self._held
        if held is None:
            raise RuntimeError("refitd: verify: the engine holds no refitd version yet")
        if self._info.verify == "off":
            raise RuntimeError("refitd: verify: init_info verify is 'off'")
        if self._serves_fp8():
            with self._consumer.attach(held.version) as w:
                writer = self._fp8_writer(held.specs)
                covered = self._fp8_full_check(w, writer)
                bf16 = sorted(writer.map.bf16)
                self._check_bf16_kept(held.version, writer, bf16, held.digests)
            self.last_update = dict(self.last_update, verified=covered + bf16,
                                    verify_version=held.version)
            return
        if held.weights:
            covered = self._verify(held, fix=True)
        else:
            with self._consumer.attach(held.version) as w:
                leased = _Held(held.version, dict(w), held.digests, held.specs, None)
                covered = self._verify(leased, fix=True)
        self.last_update = dict(self.last_update, verified=covered, verify_version=held.version)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        if held.stack is None:
            return
        try:
            held.stack.close()
        except Exception as e:  # the lease died with the subscriber: nothing left to release
            logger.warning("refitd: releasing the lease on version %d: %s", held.version, e)
