"""Compile the W4A16 GEMM kernel for Hopper without a GPU and report what ptxas made of it.

    python benchmarks/nvfp4_gemm_ptx.py --config '{"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":128,"SWAP_AB":true,"SPLIT_K":4,"num_warps":4,"num_stages":4}'
    python benchmarks/nvfp4_gemm_ptx.py --dx --config '...' --out /tmp/k    # also keep TTGIR / PTX
    python benchmarks/nvfp4_gemm_ptx.py --config '{"GEMV":true,"BLOCK_N":64,"BLOCK_K":128,"num_warps":8}'
    python benchmarks/nvfp4_gemm_ptx.py --config '{"DECODE":true,"RW":1,"KV":1,"MT":8,"num_warps":4}'  # Gluon
    python benchmarks/nvfp4_gemm_ptx.py --config '{"DECODE":true,"RW":1,"KV":1,"num_warps":4,"LORA":true,"LORA_R":32}'
    python benchmarks/nvfp4_gemm_ptx.py --config '{"WGMMA":true,"WARP_SPECIALIZE":true}'  # Gluon, wgmma_gemm.py
    python benchmarks/nvfp4_gemm_ptx.py --config '{"SWAP":true,"BN":16,"WARPS":4}'  # Gluon, swap_gemm.py (forward)

Per config it prints registers, spill bytes, shared memory, the wgmma count and the mix of
memory instructions in the PTX (byte vs vector shared-memory loads, cp.async, shuffles,
barriers): the figures that explained the forward's byte loads (kernels/nvfp4/NOTES.md,
fourth session). Also the SASS instruction count of the main K loop and its opcode mix
(`cuobjdump -sass` of triton's cubin): divided by the weights a thread handles per step it
is the issue cost per weight (NOTES.md, sixth session). Integer arguments are marked
divisible by 16 and stride_ak == 1, as triton specializes them for real shapes, and
N_OUT % BLOCK_N == 0 (EVEN_N, true of every vLLM 7B shape). Use the triton version of the GPU
image (3.6 on the H200 machine, e.g. `pip install --target /tmp/t36 triton==3.6.0` and
PYTHONPATH=/tmp/t36): layouts and pipelining differ between versions. Uses triton's compiler API (ASTSource, GPUTarget),
which is not a stable interface.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INTS = ["M", "N_OUT", "RED", "R", "C", "MN", "stride_am", "stride_w", "stride_s", "SPLIT_K", "M_BUCKET"]
PTRS = {"a_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "bias_ptr": "*fp32",
        "c_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
MEM = r"(?:ld|st)\.shared[.a-z0-9]*|ld\.global[.a-z0-9]*|cp\.async\.c[ag][.a-z0-9]*|bar\.sync|shfl[.a-z0-9]*"


def sass_of(cubin: bytes, tools: Path) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS (`cuobjdump -sass`)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)]


def wgmma_a_overwrites(ins: list[tuple[int, str]]) -> int:
    """Instructions that write a register an in-flight wgmma reads its A operand from: after each
    HGMMA with A in registers (4 of them from its second operand), walking on in program order (and
    back along loop branches) to the `WARPGROUP.DEPBAR.LE gsb0, 0x0` that retires it. PTX forbids
    such writes; ptxas does not always catch them (this is how swap_gemm's first draft was wrong)."""
    at = {pc: i for i, (pc, _) in enumerate(ins)}
    bad = set()
    for i, (_, txt) in enumerate(ins):
        m = re.match(r"(?:@!?U?P\w+\s+)?HGMMA\S*\s+R\d+,\s*R(\d+),", txt)
        if not m:
            continue
        a_regs, j, seen = set(range(int(m.group(1)), int(m.group(1)) + 4)), i + 1, set()
        while j < len(ins) and j not in seen:
            seen.add(j)
            pc, t = ins[j]
            body = re.sub(r"^@!?U?P\w+\s+", "", t)
            if body.startswith("WARPGROUP.DEPBAR") and body.rstrip().endswith("0x0"):
                break
            if (d := re.match(r"(\S+)\s+R(\d+)\b", body)) and not body.startswith("HGMMA"):
                width = 4 if ".128" in d.group(1) else 2 if (".64" in d.group(1) or ".WIDE" in d.group(1)) else 1
                if a_regs & set(range(int(d.group(2)), int(d.group(2)) + width)):
                    bad.add(pc)
            if (b := re.search(r"BRA\s+(?:`\(.*?\))?\s*0x([0-9a-f]+)", body)) and int(b.group(1), 16) < pc:
                j = at.get(int(b.group(1), 16), len(ins))  # follow the loop back
            else:
                j += 1
    return len(bad)


def sass_main_loop(ins: list[tuple[int, str]]) -> dict:
    """Instructions in the SASS of the kernel's main loop (the longest loop that loads from
    global memory), and their mix by opcode: a static stand-in for issue cost."""
    loops = [(int(m.group(1), 16), pc) for pc, txt in ins
             if (m := re.search(r"BRA\s+(?:`\(.*?\))?\s*0x([0-9a-f]+)", txt)) and int(m.group(1), 16) < pc]
    if not loops:
        return {"instructions": 0, "ops": {}}
    with_loads = [lp for lp in loops if any("LDG" in t for pc, t in ins if lp[0] <= pc <= lp[1])] or loops
    lo, hi = max(with_loads, key=lambda lp: lp[1] - lp[0])  # the longest loop that loads from global
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                              for pc, t in ins if lo <= pc <= hi)
    return {"instructions": sum(ops.values()), "ops": dict(ops.most_common(12))}


def compile_config(cfg: dict, trans_w: bool, out: Path | None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.nvfp4 import gemm

    gemm._HW_E4M3 = triton.language.constexpr(True)  # compiling for sm_90a, whatever this machine has
    cfg = dict(cfg)
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 1 if cfg.get("GEMV") else 3)
    regs = {"maxnreg": cfg.pop("maxnreg")} if "maxnreg" in cfg else {}  # a cap for ptxas, as at launch
    cfg.pop("SPLIT_K", None)  # a runtime argument
    if cfg.pop("DECODE", False):  # the Gluon mma.sync kernel (kernels/nvfp4/decode_gemm.py)
        from triton.experimental.gluon._runtime import GluonASTSource

        from kernels.nvfp4 import decode_gemm
        fn = decode_gemm._decode_kernel
        consts = {"RW": cfg["RW"], "KV": cfg["KV"], "MT": cfg.get("MT", 8), "HAS_BIAS": False,
                  "G_PER_ROW": cfg.get("G_PER_ROW", False), "STAGES": cfg.get("STAGES", 0),
                  "RING_S": cfg.get("RING_S", False), "LORA": cfg.get("LORA", False),
                  "LORA_R": cfg.get("LORA_R", 16), "N_LORAS": cfg.get("N_LORAS", 1),
                  "LORA_SHRINK": cfg.get("LORA_SHRINK", 0)}
        ptrs = {"x_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "bias_ptr": "*fp32",
                "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "lt_ptr": "*fp32", "lb0_ptr": "*bf16",
                "lb1_ptr": "*bf16", "lb2_ptr": "*bf16", "lidx_ptr": "*i32", "la0_ptr": "*bf16", "la1_ptr": "*bf16",
                "la2_ptr": "*bf16", "lws_ptr": "*fp32", "lsync_ptr": "*i32"}
        div16 = [*ptrs, "N", "K", "stride_xm", "stride_w", "stride_s"]
        src = _source(GluonASTSource, fn, ptrs, consts, div16)
        return _ptxas_report(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}),
                             out, "_".join(f"{v}" for v in ("decode", *consts.values(), warps)))
    if cfg.pop("SWAP", False):  # the Gluon kernel with the weight as wgmma's register operand (swap_gemm.py)
        from triton.experimental.gluon._runtime import GluonASTSource

        from triton.experimental.gluon import language as gl

        from kernels.nvfp4 import swap_gemm
        c = swap_gemm.full_config(cfg)
        consts = {"BN": c["BN"], "STAGES": c["STAGES"], "GROUP_M": c["GROUP_M"], "HAS_BIAS": False,
                  "G_PER_ROW": c.get("G_PER_ROW", False), "PREPACKED": bool(c["PREPACKED"]), "TMA_W": bool(c["TMA_W"]),
                  "PINGPONG": bool(c["PINGPONG"]), "PP_REGS": c["PP_REGS"]}
        # constexprs all given (`_source` would make one left out an i32 argument)
        consts.update(PRODUCER=bool(c["PRODUCER"]), PRODUCER_REGS=c["PRODUCER_REGS"])
        # the files' tag: as before PRODUCER unless it is on
        tag = [v for key, v in consts.items() if c["PRODUCER"] or key not in ("PRODUCER", "PRODUCER_REGS")]
        rows = 16 * c["WARPS"] // (2 if c["PINGPONG"] else 1)  # PINGPONG: the boxes are one warp group's rows
        out_layout = gl.NVMMASharedLayout.get_default_for([c["BN"], rows], gl.bfloat16)
        x_desc = f"tensordesc<bf16[{c['BN']}, {swap_gemm.BK}],{swap_gemm._X_SMEM_LAYOUT!r}>"
        tma_w = c["TMA_W"]
        w_desc = f"tensordesc<u8[{rows}, 32],{swap_gemm._BYTES_SMEM_LAYOUT_2D!r}>"
        s_desc = f"tensordesc<u8[1, {rows // 4}, 16],{swap_gemm._BYTES_SMEM_LAYOUT_3D!r}>"
        ptrs = {"x_desc": x_desc, "w_desc": w_desc if tma_w else x_desc, "s_desc": s_desc if tma_w else x_desc,
                "out_desc": f"tensordesc<bf16[{c['BN']}, {rows}],{out_layout!r}>",
                "packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "bias_ptr": "*fp32",
                "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
        div16 = [n for n in ptrs if not n.endswith("_desc")] + ["N", "K", "stride_w", "stride_s"]
        src = _source(GluonASTSource, swap_gemm._swap_kernel, ptrs, consts, div16)
        warps = c["WARPS"] // 2 if c["PINGPONG"] else c["WARPS"]  # PINGPONG: the default partition's
        return _ptxas_report(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}),
                             out, "_".join(f"{v}" for v in ("swap", *tag, c["WARPS"])))
    if cfg.pop("WGMMA", False):  # the Gluon decode-to-shared-memory + wgmma kernel (wgmma_gemm.py)
        from triton.experimental.gluon._runtime import GluonASTSource

        from kernels.nvfp4 import wgmma_gemm
        c = wgmma_gemm.full_config(cfg)
        consts = {"FORWARD": not trans_w, **{k: c[k] for k in ("BM", "BP", "BR", "STAGES", "GROUP_M")},
                  "HAS_BIAS": False, "G_PER_ROW": False}
        ptrs = {"a_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "bias_ptr": "*fp32",
                "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
        div16 = [*ptrs, "P", "R", "stride_am", "stride_w", "stride_s"]
        options = {"num_warps": c["BM"] // 16}
        if c.get("WARP_SPECIALIZE"):
            consts.update({k: c[k] for k in ("DECODED", "DECODE_REGS", "DECODE_WARPS", "PINGPONG", "MMA_REGS")})
            del ptrs["a_ptr"]
            pp = 2 if c["PINGPONG"] else 1  # PINGPONG: each wgmma warp group a partition with half the input rows
            ptrs["a_desc"] = f"tensordesc<bf16[{c['BM'] // pp}, {c['BR']}],{wgmma_gemm._A_SMEM_LAYOUT!r}>"
            options.update(maxnreg=c["MAXNREG"], num_warps=c["WARPS"] // pp)
        fn = wgmma_gemm._ws_kernel if c.get("WARP_SPECIALIZE") else wgmma_gemm._wgmma_kernel
        src = _source(GluonASTSource, fn, ptrs, consts, div16)
        return _ptxas_report(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options),
                             out, "_".join(f"{v}" for v in ("wgmma", *consts.values())))
    bk = cfg["BLOCK_K"]
    if cfg.pop("GEMV", False):  # the CUDA-core forward for one input row
        fn = gemm._w4a16_gemv_kernel
        consts = {"HAS_BIAS": False, "GPU_MATH": True, **cfg}
    else:
        fn = gemm._w4a16_kernel
        consts = {"TRANS_W": trans_w, "HAS_BIAS": False, "GROUP_M": 8, "EVEN_K": True, "EVEN_N": True, "GPU_MATH": True,
                  "PERMUTE_K": (perm := cfg.pop("PERMUTE_K", True) and gemm._permute_k(trans_w, bk, bk)),
                  "SCALE_PAIRS": cfg.pop("SCALE_PAIRS", gemm.SCALE_PAIRS_DEFAULT) and perm and bk >= 128,
                  "stride_ak": 1,
                  **cfg}
    # constexpr parameters with a default (A_PREPERM, EVICT_W, G_PER_ROW) take it unless given
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    ptrs = {**PTRS, "a_ptr": "*i32"} if fn is not gemm._w4a16_kernel else PTRS  # GEMV: input as words
    src = _source(ASTSource, fn, ptrs, consts, [n for n in (*PTRS, *INTS) if n not in ("M", "SPLIT_K", "M_BUCKET")])
    options = {"num_warps": warps, "num_stages": stages, **regs}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return _ptxas_report(k, out, "_".join(f"{v}" for v in (("dx" if trans_w else "fwd"), *cfg.values(), warps, stages)))


def _source(source_cls, fn, ptrs: dict, consts: dict, div16: list):
    """The compiler's source for `fn`: pointer types from `ptrs`, other non-constexpr arguments
    int32, the arguments named in `div16` marked divisible by 16 (as triton specializes them
    for real shapes); the signature follows the kernel's argument order."""
    names = fn.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16 if n in names}
    return source_cls(fn=fn, signature=sig, constexprs=consts, attrs=attrs)


def _ptxas_report(k, out: Path | None, tag: str) -> dict:
    """What ptxas (sm_90a) and the PTX / SASS say about one compiled kernel; its TTGIR, PTX and
    cubin also go to `out` when given."""
    import triton

    ptx = k.asm["ptx"]
    # the newest ptxas triton ships: an older one may not know the PTX version triton emits
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    ptxas = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    os.unlink(f.name)
    if r.returncode:
        raise RuntimeError(f"{ptxas.name} failed: {r.stderr.strip()[-500:]}")
    info = r.stderr
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
        (out / f"{tag}.ptx").write_text(ptx)
        (out / f"{tag}.cubin").write_bytes(k.asm["cubin"])  # cuobjdump -sass FILE for the SASS
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, info)) else None  # noqa: E731
    sass = sass_of(k.asm["cubin"], bin_dir)
    loop = sass_main_loop(sass)
    return {"registers": num(r"Used (\d+) registers"), "spill_store_bytes": num(r"(\d+) bytes spill stores"),
            "sass_loop_instructions": loop["instructions"], "sass_loop_ops": loop["ops"],
            "shared_bytes": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "fma_f32": ptx.count("fma.rn.f32"),
            # ptxas C7515: it made every wgmma wait for the previous one (the async pipeline is lost)
            "wgmma_serialized": "C7515" in info,
            "wgmma_a_overwrites": wgmma_a_overwrites(sass),  # must be 0 (a race: wrong results)
            # warp specialization: register reallocation per partition, mbarrier hand-overs, TMA loads
            "setmaxnreg": {d: sorted({int(n) for n in re.findall(rf"setmaxnreg\.{d}\.sync\.aligned\.u32\s+(\d+)", ptx)})
                           for d in ("dec", "inc")},
            "mbarrier_arrives": len(re.findall(r"mbarrier\.arrive\.shared", ptx)),
            "tma_loads": ptx.count("cp.async.bulk.tensor"),
            "memory_instructions": dict(sorted(collections.Counter(re.findall(MEM, ptx)).items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--config", type=json.loads, action="append", required=True,
                    help="kernel config as JSON (BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, num_warps, num_stages, "
                         "optional PERMUTE_K, A_PREPERM, EVICT_W; or GEMV: true with BLOCK_N, BLOCK_K; or DECODE: true "
                         "with RW, KV, MT (8 or 16 input rows), num_warps; or WGMMA: true with wgmma_gemm's config "
                         "keys, WARP_SPECIALIZE: true for its warp-specialized kernel; or SWAP: true with "
                         "swap_gemm's WARPS, BN, STAGES, GROUP_M, PREPACKED, TMA_W, PINGPONG, PP_REGS, PRODUCER, "
                         "PRODUCER_REGS); "
                         "repeat for several")
    ap.add_argument("--dx", action="store_true", help="the dX kernel (dy @ W) instead of the forward")
    ap.add_argument("--out", type=Path, help="also write each config's TTGIR, PTX and cubin here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles for the GPU", file=sys.stderr)
        return 2
    for cfg in args.config:
        print(json.dumps({"config": cfg, "dx": args.dx, **compile_config(cfg, args.dx, args.out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
