"""FP8 delivery: versions reach a vLLM engine that serves FP8 block-quantized weights as the engine's
own FP8 codes and scales, written in place for the 128x128 blocks a version touches.

The engine quantizes online (vLLM `quantization="fp8_per_block"`: each linear layer's BF16 weight,
fused parts included, becomes float8_e4m3fn codes [N, K] and one fp32 `weight_scale_inv` per
128x128 block, [ceil(N/128), ceil(K/128)]). The subscriber keeps the verified BF16 version; this
module quantizes blocks of it exactly as the engine does, by calling vLLM's own per-block
quantizer (`vllm.utils.deep_gemm.per_block_cast_to_fp8`, the function the online method runs) on
the touched blocks laid side by side (blocks are quantized independently and a partial edge block
is zero-padded, as vLLM pads the whole tensor), so codes and scales are bit-identical to a fresh
FP8 load of the same BF16 weights.

- `Fp8Map.build(model, specs)`: which runtime modules hold FP8 block weights, which checkpoint
  tensors compose each (fused q/k/v, gate/up through the model's packed_modules_mapping and the
  layer's logical widths), the runtime layout of the codes (the engine's FP8 kernel may permute
  them: vLLM's CPU kernel packs them for AMX; found by running the kernel's own post-load
  processing on a scratch copy holding a byte pattern, and matched against the layouts known
  here), and where the tensors the engine keeps in BF16 (norms, embeddings, lm_head, biases,
  whatever the engine's quantization config leaves unquantized) live. Anything else is a
  ValueError naming the tensor.
- `Fp8Writer.apply(...)`: for every touched block, codes and scale are computed from one BF16
  snapshot and written together (the undo record keeps the old codes and scale of each block); the
  runtime bytes of every written block and scale are read back and compared with the quantizer's
  output, so a block whose codes and scale disagree (a torn write) is found and the whole update
  undone. Work: O(touched blocks); extra memory: the undo record (one byte per touched code, four
  per touched scale) plus one chunk of CHUNK_BLOCKS blocks staged at a time.
- `Fp8Writer.digests(weights)`: digest v2 of every FP8 tensor's codes (row-major [N, K] bytes)
  and scales, computed from the BF16 version by the quantizer and from the runtime tensors read
  through the layout: the full check, O(model).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch

from refit.digest import digest_v2

BLOCK = 128
FP8 = torch.float8_e4m3fn


def quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-block quantizer, as the online fp8_per_block method calls it: (codes, scales)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8
    return per_block_cast_to_fp8(x, block_size=[BLOCK, BLOCK], use_ue8m0=False)


def quantize_blocks(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """blocks: [nb, 128, 128] BF16 (edge blocks zero-padded). Returns (codes [nb, 128, 128] as
    uint8, scales [nb] fp32), one call of vLLM's quantizer on the blocks side by side."""
    nb = blocks.shape[0]
    if nb == 0:
        return torch.empty(0, BLOCK, BLOCK, dtype=torch.uint8), torch.empty(0)
    side = blocks.transpose(0, 1).reshape(BLOCK, nb * BLOCK)
    codes, scales = quantize(side)
    if codes.dtype != FP8:
        raise ValueError(f"refitd fp8: vLLM's quantizer gives {codes.dtype}; only {FP8} codes "
                         f"are supported")
    codes = codes.view(torch.uint8).reshape(BLOCK, nb, BLOCK).transpose(0, 1).contiguous()
    return codes, scales.reshape(nb).contiguous()


# ---- runtime layouts of the codes ---------------------------------------------------------------

class Layout:
    """Where logical code (n, k) of an [N, K] weight lives in the runtime tensor's flat bytes."""
    name = "?"

    def __init__(self, n: int, k: int):
        self.n, self.k = n, k

    def supports(self) -> bool:
        return True

    def index(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Flat byte positions of the grid rows x cols (int64 [len(rows), len(cols)])."""
        raise NotImplementedError


class RowMajor(Layout):
    """The codes as [N, K], row-major (kernels that keep the checkpoint layout)."""
    name = "row-major"

    def index(self, rows, cols):
        return rows.unsqueeze(1) * self.k + cols.unsqueeze(0)


class Vnni2x32(Layout):
    """vLLM's CPU FP8 kernel (AMX): `convert_weight_packed` groups 32 rows into a panel and, in
    a panel, interleaves pairs of columns: (n, k) -> panel n//32, then k//2, then n%32, then k%2."""
    name = "vnni-2x32"

    def supports(self):
        return self.n % 32 == 0 and self.k % 2 == 0

    def index(self, rows, cols):
        r = rows.unsqueeze(1)
        c = cols.unsqueeze(0)
        return (r // 32) * (32 * self.k) + (c // 2) * 64 + (r % 32) * 2 + (c % 2)


LAYOUTS = (RowMajor, Vnni2x32)


def _pattern(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 0x7E, shape, generator=g, dtype=torch.uint8)  # no NaN codes


def probe_layout(module: torch.nn.Module, n: int, k: int) -> Tuple[Optional[Layout], str]:
    """Runs the module's FP8 kernel's own post-load processing on a scratch copy of the module
    holding byte patterns as codes and scales, and returns the known layout that explains the
    result (None and why not otherwise)."""
    kernel = getattr(module.quant_method, "fp8_linear", None)
    if kernel is None:
        return None, f"{type(module.quant_method).__name__} has no fp8_linear kernel"
    sshape = tuple(module.weight_scale_inv.shape)
    first: Optional[Layout] = None  # the layout the first pattern showed
    for seed in (1, 2):
        codes = _pattern((n, k), seed)
        scales = (_pattern(sshape, seed + 10).float() + 1) / 64
        scratch = copy.copy(module)
        scratch._parameters = dict(module._parameters)
        scratch.__dict__ = dict(scratch.__dict__)
        scratch._parameters["weight"] = torch.nn.Parameter(codes.view(FP8).clone(),
                                                           requires_grad=False)
        scratch._parameters["weight_scale_inv"] = torch.nn.Parameter(scales.clone(),
                                                                     requires_grad=False)
        try:
            kernel.process_weights_after_loading(scratch)
        except Exception as e:  # the kernel refuses a scratch module: no in-place writes
            return None, f"probing {type(kernel).__name__}: {type(e).__name__}: {e}"
        w, s = scratch.weight.data, scratch.weight_scale_inv.data
        if w.dtype != FP8 or w.numel() != n * k or not w.is_contiguous():
            return None, f"{type(kernel).__name__} keeps codes as {w.dtype} " \
                         f"{tuple(w.shape)}, not {n * k} contiguous {FP8}"
        if s.dtype != torch.float32 or tuple(s.shape) != sshape or \
                not torch.equal(s.view(torch.int32), scales.view(torch.int32)):
            return None, f"{type(kernel).__name__} transforms the scales " \
                         f"({s.dtype} {tuple(s.shape)})"
        flat = w.reshape(-1).view(torch.uint8)
        found = None
        for cls in LAYOUTS:
            lay = cls(n, k)
            if lay.supports() and torch.equal(
                    flat[lay.index(torch.arange(n), torch.arange(k)).reshape(-1)],
                    codes.reshape(-1)):
                found = lay
                break
        if found is None:
            return None, f"{type(kernel).__name__} lays the codes out in a way refitd does " \
                         f"not know"
        if first is not None and found.name != first.name:
            return None, f"{type(kernel).__name__}: inconsistent layouts"
        first = found
    return first, f"{type(kernel).__name__}: {first.name}"


# ---- the map -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Part:
    name: str          # checkpoint tensor
    row: int           # its first row in the module's [N, K] weight
    rows: int


@dataclasses.dataclass
class Fp8Module:
    prefix: str
    module: torch.nn.Module
    n: int
    k: int
    parts: List[Part]
    layout: Layout

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def scale(self) -> torch.Tensor:
        return self.module.weight_scale_inv

    def grid(self) -> Tuple[int, int]:
        return -(-self.n // BLOCK), -(-self.k // BLOCK)


@dataclasses.dataclass
class Bf16Target:
    name: str
    param: torch.Tensor
    offset: int        # flat element offset of the checkpoint tensor in the parameter
    module: Optional[torch.nn.Module]  # whose post-load processing derives a copy from it


@dataclasses.dataclass
class Fp8Map:
    modules: Dict[str, Fp8Module]              # runtime prefix -> module
    of_tensor: Dict[str, Tuple[str, Part]]     # checkpoint name -> (module prefix, part)
    bf16: Dict[str, Bf16Target]                # checkpoint tensors kept in BF16
    specs: Dict[str, tuple]

    @staticmethod
    def fp8_modules(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
        """Runtime modules holding FP8 block-quantized weights (codes + weight_scale_inv)."""
        out = {}
        for prefix, m in model.named_modules():
            w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
            if w is not None and w.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                             torch.float8_e5m2) and \
                    "weight_scale_inv" in m._parameters:
                out[prefix] = m
        return out

    @classmethod
    def build(cls, model: torch.nn.Module, specs: Dict[str, tuple]) -> "Fp8Map":
        """specs: checkpoint name -> (dtype, shape). ValueError naming every tensor or module
        that cannot be delivered as FP8 blocks."""
        fp8 = cls.fp8_modules(model)
        problems: List[str] = []
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        modules: Dict[str, Fp8Module] = {}
        for prefix, m in sorted(fp8.items()):
            w = m.weight
            why = _module_problem(prefix, m)
            if why:
                problems.append(why)
                continue
            n, k = int(m.output_size_per_partition), int(m.input_size_per_partition)
            layout, how = probe_layout(m, n, k)
            if layout is None:
                problems.append(f"{prefix}.weight: {how}")
                continue
            if w.numel() != n * k:
                problems.append(f"{prefix}.weight: {w.numel()} codes, expected {n} x {k}")
                continue
            modules[prefix] = Fp8Module(prefix, m, n, k, [], layout)
        of_tensor: Dict[str, Tuple[str, Part]] = {}
        bf16: Dict[str, Bf16Target] = {}
        runtime = dict(model.named_parameters(remove_duplicate=False))
        runtime.update(dict(model.named_buffers(remove_duplicate=False)))
        owner = {}
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                owner.setdefault(f"{mname}.{pname}" if mname else pname, mod)
        for name, (dtype, shape) in sorted(specs.items()):
            where = _placement(name, packed, modules, fp8, runtime)
            if where is None:
                problems.append(f"{name}: no runtime parameter of the engine holds it")
                continue
            kind, target, index, param = where
            if kind == "fp8":
                mod = modules.get(target)
                if mod is None:
                    continue  # its module's problem is reported already
                if dtype != torch.bfloat16 or len(shape) != 2 or shape[1] != mod.k:
                    problems.append(f"{name}: {dtype} {tuple(shape)} cannot be a part of "
                                    f"{target}.weight (bfloat16 [*, {mod.k}] expected)")
                    continue
                fused = target != name.rpartition(".")[0]
                widths = list(getattr(mod.module, "logical_widths", None) or [mod.n]) \
                    if fused else [mod.n]
                if index >= len(widths) or widths[index] != shape[0]:
                    problems.append(f"{name}: {shape[0]} rows, but part {index} of "
                                    f"{target}.weight has {widths[index:index + 1]}")
                    continue
                part = Part(name, sum(widths[:index]), shape[0])
                mod.parts.append(part)
                of_tensor[name] = (target, part)
            else:
                p = runtime[target]
                n = math.prod(shape)
                mod = owner.get(target)
                fused = target.rpartition(".")[0] != name.rpartition(".")[0]
                offset = _part_widths(mod, index) * (n // shape[0]) if fused else 0
                if p.dtype != dtype or not p.is_contiguous() or offset + n > p.numel() or \
                        (not fused and tuple(p.shape) != tuple(shape)):
                    problems.append(f"{name}: the runtime keeps it in {target} as {p.dtype} "
                                    f"{tuple(p.shape)}, not as {dtype} {tuple(shape)}")
                    continue
                bf16[name] = Bf16Target(name, p, offset,
                                        mod if getattr(mod, "quant_method", None) is not None
                                        else None)
        for prefix, mod in modules.items():
            covered = sum(p.rows for p in mod.parts)
            if covered != mod.n:
                problems.append(f"{prefix}.weight: the checkpoint gives {covered} of its "
                                f"{mod.n} rows")
        if problems:
            raise ValueError("refitd fp8: " + "; ".join(problems))
        return cls(modules, of_tensor, bf16, dict(specs))


def _part_widths(mod, index: int) -> int:
    """Rows before part `index` of a fused module's parameter."""
    w = list(getattr(mod, "logical_widths", None) or []) if mod is not None else []
    return sum(w[:index])


def _module_problem(prefix: str, m: torch.nn.Module) -> str:
    w = m.weight
    if w.dtype != FP8:
        return f"{prefix}.weight: {w.dtype} codes; only {FP8} is supported"
    if list(getattr(m, "weight_block_size", None) or []) != [BLOCK, BLOCK]:
        return f"{prefix}.weight: block size {getattr(m, 'weight_block_size', None)}; only " \
               f"[{BLOCK}, {BLOCK}] is supported"
    if m.weight_scale_inv.dtype != torch.float32:
        return f"{prefix}.weight_scale_inv: {m.weight_scale_inv.dtype} scales; only float32 " \
               f"is supported"
    method = type(getattr(m, "quant_method", None)).__name__
    if method != "Fp8PerBlockOnlineLinearMethod":
        return f"{prefix}: quantized by {method}; refitd quantizes as vLLM's online " \
               f"fp8_per_block method (Fp8PerBlockOnlineLinearMethod) does"
    n, k = int(m.output_size_per_partition), int(m.input_size_per_partition)
    if getattr(m, "tp_size", 1) != 1 or n != int(getattr(m, "output_size", n)) or \
            k != int(getattr(m, "input_size", k)):
        return f"{prefix}.weight: a tensor-parallel shard ({n} x {k} of " \
               f"{getattr(m, 'output_size', '?')} x {getattr(m, 'input_size', '?')}); FP8 " \
               f"delivery supports tensor parallel size 1"
    want = (-(-n // BLOCK), -(-k // BLOCK))
    if tuple(m.weight_scale_inv.shape) != want:
        return f"{prefix}.weight_scale_inv: shape {tuple(m.weight_scale_inv.shape)}, " \
               f"expected {want}"
    return ""


def _placement(name, packed, modules, fp8, runtime):
    """("fp8", module prefix, part index, None) or ("bf16", runtime name, part index, None)."""
    prefix, _, leaf = name.rpartition(".")
    mod_prefix, _, last = prefix.rpartition(".")
    candidates = [(prefix, 0)]
    for fused, parts in packed.items():
        if last in parts:
            candidates.append(((mod_prefix + "." if mod_prefix else "") + fused,
                               list(parts).index(last)))
    for target, index in candidates:
        if leaf == "weight" and target in fp8:
            return "fp8", target, index, None
        if f"{target}.{leaf}" in runtime:
            return "bf16", f"{target}.{leaf}", index, None
    return None


# ---- writing -----------------------------------------------------------------------------------

# (module prefix, blocks [nb, 2], their old codes in block order, old scales): the positions are
# recomputed from the blocks, so the record costs one byte per code plus 4 per scale.
Undo = List[Tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]

CHUNK_BLOCKS = 64  # blocks quantized and written at a time: bounds the staged bytes


@dataclasses.dataclass
class Stats:
    blocks: int = 0           # blocks written
    blocks_total: int = 0     # blocks of the FP8 tensors
    staged_bytes: int = 0     # one chunk's transient tensors, estimated: per code 2 x 2 (BF16
    #                           blocks side by side), 4 (vLLM's fp32 product), 2 x 1 (codes),
    #                           1 (the values written), 8 (their positions)
    undo_bytes: int = 0
    bf16_elements: int = 0


class Fp8Writer:
    def __init__(self, fmap: Fp8Map):
        self.map = fmap

    # -- blocks of a version --

    def quantize_module(self, mod: Fp8Module, blocks: torch.Tensor,
                        weights: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """blocks: int64 [nb, 2] (bi, bj), sorted. (codes [nb, 128, 128] uint8, scales [nb])."""
        buf = torch.zeros(blocks.shape[0], BLOCK, BLOCK, dtype=torch.bfloat16)
        for i, (bi, bj) in enumerate(blocks.tolist()):
            r0, r1 = bi * BLOCK, min(mod.n, (bi + 1) * BLOCK)
            c0, c1 = bj * BLOCK, min(mod.k, (bj + 1) * BLOCK)
            for p in mod.parts:
                a, b = max(r0, p.row), min(r1, p.row + p.rows)
                if a < b:
                    buf[i, a - r0:b - r0, :c1 - c0] = weights[p.name][a - p.row:b - p.row, c0:c1]
        return quantize_blocks(buf)

    def _positions(self, mod: Fp8Module, blocks: torch.Tensor) -> torch.Tensor:
        """Flat runtime byte positions of the blocks' codes, block after block, row-major in a
        block (an edge block has fewer)."""
        out = []
        for bi, bj in blocks.tolist():
            rows = torch.arange(bi * BLOCK, min(mod.n, (bi + 1) * BLOCK))
            cols = torch.arange(bj * BLOCK, min(mod.k, (bj + 1) * BLOCK))
            out.append(mod.layout.index(rows, cols).reshape(-1))
        return torch.cat(out)

    @staticmethod
    def _scale_index(mod: Fp8Module, blocks: torch.Tensor) -> torch.Tensor:
        """Flat positions of the blocks' scales in weight_scale_inv [grid rows, grid cols]."""
        return blocks[:, 0] * mod.grid()[1] + blocks[:, 1]

    def touched_blocks(self, changes) -> Dict[str, torch.Tensor]:
        """module prefix -> int64 [nb, 2] blocks (bi, bj) holding a changed element, sorted."""
        out: Dict[str, List[torch.Tensor]] = {}
        for name, c in changes.tensors.items():
            if name not in self.map.of_tensor or c.indices.numel() == 0:
                continue
            prefix, part = self.map.of_tensor[name]
            k = self.map.modules[prefix].k
            rows = c.indices // k + part.row
            cols = c.indices % k
            out.setdefault(prefix, []).append((rows // BLOCK) * (1 << 32) + cols // BLOCK)
        return {p: _unpack(torch.unique(torch.cat(v))) for p, v in out.items()}

    def all_blocks(self, prefixes) -> Dict[str, torch.Tensor]:
        out = {}
        for p in prefixes:
            gi, gj = self.map.modules[p].grid()
            bi, bj = torch.meshgrid(torch.arange(gi), torch.arange(gj), indexing="ij")
            out[p] = torch.stack([bi.reshape(-1), bj.reshape(-1)], dim=1)
        return out

    def blocks_total(self) -> int:
        return sum(math.prod(m.grid()) for m in self.map.modules.values())

    def write(self, blocks: Dict[str, torch.Tensor], weights: Dict[str, torch.Tensor],
              stats: Stats, *, write_scales: bool = True) -> Tuple[Undo, List[str]]:
        """Quantizes and writes `blocks` from the version `weights` (BF16 views), CHUNK_BLOCKS at
        a time; codes and scale of each block are written together. Returns (undo record, the
        modules whose runtime bytes, read back, are not the quantizer's output: a torn or lost
        write). `write_scales=False` exists only so that a test can show a torn write caught."""
        undo: Undo = []
        bad: List[str] = []
        with torch.no_grad():
            for prefix in sorted(blocks):
                mod = self.map.modules[prefix]
                flat = mod.weight.data.reshape(-1).view(torch.uint8)
                sflat = mod.scale.data.view(-1)
                dev = flat.device
                for at in range(0, blocks[prefix].shape[0], CHUNK_BLOCKS):
                    blk = blocks[prefix][at:at + CHUNK_BLOCKS]
                    codes, scales = self.quantize_module(mod, blk, weights)
                    vals = torch.cat([codes[i, :min(BLOCK, mod.n - bi * BLOCK),
                                            :min(BLOCK, mod.k - bj * BLOCK)].reshape(-1)
                                      for i, (bi, bj) in enumerate(blk.tolist())])
                    pos = self._positions(mod, blk).to(dev)
                    sidx = self._scale_index(mod, blk).to(dev)
                    old, old_s = flat[pos].cpu(), sflat[sidx].cpu()
                    undo.append((prefix, blk, old, old_s))
                    flat[pos] = vals.to(dev)
                    if write_scales:
                        sflat[sidx] = scales.to(dev)
                    stats.blocks += int(blk.shape[0])
                    stats.staged_bytes = max(stats.staged_bytes, codes.numel() * 10 +
                                             vals.numel() + pos.numel() * 8)
                    stats.undo_bytes += old.numel() + old_s.numel() * 4 + blk.numel() * 8
                    if not (torch.equal(flat[pos].cpu(), vals) and torch.equal(
                            sflat[sidx].cpu().view(torch.int32), scales.view(torch.int32))):
                        if prefix not in bad:
                            bad.append(prefix)
        return undo, bad

    def undo(self, record: Undo) -> None:
        with torch.no_grad():
            for prefix, blk, old, old_s in reversed(record):
                mod = self.map.modules[prefix]
                flat = mod.weight.data.reshape(-1).view(torch.uint8)
                flat[self._positions(mod, blk).to(flat.device)] = old.to(flat.device)
                sflat = mod.scale.data.view(-1)
                sflat[self._scale_index(mod, blk).to(sflat.device)] = old_s.to(sflat.device)

    # -- tensors kept in BF16 --

    def write_bf16(self, name: str, indices: Optional[torch.Tensor], values: torch.Tensor,
                   undo: list) -> int:
        """Changed elements (or, indices None, the whole tensor) of a BF16-kept tensor."""
        t = self.map.bf16[name]
        flat = t.param.data.reshape(-1)
        n = math.prod(self.map.specs[name][1])
        with torch.no_grad():
            if indices is None:
                old = flat[t.offset:t.offset + n].clone()
                undo.append((name, None, old))
                flat[t.offset:t.offset + n] = values.reshape(-1).to(flat.device)
                return n
            at = (indices + t.offset).to(flat.device)
            undo.append((name, at, flat[at].clone()))
            flat[at] = values.to(flat.device)
            return int(indices.numel())

    def undo_bf16(self, record: list) -> None:
        with torch.no_grad():
            for name, at, old in reversed(record):
                t = self.map.bf16[name]
                flat = t.param.data.reshape(-1)
                if at is None:
                    flat[t.offset:t.offset + old.numel()] = old
                else:
                    flat[at] = old

    def reprocess(self, names) -> List[str]:
        """Re-runs the post-load processing of unquantized modules whose BF16 weight was written
        (on CPU vLLM derives packed copies of linear weights, the LM head's too)."""
        done, out = set(), []
        for name in sorted(names):
            t = self.map.bf16.get(name)
            mod = t.module if t is not None else None
            if mod is None or id(mod) in done or not hasattr(mod.quant_method,
                                                            "process_weights_after_loading"):
                continue
            if "Unquantized" not in type(mod.quant_method).__name__:
                continue
            done.add(id(mod))
            mod.quant_method.process_weights_after_loading(mod)
            out.append(name)
        return out

    def bf16_runtime(self, name: str) -> torch.Tensor:
        t = self.map.bf16[name]
        dtype, shape = self.map.specs[name]
        n = math.prod(shape)
        return t.param.data.reshape(-1)[t.offset:t.offset + n].reshape(shape)

    # -- the full check --

    def runtime_codes(self, mod: Fp8Module) -> torch.Tensor:
        """The module's codes read back through the layout, as logical [N, K] uint8."""
        flat = mod.weight.data.reshape(-1).view(torch.uint8)
        return flat[mod.layout.index(torch.arange(mod.n), torch.arange(mod.k)).reshape(-1)
                    .to(flat.device)].cpu().reshape(mod.n, mod.k)

    def expected(self, mod: Fp8Module, weights) -> Tuple[torch.Tensor, torch.Tensor]:
        """The module's codes [N, K] and scales as vLLM quantizes the version's whole weight."""
        w = torch.empty(mod.n, mod.k, dtype=torch.bfloat16)
        for p in mod.parts:
            w[p.row:p.row + p.rows] = weights[p.name]
        codes, scales = quantize(w)
        return codes.view(torch.uint8), scales

    def digests(self, weights) -> Tuple[Dict[str, Tuple[int, int]], Dict[str, Tuple[int, int]]]:
        """(expected, runtime): module prefix -> (digest v2 of the codes, of the scales); the
        expected ones computed from the BF16 version by the quantizer."""
        want, got = {}, {}
        for prefix, mod in sorted(self.map.modules.items()):
            codes, scales = self.expected(mod, weights)
            want[prefix] = (digest_v2(codes), digest_v2(scales))
            got[prefix] = (digest_v2(self.runtime_codes(mod)),
                           digest_v2(mod.scale.data.cpu().contiguous()))
        return want, got


def _unpack(keys: torch.Tensor) -> torch.Tensor:
    return torch.stack([keys >> 32, keys & ((1 << 32) - 1)], dim=1)
