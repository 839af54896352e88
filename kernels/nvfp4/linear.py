"""A frozen NVFP4 (W4A16) Linear layer for training LoRA adapters on a 4-bit base.

`NVFP4Linear` keeps a compressed-tensors ``nvfp4-pack-quantized`` weight exactly as the
checkpoint stores it, as buffers (never parameters: the base is frozen):

    weight_packed        uint8          [out, in/2]   two E2M1 codes per byte
    weight_scale         float8_e4m3fn  [out, in/16]  one scale per block of 16 inputs
    weight_global_scale  float32        [1]           divisor of the block scales
    bias                 (optional)     [out]         frozen, in the compute dtype

i.e. 0.5 + 1/16 = 0.5625 bytes per weight. `forward` runs through `W4A16Function`:
Y = X·Ŵᵀ (+ bias, fused into the GEMM), and its backward computes only dX = dY·Ŵ; there is
no weight gradient and X is not saved for backward (only the packed weight is, by reference,
and Ŵ itself when `keep_dequantized` is set: see there).

The GEMMs go through `_backend(x)`, the one place that picks the implementation:

* a bf16 CUDA tensor: Triton dequantize (`triton_kernels.dequantize`, 0.069 ms for an
  18944×3584 weight on an H200) into a transient bf16 Ŵ, then cuBLAS. This is the default
  because it was measured faster: on an H200 the fused kernels of `kernels/nvfp4/gemm.py`
  (`QERL_NVFP4_GEMM=fused`), which never materialize Ŵ, win only at M ≤ 16 and run at
  18-51 % of cuBLAS from M = 256 on (kernels/nvfp4/NOTES.md). `DequantPrefetch` (below)
  makes the next decoder layer's Ŵ on a side stream;
* on Hopper with `QERL_NVFP4_GEMM=wgmma` (or `auto` once AUTO_WGMMA is set): the wgmma kernel of
  `kernels/nvfp4/wgmma_gemm.py` (decodes into shared memory, never writes Ŵ to HBM) for the
  learner's M ≥ 64 rows on whole tiles, dequantize + cuBLAS elsewhere (`_Wgmma`). Correct, but
  on an H100 its warp-specialized kernel runs at 72-79 % of cuBLAS and one 7B layer's fwd + dX
  takes 28.3 ms against 22.4 ms with dequantize + cuBLAS (NOTES.md, 2026-12-07), so `auto` does
  not take it;
* on Hopper with `QERL_NVFP4_GEMM=swap`: the forward by `kernels/nvfp4/swap_gemm.py` (the weight
  as wgmma's register operand), dX by dequantize + cuBLAS (`_Swap`); per GEMM slower than
  dequantize + cuBLAS on the learner's shapes (H200), so opt-in only;
* otherwise the reference: dequantize to the activation dtype (`dequantize` here: a
  byte-table lookup bit-identical to `reference.dequantize`, i.e. to compressed-tensors'
  decompression for bf16, ~3x faster on CPU) and a dense matmul; Ŵ lives only for the
  duration of the call.

PEFT: the layer deliberately has no `.weight` attribute (anything that touches `.weight`
would otherwise silently get a dense copy). `qweight` names the packed tensor, the
convention PEFT uses to find a quantized layer's device; `dequantize_weight()` is the
explicit way to obtain Ŵ. The LoRA wrapper lives in `components.train.model`.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from functools import lru_cache

import torch
from torch import Tensor, nn

from . import reference
from .reference import BLOCK

log = logging.getLogger(__name__)

__all__ = ["NVFP4Linear", "W4A16Function", "DequantPrefetch", "dequantize", "linear_w4a16", "grad_input_w4a16", "backend_name"]


# ----------------------------------------------------------------------------- backends

@lru_cache(maxsize=1)
def _fused():
    """The fused Triton module `kernels.nvfp4.gemm`, or None when it is absent/unimportable."""
    if importlib.util.find_spec(f"{__package__}.gemm") is None:
        return None
    try:
        return importlib.import_module(f"{__package__}.gemm")
    except Exception as e:  # noqa: BLE001 - a broken optional kernel must not kill training
        log.warning("kernels.nvfp4.gemm exists but does not import (%s: %s); using the "
                    "dequantize + matmul reference", type(e).__name__, e)
        return None


@lru_cache(maxsize=8)
def _byte_table(device: torch.device) -> Tensor:
    """float32 [256, 2]: the two E2M1 values of every packed byte (low nibble first)."""
    codes = torch.arange(256, device=device, dtype=torch.uint8)
    return torch.stack((reference.e2m1_values(codes & 0xF), reference.e2m1_values(codes >> 4)), -1).contiguous()


def dequantize(packed: Tensor, scale: Tensor, gscale: Tensor, dtype: torch.dtype) -> Tensor:
    """`reference.dequantize`, bit for bit, ~3x faster: one byte-table lookup instead of unpack,
    decode and select (same float32 product E2M1 * (s / g), rounded once to `dtype`)."""
    out, half = packed.shape
    inn = half * 2
    if tuple(scale.shape) != (out, inn // BLOCK):
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not fit weight_packed {tuple(packed.shape)}")
    vals = torch.nn.functional.embedding(packed.int(), _byte_table(packed.device)).view(out, inn // BLOCK, BLOCK)
    s_eff = scale.to(torch.float32) / gscale.to(torch.float32).reshape(1)
    return (vals * s_eff.unsqueeze(-1)).view(out, inn).to(dtype)


class _Reference:
    """Dequantize to the activation dtype, then a dense matmul (CPU, or no fused kernel).
    Ŵ exists only for the duration of one call."""

    name = "reference"
    dequantize = staticmethod(dequantize)


class _DequantCuBLAS:
    """CUDA: Triton dequantize into a transient bf16 Ŵ (one layer at a time), then cuBLAS."""

    name = "dequant+cublas"

    @staticmethod
    def dequantize(packed: Tensor, scale: Tensor, gscale: Tensor, dtype: torch.dtype) -> Tensor:
        from . import triton_kernels
        return triton_kernels.dequantize(packed, scale, gscale, dtype)

    # the fallbacks of the fused backends below, where their kernels do not fit
    @staticmethod
    def linear(x2: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, bias: Tensor | None) -> Tensor:
        w = _DequantCuBLAS.dequantize(packed, scale, gscale, x2.dtype)
        return x2 @ w.t() if bias is None else torch.addmm(bias, x2, w.t())

    @staticmethod
    def grad_input(dy2: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor) -> Tensor:
        return dy2 @ _DequantCuBLAS.dequantize(packed, scale, gscale, dy2.dtype)


class _Wgmma:
    """Hopper: the wgmma kernel of `wgmma_gemm` (decode into shared memory, async wgmma; Ŵ never
    in HBM) wherever `gemm._wgmma_fits` (≥ MIN_M rows, whole tiles), else dequantize + cuBLAS."""

    name = "wgmma"
    MIN_M = 64
    CONFIG = {"WGMMA": True, "WARP_SPECIALIZE": True}  # the warp-specialized kernel, WS_CONFIG's tile

    @staticmethod
    def linear_w4a16(x2: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, bias: Tensor | None) -> Tensor:
        gemm = _fused()
        if gemm._wgmma_fits(x2, x2.shape[0], packed.shape[0], x2.shape[1], False, gscale.reshape(-1), _Wgmma.MIN_M):
            return gemm.linear_w4a16(x2, packed, scale, gscale, bias, _config=_Wgmma.CONFIG)
        return _DequantCuBLAS.linear(x2, packed, scale, gscale, bias)

    @staticmethod
    def grad_input_w4a16(dy2: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor) -> Tensor:
        gemm = _fused()
        if gemm._wgmma_fits(dy2, dy2.shape[0], packed.shape[1] * 2, dy2.shape[1], True, gscale.reshape(-1),
                            _Wgmma.MIN_M):
            return gemm.grad_input_w4a16(dy2, packed, scale, gscale, _config=_Wgmma.CONFIG)
        return _DequantCuBLAS.grad_input(dy2, packed, scale, gscale)


class _Swap:
    """Hopper: the forward by `swap_gemm` (the weight decoded into wgmma's register operand, Ŵ
    never in HBM) wherever its tiles fit, dX by dequantize + cuBLAS (the swap kernel has no dX
    yet). Not chosen by 'auto': on an H200 it runs at 68-71 % of cuBLAS on the learner's shapes,
    slower than dequantize + cuBLAS (NOTES.md, 2026-12-07, third session)."""

    name = "swap"

    @staticmethod
    def linear_w4a16(x2: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, bias: Tensor | None) -> Tensor:
        from . import swap_gemm
        if swap_gemm.AVAILABLE and swap_gemm.supports(x2.shape[0], packed.shape[0], x2.shape[1]) \
                and x2.stride(1) == 1 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 \
                and scale.stride(0) % 4 == 0 and scale.data_ptr() % 4 == 0:
            return swap_gemm.linear_swap(x2, packed, scale, gscale, bias)
        return _DequantCuBLAS.linear(x2, packed, scale, gscale, bias)

    @staticmethod
    def grad_input_w4a16(dy2: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor) -> Tensor:
        return _DequantCuBLAS.grad_input(dy2, packed, scale, gscale)


# Whether 'auto' takes `_Wgmma` on Hopper GPUs (else dequant+cuBLAS everywhere on CUDA). Off: on an
# H100 a 7B layer's fwd + dX GEMMs at 16,384 rows take 28.3 ms with it, 22.4 ms with dequant+cuBLAS
# (NOTES.md, 2026-12-07).
AUTO_WGMMA = False


def _backend(x: Tensor):
    """THE choice of GEMM implementation. QERL_NVFP4_GEMM: 'auto' (default: on Hopper GPUs
    `_Wgmma` when AUTO_WGMMA, else dequant+cublas for bf16 CUDA activations; the reference
    otherwise), 'wgmma' (`_Wgmma` on a Hopper GPU), 'swap' (`_Swap` on a Hopper GPU), 'dequant'
    (dequant+cublas on CUDA), 'fused' (the fused Triton kernels of kernels/nvfp4/gemm.py, for bf16
    activations on CUDA, or on the CPU under TRITON_INTERPRET=1, which tests use), 'reference'
    (byte-table dequantize + matmul; debugging, A/B)."""
    return _backend_for(x.device, x.dtype)


def _backend_for(device: torch.device, dtype: torch.dtype):
    choice = os.environ.get("QERL_NVFP4_GEMM", "auto")
    if choice not in ("auto", "wgmma", "swap", "dequant", "fused", "reference"):
        raise ValueError(f"QERL_NVFP4_GEMM must be auto, wgmma, swap, dequant, fused or reference, not {choice!r}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if choice == "fused" and dtype == torch.bfloat16 and (device.type == "cuda" or interpreted):
        fused = _fused()
        if fused is not None:
            return fused
    cuda_bf16 = device.type == "cuda" and dtype == torch.bfloat16
    if (choice == "wgmma" or choice == "auto" and AUTO_WGMMA) and cuda_bf16 and _fused() is not None \
            and torch.cuda.get_device_capability(device)[0] == 9:
        return _Wgmma
    if choice == "swap" and cuda_bf16 and _fused() is not None and torch.cuda.get_device_capability(device)[0] == 9:
        return _Swap
    if cuda_bf16 and choice != "reference":
        return _DequantCuBLAS
    return _Reference


def backend_name(x: Tensor) -> str:
    b = _backend(x)
    return getattr(b, "name", "fused-triton")


def _linear(x: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, bias: Tensor | None,
            keep: bool, w: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(x @ Ŵᵀ + bias, Ŵ when `keep` and the backend materializes it, else None).
    `w`: Ŵ already dequantized (by `DequantPrefetch`), used when the backend dequantizes."""
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
    backend = _backend(x)
    if bias is not None:
        bias = bias.to(x.dtype)
    if hasattr(backend, "dequantize"):
        if w is None or w.dtype != x.dtype:
            w = backend.dequantize(packed, scale, gscale, x.dtype)
        y = x2 @ w.t() if bias is None else torch.addmm(bias, x2, w.t())
    else:
        y = backend.linear_w4a16(x2, packed, scale, gscale, bias)
    return y.reshape(*lead, y.shape[-1]), (w if keep else None)


def linear_w4a16(x: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., in] @ Ŵᵀ (+ bias) -> [..., out] (no autograd; see `W4A16Function`)."""
    return _linear(x, packed, scale, gscale, bias, keep=False)[0]


def grad_input_w4a16(dy: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, w: Tensor | None = None) -> Tensor:
    """dy [..., out] @ Ŵ -> [..., in]; `w`: Ŵ already dequantized (else it is made here)."""
    lead, dy2 = dy.shape[:-1], dy.reshape(-1, dy.shape[-1])
    if w is None:
        backend = _backend(dy)
        if not hasattr(backend, "dequantize"):
            dx = backend.grad_input_w4a16(dy2, packed, scale, gscale)
            return dx.reshape(*lead, dx.shape[-1])
        w = backend.dequantize(packed, scale, gscale, dy.dtype)
    dx = dy2 @ w
    return dx.reshape(*lead, dx.shape[-1])


class W4A16Function(torch.autograd.Function):
    """Y = X·Ŵᵀ (+ bias) with a frozen NVFP4 Ŵ: backward returns dX = dY·Ŵ only.

    keep_weight=True saves the dequantized Ŵ for backward instead of dequantizing it again
    there (see `NVFP4Linear.keep_dequantized` for when that is cheap)."""

    @staticmethod
    def forward(ctx, x: Tensor, packed: Tensor, scale: Tensor, gscale: Tensor, bias: Tensor | None,
                keep_weight: bool, w: Tensor | None = None) -> Tensor:
        y, w = _linear(x, packed, scale, gscale, bias, keep_weight, w)
        ctx.save_for_backward(packed, scale, gscale, w)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        packed, scale, gscale, w = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = grad_input_w4a16(dy.contiguous(), packed, scale, gscale, w)
        return dx, None, None, None, None, None, None


# ----------------------------------------------------------------------------- the module

class NVFP4Linear(nn.Module):
    """A frozen Linear whose weight is NVFP4 (compressed-tensors `nvfp4-pack-quantized`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"NVFP4Linear needs in_features divisible by {BLOCK}, got {in_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.act_dtype = dtype  # not `compute_dtype`: PEFT would cast adapters to it
        # Keep the forward's dequantized Ŵ for backward (one dequantize fewer per call). Only
        # for layers inside a gradient-checkpointed block (build_policy sets it): there the
        # first forward keeps no saved tensors and the recomputation keeps them only until
        # that block's backward, so this holds one decoder layer's bf16 weights at a time.
        # Without checkpointing it would hold the whole model in bf16.
        self.keep_dequantized = False
        self.prefetched: Tensor | None = None  # Ŵ made ahead by DequantPrefetch; used once
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_checkpoint_tensors(cls, weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor,
                                bias: Tensor | None = None, *, dtype: torch.dtype = torch.bfloat16,
                                name: str = "layer") -> "NVFP4Linear":
        """Build from the three checkpoint tensors (+ bias), checking dtypes and shapes."""
        if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
            raise ValueError(f"{name}.weight_packed must be uint8 [out, in/2], got "
                             f"{weight_packed.dtype} {tuple(weight_packed.shape)}")
        out, half = weight_packed.shape
        inn = half * 2
        if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (out, inn // BLOCK):
            raise ValueError(f"{name}.weight_scale must be float8_e4m3fn {(out, inn // BLOCK)}, got "
                             f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
        g = reference.check_global_scale(weight_global_scale)
        if bias is not None and tuple(bias.shape) != (out,):
            raise ValueError(f"{name}.bias must be [{out}], got {tuple(bias.shape)}")
        mod = cls(inn, out, bias=bias is not None, device="meta", dtype=dtype)
        mod.weight_packed = weight_packed.contiguous()
        mod.weight_scale = weight_scale.contiguous()
        mod.weight_global_scale = g.to(weight_packed.device).contiguous()
        if bias is not None:
            mod.bias = bias.to(dtype).contiguous()
        return mod

    @property
    def qweight(self) -> Tensor:
        """The packed weight (PEFT reads `qweight` to place adapters next to quantized layers)."""
        return self.weight_packed

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """Ŵ [out, in], materialized (tests, merging, export)."""
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale,
                          dtype or self.act_dtype)

    def forward(self, x: Tensor) -> Tensor:
        w, self.prefetched = self.prefetched, None
        return W4A16Function.apply(x, self.weight_packed, self.weight_scale, self.weight_global_scale,
                                   self.bias, self.keep_dequantized, w)

    def nbytes(self) -> int:
        """Bytes held by the frozen weight (packed codes + scales + global scale + bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=nvfp4-pack-quantized, frozen")


# ----------------------------------------------------------------------------- prefetch

class DequantPrefetch:
    """Dequantize the next decoder layer's NVFP4 weights while the current layer computes.

    Each decoder layer gets a forward pre-hook. When layer i starts, the Ŵ made ahead for it
    (if the guess was right) is handed to its NVFP4Linear modules, and the dequantize of the
    layer expected next is issued: i + 1 while the layers come in order (a forward pass), i - 1
    when they come backwards (gradient checkpointing recomputes them during backward, last
    layer first), i itself at either end (with checkpointing the last layer's recomputation
    follows its forward, and the next micro-batch starts where the recomputation ended); a
    jump of more than one layer starts a new sweep. On CUDA that work runs on a side stream,
    so the memory-bound dequantize can overlap the current layer's kernels instead of
    following them; the main stream waits on an event before the first use. Elsewhere it
    would run inline and change nothing, so `for_layers` attaches it off CUDA only when asked
    (`inline=True`, tests). Measured on an H200 (7B, checkpointing): it hides only part of the
    ~58 ms of dequantize per step, because cuBLAS's GEMMs leave no SM free to share.

    Cost: one more decoder layer of bf16 weights alive at a time (0.47 GB at Qwen2.5-7B).
    Correctness does not depend on the guess: the base is frozen, so a Ŵ made for a module is
    its Ŵ whenever it is used, and a wrong guess only means that layer dequantizes inline.
    Only for backends that dequantize (dequant+cuBLAS, reference); `for_layers` returns None
    for the fused kernels, which never materialize Ŵ."""

    def __init__(self, layers: list[list[NVFP4Linear]], device: torch.device, backend):
        self.layers, self.backend = layers, backend
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last: int | None = None  # the layer entered last, and which way the layers go
        self.direction = 1
        self.pending: tuple[int, list[tuple[NVFP4Linear, Tensor]], object] | None = None
        self.hits = self.issued = 0
        self.handles: list = []

    @classmethod
    def for_layers(cls, decoder_layers, *, inline: bool = False) -> "DequantPrefetch | None":
        """Attach to an iterable of decoder-layer modules (e.g. `model.model.layers`); None
        when they hold no NVFP4Linear, are not on CUDA (unless `inline`) or the backend does
        not dequantize."""
        decoder_layers = list(decoder_layers)
        layers = [[m for m in layer.modules() if isinstance(m, NVFP4Linear)] for layer in decoder_layers]
        if not any(layers):
            return None
        first = next(m for group in layers for m in group)
        device = first.weight_packed.device
        backend = _backend_for(device, first.act_dtype)
        if (device.type != "cuda" and not inline) or not hasattr(backend, "dequantize"):
            return None
        self = cls(layers, device, backend)
        for i, layer in enumerate(decoder_layers):
            self.handles.append(layer.register_forward_pre_hook(
                lambda _mod, _args, i=i: self._enter(i)))
        return self

    def _enter(self, i: int) -> None:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == i:
            _, made, event = pending
            if self.stream is not None:
                main = torch.cuda.current_stream(self.stream.device)
                main.wait_event(event)
                for _, w in made:
                    w.record_stream(main)  # made on the side stream, used (and freed) on main
            for mod, w in made:
                mod.prefetched = w
            self.hits += 1
        n = len(self.layers)
        if self.last is None or abs(i - self.last) > 1:  # a new sweep: up from the first layer
            self.direction = 1 if i < n / 2 else -1
        elif i == self.last:  # the sweep turned at an end (checkpointing recomputes that layer)
            self.direction = -self.direction
        else:
            self.direction = 1 if i > self.last else -1
        nxt = i + self.direction if 0 <= i + self.direction < n else i
        self.last = i
        if self.layers[nxt]:
            self.pending = (nxt, *self._make(self.layers[nxt]))
            self.issued += 1

    def _make(self, mods: list[NVFP4Linear]):
        def run():
            return [(m, self.backend.dequantize(m.weight_packed, m.weight_scale, m.weight_global_scale,
                                                m.act_dtype)) for m in mods]
        if self.stream is None:
            return run(), None
        with torch.cuda.stream(self.stream):
            made = run()
            event = torch.cuda.Event()
            event.record(self.stream)
        return made, event

    def remove(self) -> None:
        """Detach the hooks and drop anything made ahead."""
        for h in self.handles:
            h.remove()
        self.handles, self.pending, self.last = [], None, None
        for group in self.layers:
            for m in group:
                m.prefetched = None
