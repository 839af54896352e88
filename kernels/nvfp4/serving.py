"""The NVFP4 forward as one torch custom op for serving (vLLM's ``fused`` backend).

``torch.ops.qerl.nvfp4_linear(x, packed, scale, row_global_scale, bias)`` = x @ Ŵᵀ (+ bias)
with Ŵ never materialized, for x bf16 [M, K]. It is a registered custom op with a fake
(meta) implementation, so torch.compile (vLLM compiles its models) treats it as one opaque
node and CUDA graphs capture its kernel launches.

No autotuning: configs come from fixed tables, because an autotuner benchmarks on first use,
which must not happen while vLLM captures CUDA graphs. Two tables, the first that has an
entry wins:

1. a measured table per weight shape [N, K]: `serving_configs.json` beside this file, or the
   file named by ``QERL_NVFP4_SERVING_CONFIGS``. `benchmarks/nvfp4_gemm_sweep.py
   --serving-table FILE` merges into it: per shape, the fastest correct config at each measured
   M that beats the fallback (split-K included), applied to every M above the measured M
   before it (a config measured at 64 rows serves 33-64);
2. `SERVING_CONFIGS`, by input rows only, for shapes nobody measured; its split-K count is
   derived per call from the shape so that the grid fills the SMs.

Both choose among the same kernels (the generic table never picks the decode kernel):

* M = 1: the CUDA-core GEMV (`gemm._w4a16_gemv_kernel`), when K % its BLOCK_K == 0;
* M ≤ 16 on a GPU of sm_89 or newer, where the measured table says so (the 7B shapes up to 8
  rows): the Gluon mma.sync kernel of `decode_gemm` (each warp streams its own rows, in
  registers or, on gate_up and down at one row, through a shared-memory ring; on an H200 1-13 %
  faster per GEMM than the GEMV / tensor-core kernel at 1-8 rows before the ring, +3 % tokens/s
  in vLLM at one sequence; the ring another 5-10 % on those two; NOTES.md 2026-12-06 evening);
* M ≤ 64 (≤ 128 on the 7B gate_up and down shapes, measured): the tensor-core kernel,
  swapped, split-K;
* larger M: Triton dequantize to a transient bf16 Ŵ (one layer at a time), then cuBLAS.
  That writes and reads every layer's bf16 weights in every forward: at M = 64 it took
  1.5-2.9x the fused kernel's time on an H100, but at large M the GEMM is compute bound and
  cuBLAS beats the fused kernel (kernels/nvfp4/NOTES.md: 43-50 % of cuBLAS at M = 4096).

``torch.ops.qerl.nvfp4_linear_lora(x, packed, scale, row_global_scale, bias, lora_t, lora_a,
lora_b, lora_slots, slices)`` adds a LoRA as vLLM lays it out (`lora.py`). Where the decode
kernel serves the call, one launch does the GEMM, the shrink (programs ahead of the tile
programs) and the expand (the tile programs' epilogue) instead of vLLM's fill, shrink and
expand after the GEMM; elsewhere `lora.py`'s shrink and expand run around the GEMM. The vLLM
plugin (kernels/vllm_nvfp4_dequant.py) routes the fused layers' LoRA through it.

Two switches, both off by default: measured on an H100 (kernels/nvfp4/NOTES.md, 2026-12-05
afternoon) they are correct but gain nothing inside vLLM. ``QERL_NVFP4_PDL=1`` launches the
kernels with programmatic dependent launch (a kernel starts while the one before it finishes,
prefetching its weight rows to L2 until the previous kernel's output is ready:
`gemm._pdl_start`): 2-3 % slower in vLLM. ``QERL_NVFP4_SCALE_PAIRS=1`` decodes the block scales
two at a time (`gemm._SCALE_PAIR_ASM`, 250 → 241 SASS instructions per K step): 0.7 % faster
on the GEMMs alone, within the noise in vLLM.

Status: correct on an H200 at every vLLM 7B shape and M = 1, 2, 7, 8, 9, 16 and 17 with the
decode kernel's entries, eagerly, in CUDA graphs and under torch.compile
(`benchmarks/nvfp4_serving_check.py`, 2026-12-06), and earlier at M = 1-300 (the 32- to 128-row
configs were checked by the sweep on an H100 only). Inside vLLM 0.26 it serves a 7B shape at
227 / 3,324 tok/s for 1 / 16 sequences on an H200 with sampled-token logprobs (1.36x / 1.32x
bf16 on the same machine; README) and 206 / 3,001 on an H100 (before the decode kernel).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional

import torch
import triton

# rows bound -> forced config of kernels/nvfp4/gemm.py (SPLIT_K filled in per call)
SERVING_CONFIGS: list[tuple[int, dict]] = [
    (1, dict(GEMV=True, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1)),
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, num_warps=4, num_stages=4)),
    # measured on an H100 (NOTES.md, 2026-12-06): within 13 % of each 7B shape's best at M = 64, and
    # 1.4-2.9x faster than dequantize + cuBLAS there; at M = 128 no one config beat that everywhere
    (64, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, SWAP_AB=True, num_warps=4, num_stages=3)),
]
MAX_SPLIT = 8
TABLE_ENV = "QERL_NVFP4_SERVING_CONFIGS"
# "1": the warp-specialized wgmma kernel (wgmma_gemm.py, WS_CONFIG) takes the rows neither table
# covers, on Hopper, where its 256 × 128 tiles give every SM one. Off: at 256 rows on an H100 it is
# 1.8x dequantize + cuBLAS on gate_up (the one 7B shape with that many tiles at 256 rows), but it
# has not run inside vLLM yet (kernels/nvfp4/NOTES.md, 2026-12-07)
WGMMA_ENV = "QERL_NVFP4_SERVING_WGMMA"
PDL_ENV = "QERL_NVFP4_PDL"  # "1": programmatic dependent launch (gemm._pdl_start); off: slower in vLLM
MEASURED_KEYS = ("us", "cublas_bf16_us", "dequant_cublas_us")  # figures beside each config, not kernel arguments
BUNDLED_TABLE = Path(__file__).with_name("serving_configs.json")


@functools.lru_cache(maxsize=4)
def _load_table(path: str) -> dict:
    """{(N, K): [(rows bound, config), ...] ascending} from a sweep's serving table."""
    try:
        data = json.loads(Path(path).read_text())
        table = {}
        for shape, entries in data["configs"].items():
            n, k = (int(v) for v in shape.split("x"))
            table[(n, k)] = sorted(((int(rows), {key: v for key, v in cfg.items() if key not in MEASURED_KEYS})
                                    for rows, cfg in entries), key=lambda e: e[0])
        return table
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"NVFP4 serving config table {path}: {type(e).__name__}: {e} (expected "
                         '{"configs": {"NxK": [[rows, {config}], ...]}}, as nvfp4_gemm_sweep.py writes)') from e


def measured_table() -> dict:
    """The per-shape table in use (empty when there is none)."""
    path = os.environ.get(TABLE_ENV) or (str(BUNDLED_TABLE) if BUNDLED_TABLE.exists() else "")
    return _load_table(path) if path else {}


def _split_k(tiles: int, k_tiles: int, sms: int) -> int:
    """Split-K count: doubled while the programs stay within two per SM and every split keeps
    at least 2 K tiles."""
    split = 1
    while split < MAX_SPLIT and tiles * split <= sms and k_tiles >= 4 * split:
        split *= 2
    return split


def config_for(m: int, n: int, k: int, sms: int, decode: bool = True, wgmma: bool = False) -> Optional[dict]:
    """The forced config for an [m, k] x [n, k]ᵀ forward, or None for dequantize + cuBLAS.
    `decode`: whether the Gluon decode kernel can run here (a CUDA GPU, not the interpreter);
    its configs are passed over where it cannot or where the shape does not fit them.
    `wgmma`: whether the Gluon wgmma kernel can run here (Hopper); it takes what neither table
    covers where the shape fits it with at least one CTA per SM (fewer leave SMs idle)."""
    def usable(cfg: dict) -> bool:
        if cfg.get("DECODE"):
            from . import decode_gemm
            return decode and decode_gemm.AVAILABLE and decode_gemm.supports(m, n, k, cfg)
        return not (cfg.get("GEMV") and (m != 1 or k % cfg["BLOCK_K"]))

    for rows, cfg in measured_table().get((n, k), []):  # measured at M = rows: for every M above the one before
        if m <= rows and usable(cfg):
            return dict(cfg)
    for rows, cfg in SERVING_CONFIGS:
        if m <= rows:
            if not usable(cfg):
                continue
            bm = 1 if cfg.get("GEMV") else cfg["BLOCK_M"]
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, cfg["BLOCK_N"])
            return dict(cfg, SPLIT_K=_split_k(tiles, k // cfg["BLOCK_K"], sms))
    if wgmma:
        from . import wgmma_gemm
        c = wgmma_gemm.WS_CONFIG
        if wgmma_gemm.AVAILABLE and wgmma_gemm.supports(m, n, k, c) and triton.cdiv(m, c["BM"]) * (n // c["BP"]) >= sms:
            return {"WGMMA": True, "WARP_SPECIALIZE": True}
    return None


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=8)
def _wgmma_runs(device: torch.device) -> bool:
    """Whether the Gluon wgmma kernel runs here: a Hopper GPU (sm_90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=8)
def _decode_runs(device: torch.device) -> bool:
    """Whether the Gluon decode kernel runs here: a CUDA GPU with e4m3 conversions (sm_89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def prepare(device: torch.device) -> None:
    """Allocate the split-K counter buffer and read the config table now (at model load, so a
    bad table fails there), not during CUDA-graph capture."""
    from . import gemm

    measured_table()

    gemm._counters(device, 1 << 16)


def _config(x: torch.Tensor, m: int, n: int, k: int) -> Optional[dict]:
    """The config `config_for` gives this call on this device (PDL added when asked for)."""
    from . import gemm

    cfg = config_for(m, n, k, _num_sms(x.device), decode=_decode_runs(x.device) and not gemm.INTERPRET,
                     wgmma=_wgmma_runs(x.device) and not gemm.INTERPRET and os.environ.get(WGMMA_ENV, "0") == "1")
    if cfg is not None and os.environ.get(PDL_ENV, "0") == "1":
        cfg["PDL"] = True  # the kernel may start while the previous one finishes (gemm._pdl_start)
    return cfg


def _linear(x, packed, scale, row_global_scale, bias, cfg: Optional[dict]) -> torch.Tensor:
    from . import gemm, triton_kernels

    if cfg is None:  # per-row divisors are handled by the bf16 dequantize too
        w = triton_kernels.dequantize(packed, scale, row_global_scale, torch.bfloat16)
        return torch.nn.functional.linear(x, w, bias)
    return gemm.linear_w4a16(x, packed, scale, row_global_scale, bias, _config=cfg)


@torch.library.custom_op("qerl::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_global_scale: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 @ Ŵᵀ (+ bias) -> [M, N] bf16; Ŵ = E2M1(packed) · scale / row_global_scale[row]."""
    m, k = x.shape
    return _linear(x, packed, scale, row_global_scale, bias, _config(x, m, packed.shape[0], k))


@nvfp4_linear.register_fake
def _(x, packed, scale, row_global_scale, bias=None):
    return x.new_empty((x.shape[0], packed.shape[0]))


@torch.library.custom_op("qerl::nvfp4_linear_lora", mutates_args=())
def nvfp4_linear_lora(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_global_scale: torch.Tensor,
                      bias: Optional[torch.Tensor], lora_t: Optional[torch.Tensor], lora_a: list[torch.Tensor],
                      lora_b: list[torch.Tensor], lora_slots: torch.Tensor, slices: list[int]) -> torch.Tensor:
    """`nvfp4_linear` plus a LoRA in vLLM's layout (`lora.py`): lora_a / lora_b the S per-slice stacks
    [max_loras, 1, r, K] / [max_loras, 1, N_s, r] bf16, lora_slots [M] each token's adapter slot
    (-1: none), slices the S output widths; lora_t the shrink's output T [S, M, r] fp32 if the
    caller ran it (lora_a is then not read and may be []), else None. Where the Gluon decode kernel
    serves the call (M ≤ 8 on the measured 7B shapes) the expand is its epilogue and, without
    lora_t, the shrink runs in the same launch: one launch for GEMM + LoRA. Elsewhere the LoRA
    kernels of `lora.py` run around the GEMM (as many launches as vLLM's path)."""
    from . import decode_gemm, gemm
    from .lora import check_lora_args, lora_expand_, lora_shrink

    m, k = x.shape
    n = packed.shape[0]
    r = lora_b[0].shape[-1] if lora_b else 0
    if lora_t is None and len(lora_a) != len(slices):
        raise ValueError(f"nvfp4_linear_lora: {len(lora_a)} LoRA A tensors for {len(slices)} slices")
    t = lora_t if lora_t is not None else torch.empty((len(slices), m, r), dtype=torch.float32, device=x.device)
    check_lora_args(m, n, t, lora_b, lora_slots, slices)
    cfg = _config(x, m, n, k)
    decode = cfg is not None and cfg.get("DECODE")
    if decode and lora_t is None and decode_gemm.lora_fits(m, cfg, slices, r, shrink=True):
        return gemm.linear_w4a16(x, packed, scale, row_global_scale, bias, _config=cfg,
                                 _lora=(t, lora_b, lora_slots, slices, list(lora_a)))
    if lora_t is None:  # `t` above only carried the shape to check_lora_args
        t = lora_shrink(x, list(lora_a), lora_slots)
    if decode and decode_gemm.lora_fits(m, cfg, slices, r):
        return gemm.linear_w4a16(x, packed, scale, row_global_scale, bias, _config=cfg,
                                 _lora=(t, lora_b, lora_slots, slices, None))
    return lora_expand_(_linear(x, packed, scale, row_global_scale, bias, cfg), t, lora_b, lora_slots, slices)


@nvfp4_linear_lora.register_fake
def _(x, packed, scale, row_global_scale, bias, lora_t, lora_a, lora_b, lora_slots, slices):
    return x.new_empty((x.shape[0], packed.shape[0]))
