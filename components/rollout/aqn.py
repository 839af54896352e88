"""Adaptive Quantization Noise (QeRL §3.3, Eq. 7-10).

QeRL adds Gaussian noise Z ~ N(0, σ²) to the weight of every decoder layer's RMSNorm that
feeds a quantized projection: `input_layernorm` (→ q/k/v) and `post_attention_layernorm`
(→ gate/up). Since RMSNorm(x)·(w + Z) then multiplies each input channel of the next
Linear by (1 + Z/w), the noise acts on those weights row-wise and multiplicatively, at no
cost to the packed 4-bit weights. o_proj, down_proj and the final norm see no noise.

The noise is applied to vLLM's own RMSNorm modules inside the engine (QeRL's released code
matched transformers' RMSNorm classes and so never reached the rollout engine), resampled
from a saved clean copy on every call (never accumulated), and seeded.

`sigma_schedule` is the one schedule the pipeline uses: the run is split into K stages,
stage 0 is noise-free, stages 1..K-1 decay exponentially from σ_start to σ_end (Eq. 8).
This module imports torch only inside `apply_noise`: the pipeline imports the schedule.
"""
from __future__ import annotations

import math
import re

NOISY_NORMS = ("input_layernorm", "post_attention_layernorm")
SIGMA_START, SIGMA_END, STAGES = 1e-2, 5e-4, 10


def sigma_schedule(iteration: int, iterations: int, sigma_start: float = SIGMA_START,
                   sigma_end: float = SIGMA_END, stages: int = STAGES) -> float:
    """σ for `iteration` (0-based) of a run of `iterations`, split into `stages` stages.

    Stage of an iteration: floor(iteration · K / iterations). Stage 0 → 0 (no noise);
    stage s ≥ 1 → σ_start · (σ_end/σ_start)^((s-1)/(K-2)), so stage 1 has σ_start and stage
    K-1 has σ_end. With K = 2 the single noisy stage uses σ_start.
    """
    if iterations < 1 or not 0 <= iteration < iterations:
        raise ValueError(f"iteration {iteration} is outside a run of {iterations} iteration(s)")
    if stages < 1:
        raise ValueError(f"AQN needs at least 1 stage, got {stages}")
    if not (sigma_start >= 0 and sigma_end >= 0 and math.isfinite(sigma_start) and math.isfinite(sigma_end)):
        raise ValueError(f"AQN sigmas must be finite and >= 0, got {sigma_start}, {sigma_end}")
    stage = iteration * stages // iterations
    if stage == 0:
        return 0.0
    if stages <= 2 or sigma_start == 0 or sigma_end == 0:
        return sigma_start if stage == 1 or stages <= 2 else sigma_end
    return sigma_start * (sigma_end / sigma_start) ** ((stage - 1) / (stages - 2))


_DECODER_NORM = re.compile(r"(^|\.)layers\.\d+\.(" + "|".join(NOISY_NORMS) + r")$")


def noisy_norms(model) -> list:
    """(name, module) of every decoder-layer RMSNorm that AQN perturbs: `layers.N.input_layernorm`
    and `layers.N.post_attention_layernorm` of the language model (a multimodal model's vision
    tower is left alone), RMSNorm modules only (vLLM's, or transformers' *RMSNorm classes)."""
    lm = model.get_language_model() if callable(getattr(model, "get_language_model", None)) else model
    return [(name, m) for name, m in lm.named_modules()
            if _DECODER_NORM.search(name) and "RMSNorm" in type(m).__name__
            and getattr(m, "weight", None) is not None]


def apply_noise(model, sigma: float, seed: int) -> int:
    """Set each noisy norm's weight to clean + N(0, σ²) (σ = 0 restores the clean weight).

    The clean weight is saved on the module the first time. Returns the number of modules
    changed. Works on any torch model; the rollout engine calls it through vLLM's
    `LLM.apply_model`, so it reaches vLLM's own RMSNorm modules.
    """
    import torch

    norms = noisy_norms(model)
    if not norms:
        raise RuntimeError("AQN found no input_layernorm / post_attention_layernorm modules in the model")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        for _, m in norms:
            if not hasattr(m, "_qerl_clean_weight"):
                m._qerl_clean_weight = m.weight.detach().clone()
            clean = m._qerl_clean_weight
            if sigma == 0:
                m.weight.copy_(clean)
            else:
                z = torch.randn(clean.shape, generator=gen, dtype=torch.float32) * sigma
                m.weight.copy_((clean.float() + z.to(clean.device)).to(clean.dtype))
    return len(norms)
