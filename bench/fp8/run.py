#!/usr/bin/env python3
"""How sparse are FP8 weight deltas between RL steps?  (bench/fp8/README section of
bench/README.md explains the setup; results in bench/results/fp8-density-*.{jsonl,md}.)

Two sources of consecutive BF16 versions, both real AdamW steps:
  traj   refit's trajectory generator (daemon/model/trajectory.h: AdamW on fp32 masters of a
         transformer-shaped model, synthetic gradients), here through its numpy port
         (trajectory_np.py), first checked byte for byte against the C++ generator's versions 0
         and 1 (`make_safetensors_pair`);
  qwen2  a small Qwen2ForCausalLM (python/tests_vllm/models.py) with its BPE tokenizer trained on
         /usr/share/common-licenses/GPL-3, trained with AdamW on that text: a warm-up at a
         larger learning rate, then RL-sized steps at --qwen-lrs.
Each version's 2-d weight matrices (not embeddings, lm_head, norms or biases) are quantized from
BF16 to FP8 E4M3 in four layouts:
  block128        128x128 blocks, fp32 scale = amax / 448 (amax over the block in fp32),
                  codes = e4m3(clamp(w / scale, -448, 448)) (torch's .to(float8_e4m3fn): round to
                  nearest even); an all-zero block gets scale 1.0
  block128_ue8m0  the same blocks, scale = 2^ceil(log2(amax / 448)) (computed exactly with frexp)
  mxfp8           OCP MX v1.0: 32 elements along the last dim, shared exponent
                  floor(log2(amax)) - 8 (emax of e4m3), X = 2^that (an E8M0 scale, clamped to
                  [2^-127, 2^127]; an all-zero block gets 2^-127), codes = e4m3(clamp(w / X, +-448))
  mxfp8_ceil      extra: the same blocks with X = 2^ceil(log2(amax / 448)), the rounding of
                  vLLM's naive MXFP8 reference (_mxfp8_e4m3_quantize_torch): never saturates
and per step the script measures code / scale change fractions, their clustering by block and,
with the project's codec (`codec_bench --safetensors A B --safetensors-dtypes ...`), the bytes a
patch of the codes (F8E4M3 tensors) and of the scales (F32 tensors) costs, beside the BF16 patch
of the same tensors and step.

Prints one JSON object per line and writes them to --out; --md writes the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import trajectory_np  # noqa: E402

E4M3_MAX = 448.0
LAYOUTS = ("block128", "block128_ue8m0", "mxfp8", "mxfp8_ceil")
FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------
# Quantizers
# ------------------------------------------------------------------------------------------

def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(s)) for positive finite fp32 s, exactly (frexp: s = m 2^e, m in [0.5, 1))."""
    m, e = torch.frexp(s)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(s), e)


def pow2_floor_exp(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for positive finite fp32 a, exactly."""
    _, e = torch.frexp(a)
    return e - 1


def quantize(w: torch.Tensor, layout: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: 2-d fp32 (exact BF16 values). Returns (codes as uint8 [out, in], scales fp32,
    the fp32 values w / scale before the clamp and the cast: for the checks)."""
    out_f, in_f = w.shape
    if layout.startswith("block128"):
        bo, bi = -(-out_f // 128), -(-in_f // 128)
        a = torch.zeros(bo * 128, bi * 128, dtype=torch.float32)
        a[:out_f, :in_f] = w.abs()
        amax = a.view(bo, 128, bi, 128).amax(dim=(1, 3))
        s = amax / E4M3_MAX
        if layout == "block128_ue8m0":
            s = torch.where(amax > 0, pow2_ceil(torch.where(amax > 0, s, 1.0)), s)
        s = torch.where(amax > 0, s, torch.ones_like(s))
        sb = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_f, :in_f]
        x = w / sb
    elif layout in ("mxfp8", "mxfp8_ceil"):
        assert in_f % 32 == 0, (w.shape, "MX blocks need the last dim to be a multiple of 32")
        wb = w.view(out_f, in_f // 32, 32)
        amax = wb.abs().amax(-1)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        if layout == "mxfp8":
            e = pow2_floor_exp(safe) - 8
        else:
            _, e = torch.frexp(pow2_ceil(safe / E4M3_MAX))
            e = e - 1
        e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
        s = torch.ldexp(torch.ones_like(amax), e)
        x = (wb / s.unsqueeze(-1)).view(out_f, in_f)
    else:
        raise ValueError(layout)
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(torch.uint8)
    return codes, s.contiguous(), x


# ------------------------------------------------------------------------------------------
# Checks of the quantizers
# ------------------------------------------------------------------------------------------

def e4m3_table() -> np.ndarray:
    """Values of the positive finite e4m3fn codes 0..126 (127 is NaN), decoded by hand."""
    v = []
    for c in range(127):
        e, m = c >> 3, c & 7
        v.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(v)


E4M3_VALUES = e4m3_table()


def reference_e4m3(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> e4m3fn codes (|x| <= 448), independent of torch."""
    ax = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(E4M3_VALUES, ax, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = ax - E4M3_VALUES[lo], E4M3_VALUES[hi] - ax
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(ax >= E4M3_VALUES[126], 126, pick)
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def check_cast_exhaustive() -> dict:
    """torch's cast against the reference on every e4m3 value, every midpoint between two of
    them (ties) and the fp32 neighbours of both, both signs."""
    pts = [E4M3_VALUES, (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2]
    base = np.concatenate(pts).astype(np.float32)
    xs = np.concatenate([base, np.nextafter(base, np.float32(0)), np.nextafter(base, np.float32(1e9))])
    xs = np.concatenate([xs, -xs]).astype(np.float32)
    xs = xs[np.abs(xs) <= E4M3_MAX]
    got = torch.from_numpy(xs).to(FP8).view(torch.uint8).numpy()
    return {"values": int(xs.size), "mismatches": int((got != reference_e4m3(xs)).sum())}


def check_layout(codes: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> dict:
    """Per tensor: the cast against the reference, the dequantization error bound and the scale
    rules. Returns counts to add up. x: w / scale before the clamp."""
    clamped = int((x.abs() > E4M3_MAX).sum())
    at_max = int((x.abs() >= E4M3_MAX).sum())
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    xn = x.numpy().ravel()
    mism = int((codes.numpy().ravel() != reference_e4m3(xn)).sum())
    deq = codes.view(FP8).float()
    # |w/s - code| <= half an e4m3 step at that magnitude (2^-10 below the normal range).
    ax = x.abs().double()
    step = torch.where(ax < 2.0 ** -6, torch.full_like(ax, 2.0 ** -9),
                       torch.exp2(torch.floor(torch.log2(ax.clamp_min(2.0 ** -6)))) / 8)
    err = (x.double() - deq.double()).abs()
    bad_err = int((err > step / 2 * (1 + 1e-9)).sum())
    # Scales are powers of two where the layout says so.
    m, _ = torch.frexp(s)
    pow2 = bool((m == 0.5).all())
    return {"cast_mismatches": mism, "dequant_err_violations": bad_err,
            "clamped_to_448": clamped, "at_or_over_448": at_max, "scales_pow2": pow2,
            "elements": int(x.numel())}


def vllm_checks(weights: Dict[str, torch.Tensor], ours: Dict[str, Dict[str, Tuple]]) -> dict:
    """Informative only: how far our block128 / block128_ue8m0 / mxfp8_ceil codes are from vLLM's
    torch reference helpers on the same BF16 weights (per_block_cast_to_fp8 multiplies by
    1 / scale and clamps amax at 1e-4; _mxfp8_e4m3_quantize_torch). Not a claim about what a
    vLLM engine loads."""
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
            _mxfp8_e4m3_quantize_torch)
    except Exception as e:  # pragma: no cover
        return {"skipped": repr(e)[:200]}
    # The eager function under vLLM's torch.compile wrapper (same arithmetic, no recompiles).
    per_block_cast_to_fp8 = getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable",
                                    per_block_cast_to_fp8)
    res = {}
    for layout in ("block128", "block128_ue8m0", "mxfp8_ceil"):
        n = diff = sdiff = ns = 0
        for name, wb in weights.items():
            if layout == "mxfp8_ceil":
                c, sc = _mxfp8_e4m3_quantize_torch(wb)
                sc = torch.ldexp(torch.ones(sc.shape), sc.to(torch.int32) - 127)
            else:
                c, sc = per_block_cast_to_fp8(wb, [128, 128], use_ue8m0=layout.endswith("ue8m0"))
            oc, os_ = ours[layout][name]
            diff += int((c.view(torch.uint8) != oc).sum())
            sdiff += int((sc.float().reshape(os_.shape) != os_).sum())
            n += oc.numel()
            ns += os_.numel()
        res[layout] = {"codes": n, "codes_differing": diff, "scales": ns, "scales_differing": sdiff}
    return res


# ------------------------------------------------------------------------------------------
# Sources of versions
# ------------------------------------------------------------------------------------------

def is_quantized(name: str, shape) -> bool:
    return (len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name
            and not name.startswith("lm_head"))


def traj_versions(args, log):
    """Yields (version, {name: BF16 torch tensor}) of the numpy trajectory; checks versions 0
    and 1 against the C++ generator first (unless --no-traj-check)."""
    t0 = time.time()
    tr = trajectory_np.Trajectory(args.traj_preset, seed=1, lr=args.traj_lr)
    log({"kind": "source", "model": "traj", "preset": args.traj_preset, "lr": args.traj_lr,
         "warmup": "20 AdamW steps at 1e-4 (TrajectoryOptions defaults)",
         "parameters": int(sum(st["w"].size for st in tr.state)),
         "create_s": round(time.time() - t0, 1)})
    check_dir = os.path.join(args.workdir, "traj_check")
    if not args.no_traj_check:
        subprocess.run([args.make_pair, check_dir, args.traj_preset], check=True,
                       stdout=subprocess.DEVNULL)

    def as_torch(state):
        return {n: torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
                for n, (shape, b) in state.items()}

    for v in range(args.steps + 1):
        if v > 0:
            tr.step()
        state = tr.bf16()
        if v <= 1 and not args.no_traj_check:
            from safetensors.torch import load_file
            ref = load_file(os.path.join(check_dir, f"v{v}.safetensors"))
            bad = [n for n in ref if not np.array_equal(
                ref[n].view(torch.int16).numpy().ravel(), state[n][1].view(np.int16))]
            log({"kind": "check", "what": "trajectory_np vs C++ make_safetensors_pair",
                 "version": v, "tensors": len(ref), "tensors_differing": len(bad),
                 "identical": not bad and len(ref) == len(state)})
            if bad:
                raise SystemExit(f"trajectory_np differs from the C++ generator: {bad[:3]}")
        yield v, as_torch(state)
    shutil.rmtree(check_dir, ignore_errors=True)


def qwen_versions(args, lr, log):
    sys.path.insert(0, os.path.join(ROOT, "python", "tests_vllm"))
    import models  # python/tests_vllm/models.py
    tokdir = os.path.join(args.workdir, "tokenizer")
    tok = models.train_tokenizer(tokdir)
    sizes = dict(hidden_size=args.qwen_hidden, intermediate_size=args.qwen_ffn,
                 num_hidden_layers=args.qwen_layers, num_attention_heads=args.qwen_heads,
                 num_key_value_heads=args.qwen_kv_heads)
    model = models.create("qwen2", seed=0, **sizes)
    ids = tok(models.corpus_text(), return_tensors="pt").input_ids[0]

    def loss():  # a fixed batch, for the record
        with torch.no_grad():
            x = torch.stack([ids[s:s + 64] for s in (0, 1000, 2000, 3000)])
            return float(model(input_ids=x, labels=x).loss)

    log({"kind": "source", "model": "qwen2", "lr": lr, "sizes": sizes,
         "parameters": int(sum(p.numel() for p in model.parameters())),
         "tokens": int(ids.numel()), "init_loss": round(loss(), 4),
         "warmup": f"{args.qwen_warmup} AdamW steps at {args.qwen_warmup_lr}",
         "batch": "4 x 64 tokens (models.training_steps)"})
    # training_steps yields after each step at `lr` (none during the warm-up): version 0 is the
    # state after the warm-up and a first step at `lr`, so that every measured step follows a
    # step at the same learning rate.
    steps = models.training_steps(model, tok, args.steps + 1, lr=lr,
                                  warmup_lr=args.qwen_warmup_lr, warmup=args.qwen_warmup)
    t0 = time.time()
    for v in range(args.steps + 1):
        next(steps)
        if v in (0, args.steps):
            log({"kind": "source_loss", "model": "qwen2", "lr": lr, "version": v,
                 "loss": round(loss(), 4), "elapsed_s": round(time.time() - t0, 1)})
        yield v, models.bf16_state(model)


# ------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------

def block_counts(changed: torch.Tensor, layout: str) -> torch.Tensor:
    """changed (bool [out, in]) -> number of changed codes per scale block, flat."""
    out_f, in_f = changed.shape
    c = changed.to(torch.int32)
    if layout.startswith("block128"):
        bo, bi = -(-out_f // 128), -(-in_f // 128)
        p = torch.zeros(bo * 128, bi * 128, dtype=torch.int32)
        p[:out_f, :in_f] = c
        return p.view(bo, 128, bi, 128).sum(dim=(1, 3)).ravel()
    return c.view(out_f, in_f // 32, 32).sum(-1).ravel()


def block_sizes(shape, layout: str) -> torch.Tensor:
    out_f, in_f = shape
    if layout.startswith("block128"):
        ones = torch.ones(shape, dtype=torch.bool)
        return block_counts(ones, layout)
    return torch.full((out_f * in_f // 32,), 32, dtype=torch.int32)


def step_stats(prev: Dict[str, Tuple], cur: Dict[str, Tuple], layout: str) -> dict:
    """Change statistics of one layout between two versions (dicts name -> (codes, scales))."""
    n = ch = zs = 0
    ns = sch = 0
    nb = b_any = 0
    codes_in_sc = 0          # codes living in blocks whose scale changed
    ch_in_sc = 0             # changed codes in those blocks
    sc_blocks_any = 0        # scale-changed blocks with at least one changed code
    for name, (c1, s1) in cur.items():
        c0, s0 = prev[name]
        changed = c0 != c1
        n += c1.numel()
        ch += int(changed.sum())
        zs += int((changed & ((c0 & 0x7F) == 0) & ((c1 & 0x7F) == 0)).sum())
        sc = (s0.view(torch.int32) != s1.view(torch.int32)).ravel()
        ns += sc.numel()
        sch += int(sc.sum())
        per_block = block_counts(changed, layout)
        sizes = block_sizes(c1.shape, layout)
        nb += per_block.numel()
        b_any += int((per_block > 0).sum())
        codes_in_sc += int(sizes[sc].sum())
        ch_in_sc += int(per_block[sc].sum())
        sc_blocks_any += int((per_block[sc] > 0).sum())
    r = {
        "codes": n, "codes_changed": ch, "code_change_rate": ch / n,
        "zero_sign_flips": zs,
        "scales": ns, "scales_changed": sch, "scale_change_rate": sch / ns,
        "blocks": nb, "blocks_with_code_change": b_any, "block_change_rate": b_any / nb,
        "codes_per_changed_block": ch / b_any if b_any else 0.0,
        "block_elems": 16384 if layout.startswith("block128") else 32,
        "share_changed_codes_in_scale_changed_blocks": ch_in_sc / ch if ch else 0.0,
        "share_codes_in_scale_changed_blocks": codes_in_sc / n,
        "code_change_rate_in_scale_changed_blocks": ch_in_sc / codes_in_sc if codes_in_sc else None,
        "code_change_rate_elsewhere": (ch - ch_in_sc) / (n - codes_in_sc) if n > codes_in_sc else None,
        "scale_changed_blocks_with_code_change": sc_blocks_any / sch if sch else None,
    }
    r["codes_per_changed_block_frac"] = r["codes_per_changed_block"] / r["block_elems"]
    return r


def save(path: str, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def codec(args, a: str, b: str, dtypes: str) -> dict:
    cmd = [args.codec_bench, "--safetensors", a, b, "--dataset", "safetensors", "--json",
           "--reps", str(args.reps), "--threads", str(args.threads)]
    if dtypes != "bf16":
        cmd += ["--safetensors-dtypes", dtypes]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or "FAIL" in p.stdout:
        raise SystemExit(f"codec_bench failed ({p.returncode}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    j = json.loads(p.stdout.strip().splitlines()[-1])
    keep = ("elements", "changed", "change_rate", "bits_per_change", "bound_bits_per_change",
            "patch_bytes", "dense_bytes", "ctx_bits_per_change", "ctx_bytes", "ref_bits_per_change",
            "share_d1", "share_d2", "share_d3", "share_dgt3", "tensors", "blocks_sparse",
            "blocks_dense", "blocks_unchanged", "dtypes")
    return {k: j[k] for k in keep if k in j}


def run_model(args, label: str, lr: float, versions, log) -> List[dict]:
    d = os.path.join(args.workdir, label)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    prev_q: Dict[str, Dict[str, Tuple]] = {}
    prev_bf16 = prev_all = None
    rows = []
    for v, state in versions:
        t0 = time.time()
        qw = {n: t for n, t in state.items() if is_quantized(n, t.shape)}
        cur_q = {}
        for layout in LAYOUTS:
            cur_q[layout] = {}
            chk = {"cast_mismatches": 0, "dequant_err_violations": 0, "clamped_to_448": 0,
                   "at_or_over_448": 0, "scales_pow2": True, "elements": 0}
            for n, wb in qw.items():
                codes, s, x = quantize(wb.float(), layout)
                cur_q[layout][n] = (codes, s)
                if v == 0:
                    c = check_layout(codes, s, x)
                    for k in chk:
                        chk[k] = (chk[k] and c[k]) if k == "scales_pow2" else chk[k] + c[k]
            if v == 0:
                log({"kind": "check", "what": "quantizer", "model": label, "lr": lr,
                     "layout": layout, **chk})
            save(os.path.join(d, f"{layout}.v{v}.codes.safetensors"),
                 {n: c.view(FP8) for n, (c, s) in cur_q[layout].items()})
            save(os.path.join(d, f"{layout}.v{v}.scales.safetensors"),
                 {f"{n}_scale_inv": s for n, (c, s) in cur_q[layout].items()})
        if v == 0 and args.vllm_check:
            log({"kind": "check", "what": "vs vLLM torch helpers (informative)", "model": label,
                 "lr": lr, **vllm_checks(qw, cur_q)})
        save(os.path.join(d, f"bf16.v{v}.safetensors"), qw)
        if v > 0:
            # BF16 of the quantized tensors, same step.
            bch = sum(int((prev_bf16[n].view(torch.int16) != t.view(torch.int16)).sum())
                      for n, t in qw.items())
            bn = sum(t.numel() for t in qw.values())
            allch = sum(int((prev_all[n].view(torch.int16) != t.view(torch.int16)).sum())
                        for n, t in state.items())
            alln = sum(t.numel() for t in state.values())
            bc = codec(args, os.path.join(d, f"bf16.v{v-1}.safetensors"),
                       os.path.join(d, f"bf16.v{v}.safetensors"), "bf16")
            row = {"kind": "bf16", "model": label, "lr": lr, "step": v, "elements": bn,
                   "changed": bch, "change_rate": bch / bn,
                   "model_change_rate_all_tensors": allch / alln, "model_elements": alln,
                   "codec": bc}
            log(row)
            rows.append(row)
            for layout in LAYOUTS:
                st = step_stats(prev_q[layout], cur_q[layout], layout)
                cc = codec(args, os.path.join(d, f"{layout}.v{v-1}.codes.safetensors"),
                           os.path.join(d, f"{layout}.v{v}.codes.safetensors"), "f8e4m3")
                sc = codec(args, os.path.join(d, f"{layout}.v{v-1}.scales.safetensors"),
                           os.path.join(d, f"{layout}.v{v}.scales.safetensors"), "f32")
                if cc["changed"] != st["codes_changed"] or sc["changed"] != st["scales_changed"]:
                    raise SystemExit(f"codec_bench and run.py disagree on changes: {cc} {sc} {st}")
                patch = cc["patch_bytes"] + sc["patch_bytes"]
                dense = cc["dense_bytes"] + sc["dense_bytes"]
                row = {"kind": "fp8", "model": label, "lr": lr, "step": v, "layout": layout,
                       **st, "bf16_change_rate": bch / bn,
                       "code_vs_bf16_change": st["code_change_rate"] / (bch / bn) if bch else None,
                       "codes_codec": cc, "scales_codec": sc,
                       "patch_bytes": patch, "dense_bytes": dense, "patch_vs_dense": patch / dense,
                       "bits_per_changed_code_incl_scales":
                           8 * patch / st["codes_changed"] if st["codes_changed"] else None,
                       "patch_vs_bf16_patch": patch / bc["patch_bytes"] if bc["patch_bytes"] else None,
                       "seconds": round(time.time() - t0, 1)}
                log(row)
                rows.append(row)
            for suffix in ("codes", "scales"):
                for layout in LAYOUTS:
                    os.remove(os.path.join(d, f"{layout}.v{v-1}.{suffix}.safetensors"))
            os.remove(os.path.join(d, f"bf16.v{v-1}.safetensors"))
        prev_q, prev_bf16 = cur_q, qw
        prev_all = state
    return rows


# ------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------

def pct(x, nd=3):
    return "-" if x is None else f"{100 * x:.{nd}f}%"


def summarize(rows: List[dict]) -> List[dict]:
    """Per (model, lr, layout or bf16): totals over the measured steps."""
    out: Dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["lr"], r.get("layout", "bf16"))
        a = out.setdefault(key, {"model": r["model"], "lr": r["lr"], "layout": key[2], "steps": 0,
                                 "n": 0, "ch": 0, "bn": 0, "bch": 0, "ns": 0, "sch": 0, "nb": 0,
                                 "b_any": 0, "ch_in_sc": 0, "patch": 0, "dense": 0, "cpatch": 0,
                                 "bf16_patch": 0})
        a["steps"] += 1
        if r["kind"] == "bf16":
            a["bn"] += r["elements"]
            a["bch"] += r["changed"]
            a["patch"] += r["codec"]["patch_bytes"]
            a["cpatch"] += r["codec"]["patch_bytes"]
            a["dense"] += r["codec"]["dense_bytes"]
            a["bf16_patch"] += r["codec"]["patch_bytes"]
            continue
        a["n"] += r["codes"]
        a["ch"] += r["codes_changed"]
        a["bn"] += r["codes"]
        a["bch"] += round(r["bf16_change_rate"] * r["codes"])
        a["ns"] += r["scales"]
        a["sch"] += r["scales_changed"]
        a["nb"] += r["blocks"]
        a["b_any"] += r["blocks_with_code_change"]
        a["ch_in_sc"] += round(r["share_changed_codes_in_scale_changed_blocks"] * r["codes_changed"])
        a["patch"] += r["patch_bytes"]
        a["cpatch"] += r["codes_codec"]["patch_bytes"]
        a["dense"] += r["dense_bytes"]
        a["bf16_patch"] += r["patch_bytes"] / r["patch_vs_bf16_patch"]
    res = []
    for a in out.values():
        bf = a["layout"] == "bf16"
        res.append({
            "model": a["model"], "lr": a["lr"], "layout": a["layout"], "steps": a["steps"],
            "code_change_rate": None if bf else a["ch"] / a["n"],
            "bf16_change_rate": a["bch"] / a["bn"],
            "scale_change_rate": None if bf else a["sch"] / a["ns"],
            "block_change_rate": None if bf else a["b_any"] / a["nb"],
            "codes_per_changed_block": None if bf else (a["ch"] / a["b_any"] if a["b_any"] else 0),
            "share_in_scale_changed_blocks": None if bf else (a["ch_in_sc"] / a["ch"] if a["ch"] else 0),
            "bits_per_change": 8 * a["cpatch"] / (a["bch"] if bf else a["ch"]),
            "bits_per_change_incl_scales": None if bf else 8 * a["patch"] / a["ch"],
            "patch_vs_dense": a["patch"] / a["dense"],
            "patch_vs_bf16_patch": a["patch"] / a["bf16_patch"],
        })
    return res


def num(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def summary_table(summary: List[dict]) -> List[str]:
    L = ["| model | lr | layout | code chg | bf16 chg | scale chg | blocks w/ chg | codes / chg block | "
         "chg codes in sc-chg blocks | bits / chg code (+ scales) | patch / dense | vs bf16 patch |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        bits = (f"{r['bits_per_change']:.2f}" if r["layout"] == "bf16" else
                f"{r['bits_per_change']:.2f} ({r['bits_per_change_incl_scales']:.2f})")
        L.append(f"| {r['model']} | {r['lr']:g} | {r['layout']} | {pct(r['code_change_rate'])} | "
                 f"{pct(r['bf16_change_rate'])} | {pct(r['scale_change_rate'])} | "
                 f"{pct(r['block_change_rate'], 2)} | {num(r['codes_per_changed_block'])} | "
                 f"{pct(r['share_in_scale_changed_blocks'], 1)} | {bits} | {pct(r['patch_vs_dense'])} | "
                 f"{r['patch_vs_bf16_patch']:.3f} |")
    return L


def write_md(path: str, rows: List[dict], records: List[dict], cmd: str) -> None:
    srcs = [r for r in records if r["kind"] in ("source", "source_loss")]
    checks = [r for r in records if r["kind"] == "check"]
    done = [r for r in records if r["kind"] == "done"]
    L = ["# FP8 delta density between RL steps (2026-12-06)", "",
         f"Command: `{cmd}` ({done[0]['seconds'] if done else '?'} s on the 2-core VM)", "",
         "Generated by bench/fp8/run.py (setup, definitions and discussion: bench/README.md, "
         "section \"FP8 deltas\"). Every figure is over the 2-d weight matrices only (the tensors "
         "an engine quantizes; embeddings, lm_head, norms and biases stay BF16). Code chg: share "
         "of FP8 codes whose byte changed; bf16 chg: share of the BF16 elements of the same "
         "tensors that changed in the same step. Blocks: the scale blocks (128x128 tiles, or 1x32 "
         "for MX). \"chg codes in sc-chg blocks\": share of the changed codes that lie in blocks "
         "whose scale changed; \"rate in / out\": code change rate inside those blocks / in the "
         "others. Wire: the project's codec (`codec_bench --safetensors`, patch format 1; every "
         "patch verified by codec_bench): bits per changed code of the codes patch (its codec "
         "bound: H(p)/p + value entropy), the scales patch in bytes, and (codes patch + scales "
         "patch) / (codes + fp32 scales dense); \"vs bf16\": FP8 patch bytes / BF16 patch bytes "
         "of the same tensors and step.", "",
         "## Summary (all measured steps together)", ""]
    L += summary_table(summarize(rows))
    L += ["", "## Sources", ""]
    for s in srcs:
        L.append("- " + json.dumps({k: v for k, v in s.items() if k != "kind"}))
    L += ["", "## Checks", ""]
    for c in checks:
        L.append("- " + json.dumps({k: v for k, v in c.items() if k != "kind"}))
    groups = []
    for r in rows:
        key = (r["model"], r["lr"])
        if key not in groups:
            groups.append(key)
    for model, lr in groups:
        L += ["", f"## Per step: {model}, lr {lr:g}", "",
              "| layout | step | code chg | bf16 chg | code / bf16 | scale chg | blocks w/ chg | "
              "codes / chg block | chg codes in sc-chg blocks | rate in / out | bits / chg code "
              "(bound) | scales patch B | patch / dense | vs bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if (r["model"], r["lr"]) != (model, lr):
                continue
            if r["kind"] == "bf16":
                c = r["codec"]
                L.append(f"| **bf16** | {r['step']} | - | {pct(r['change_rate'])} | - | - | - | - | - | - | "
                         f"{c['bits_per_change']:.2f} ({c['bound_bits_per_change']:.2f}) | - | "
                         f"{pct(c['patch_bytes'] / c['dense_bytes'])} | 1 |")
                continue
            cc, sc = r["codes_codec"], r["scales_codec"]
            rin, rout = r["code_change_rate_in_scale_changed_blocks"], r["code_change_rate_elsewhere"]
            L.append(
                f"| {r['layout']} | {r['step']} | {pct(r['code_change_rate'])} | {pct(r['bf16_change_rate'])} | "
                f"{r['code_vs_bf16_change']:.3f} | {pct(r['scale_change_rate'])} | {pct(r['block_change_rate'], 2)} | "
                f"{r['codes_per_changed_block']:.2f} | {pct(r['share_changed_codes_in_scale_changed_blocks'], 1)} | "
                f"{pct(rin, 2)} / {pct(rout, 3)} | {cc['bits_per_change']:.2f} ({cc['bound_bits_per_change']:.2f}) | "
                f"{sc['patch_bytes']} | {pct(r['patch_vs_dense'])} | {r['patch_vs_bf16_patch']:.3f} |")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codec-bench", default=os.path.join(ROOT, "build-fp8/bench/codec_bench"))
    ap.add_argument("--make-pair", default=os.path.join(ROOT, "build-fp8/bench/make_safetensors_pair"))
    ap.add_argument("--no-traj-check", action="store_true",
                    help="skip the byte-for-byte check of trajectory_np against the C++ generator")
    ap.add_argument("--vllm-check", action="store_true",
                    help="also compare with vLLM's torch quantization helpers (informative)")
    ap.add_argument("--workdir", default="/tmp/refit-fp8")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/fp8-density-2026-12-06.jsonl"))
    ap.add_argument("--md", default=os.path.join(ROOT, "bench/results/fp8-density-2026-12-06.md"),
                    help="write the markdown tables here ('' for none)")
    ap.add_argument("--models", default="traj,qwen2")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per model (versions 0..steps)")
    ap.add_argument("--traj-preset", default="small")
    ap.add_argument("--traj-lr", type=float, default=1e-6)
    ap.add_argument("--qwen-lrs", default="1e-6,1e-5")
    ap.add_argument("--qwen-warmup", type=int, default=50)
    ap.add_argument("--qwen-warmup-lr", type=float, default=3e-4)
    ap.add_argument("--qwen-hidden", type=int, default=768)
    ap.add_argument("--qwen-ffn", type=int, default=2048)
    ap.add_argument("--qwen-layers", type=int, default=4)
    ap.add_argument("--qwen-heads", type=int, default=12)
    ap.add_argument("--qwen-kv-heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="codec_bench --reps (only timings use it)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    records: List[dict] = []
    out = open(args.out, "w")

    def log(r):
        records.append(r)
        line = json.dumps(r, sort_keys=False)
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    t0 = time.time()
    log({"kind": "run", "argv": sys.argv[1:], "torch": torch.__version__, "threads": args.threads,
         "layouts": list(LAYOUTS)})
    log({"kind": "check", "what": "torch float8_e4m3fn cast vs reference RNE (all codes, all "
         "midpoints and their fp32 neighbours)", **check_cast_exhaustive()})
    rows = []
    models_ = args.models.split(",")
    if "traj" in models_:
        rows += run_model(args, "traj", args.traj_lr, traj_versions(args, log), log)
    if "qwen2" in models_:
        for lr in [float(x) for x in args.qwen_lrs.split(",")]:
            rows += run_model(args, "qwen2", lr, qwen_versions(args, lr, log), log)
    for r in summarize(rows):
        log({"kind": "summary", **r})
    log({"kind": "done", "seconds": round(time.time() - t0, 1)})
    out.close()
    if args.md:
        write_md(args.md, rows, records, "bench/fp8/run.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
