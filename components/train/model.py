"""The learner: a frozen NVFP4 base with a trainable PEFT LoRA adapter, and its log-probs.

Loading (`load_base`): the transformers model is built from the checkpoint's config on the
meta device (no weight memory), then filled from the safetensors shards:

* every Linear whose checkpoint holds `<name>.weight_packed` becomes a frozen
  `kernels.nvfp4.linear.NVFP4Linear` holding the packed tensors as they are (~0.56 B/param);
* everything else (embeddings, norms, lm_head or its tie, unquantized Linears listed in the
  quantization `ignore`) is loaded as is, in the model dtype (`base_dtype`: bf16, or float32
  on a CPU without native bf16 matmuls);
* non-persistent buffers (RoPE inverse frequencies) are rebuilt on the target device.

PEFT (`attach_lora`): peft 0.21's `LoraConfig._register_custom_module` maps NVFP4Linear to
`LoraNVFP4Linear`, a subclass of PEFT's own `lora.Linear` that only says where the in/out
features are and refuses to merge into a 4-bit weight. The adapter therefore has exactly the
structure PEFT builds for a bf16 Linear: same parameter names, `adapter_config.json` with
plain `target_modules`, `adapter_model.safetensors` with keys
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`: a standard adapter that
plain PEFT loads on the bf16 base and vLLM loads through a LoRARequest. LoRA weights stay
float32 (the optimizer's master weights); the base runs in bf16 (float32 on CPUs where bf16
matmuls are emulated, see `base_dtype`).

`logprobs`: the per-token log-probs of given tokens, memory-frugal: the lm_head runs only on
completion positions, in chunks, each chunk re-computed in backward (never a [B, T, V]
float32 tensor, and at most one chunk's logits alive at a time).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from components.common.cli import ConfigError
from components.common.compute import compute_dtype
from kernels.nvfp4.linear import NVFP4Linear

log = logging.getLogger("qerl.train.model")

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NVFP4_FORMAT = "nvfp4-pack-quantized"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


# ----------------------------------------------------------------------------- base model

def _tensor_index(ckpt: Path) -> dict[str, Path]:
    """tensor name -> shard file."""
    index = sorted(ckpt.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {name: ckpt / shard for name, shard in weight_map.items()}
    from safetensors import safe_open
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: shard for k in f.keys()})
    return out


def checkpoint_config(ckpt: Path):
    """The HF config of a checkpoint dir, checked to be NVFP4 (or unquantized)."""
    from transformers import AutoConfig

    if not (ckpt / "config.json").is_file():
        raise ConfigError(f"{ckpt} is not an HF checkpoint: no config.json")
    if not list(ckpt.glob("*.safetensors")):
        raise ConfigError(f"{ckpt} is not a safetensors checkpoint: no *.safetensors files")
    raw = json.loads((ckpt / "config.json").read_text())
    qc = raw.get("quantization_config")
    if qc and qc.get("format") != NVFP4_FORMAT:
        raise ConfigError(f"{ckpt}: quantization format {qc.get('format')!r} ({qc.get('quant_method')}) is not "
                          f"supported by the learner; expected compressed-tensors {NVFP4_FORMAT!r}")
    config = AutoConfig.from_pretrained(str(ckpt))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the HF quantizer must not touch the meta-built model
    return config


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def base_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype the frozen base computes in: bf16, or float32 on a CPU without native bf16
    matmuls (`components.common.compute`)."""
    return getattr(torch, compute_dtype(torch.device(device).type))


def load_base(ckpt: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """A frozen transformers causal LM from an NVFP4 (or plain) safetensors checkpoint dir, in
    `dtype` (default `base_dtype(device)`)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckpt = Path(ckpt)
    device = torch.device(device)
    dtype = base_dtype(device) if dtype is None else dtype
    config = checkpoint_config(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    index = _tensor_index(ckpt)
    handles: dict[Path, object] = {}

    def get(name: str) -> Tensor:
        shard = index[name]
        if shard not in handles:
            handles[shard] = safe_open(str(shard), "pt", device=str(device))
        return handles[shard].get_tensor(name)

    n_quant = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.weight_packed" in index:
            bias = get(f"{name}.bias") if mod.bias is not None and f"{name}.bias" in index else None
            try:
                q = NVFP4Linear.from_checkpoint_tensors(
                    get(f"{name}.weight_packed"), get(f"{name}.weight_scale"),
                    get(f"{name}.weight_global_scale"), bias, dtype=dtype, name=name)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"{ckpt}: bad NVFP4 tensors for {name}: {e}") from e
            if (q.in_features, q.out_features) != (mod.in_features, mod.out_features):
                raise ConfigError(f"{ckpt}: {name} is [{q.out_features}, {q.in_features}] in the checkpoint, "
                                  f"the config says [{mod.out_features}, {mod.in_features}]")
            _set_module(model, name, q)
            n_quant += 1

    # Everything that is not an NVFP4 buffer: load as stored, cast floating tensors to dtype.
    want = {k: v for k, v in model.state_dict(keep_vars=True).items() if v.is_meta}
    state = {}
    for key, ref in want.items():
        if key in index:
            t = get(key)
            if tuple(t.shape) != tuple(ref.shape):
                raise ConfigError(f"{ckpt}: {key} has shape {tuple(t.shape)}, the config expects {tuple(ref.shape)}")
            state[key] = t.to(dtype) if t.is_floating_point() else t
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight.is_meta:
            out.weight = inp.weight
    # Non-persistent buffers (RoPE inv_freq) were built on meta: rebuild those modules.
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and hasattr(mod, "config"):
            with torch.device(device):
                _set_module(model, name, type(mod)(config=mod.config))
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ConfigError(f"{ckpt}: the checkpoint has no tensor for {len(missing)} model tensor(s), "
                          f"e.g. {', '.join(missing[:3])}")
    model.requires_grad_(False)
    model.config.use_cache = False
    if n_quant == 0:
        log.warning("%s holds no NVFP4 weights: training LoRA on an unquantized base", ckpt)
    log.info("loaded %s: %d NVFP4 Linear layers, %.1f MB of weights on %s", ckpt, n_quant,
             sum(t.numel() * t.element_size() for t in {id(t): t for t in
                 list(model.parameters()) + list(model.buffers())}.values()) / 1e6, device)
    return model


# ----------------------------------------------------------------------------- LoRA

def _lora_layer_cls():
    from peft.tuners.lora.layer import Linear as LoraLinear

    class LoraNVFP4Linear(LoraLinear):
        """PEFT's LoRA Linear around a frozen NVFP4Linear: y = base(x) + B(A(x))·scale."""

        def _get_in_out_features(self, module: nn.Module):
            return module.in_features, module.out_features

        def merge(self, *args, **kwargs) -> None:
            raise NotImplementedError("merging a LoRA adapter into an NVFP4 base is not supported: "
                                      "serve the adapter through LoRA instead")

        def unmerge(self) -> None:
            raise NotImplementedError("an NVFP4 LoRA layer is never merged")

    return LoraNVFP4Linear


_LORA_CLS = None


def lora_nvfp4_cls():
    global _LORA_CLS
    if _LORA_CLS is None:
        _LORA_CLS = _lora_layer_cls()
    return _LORA_CLS


def lora_config(rank: int, alpha: float, dropout: float = 0.0, targets: Sequence[str] = TARGET_MODULES,
                task_type: str | None = "CAUSAL_LM"):
    """A LoraConfig whose custom-module mapping sends NVFP4Linear to LoraNVFP4Linear."""
    from peft import LoraConfig

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                     bias="none", task_type=task_type)
    cfg._register_custom_module({NVFP4Linear: lora_nvfp4_cls()})
    return cfg


def attach_lora(model, rank: int = 32, alpha: float = 64, dropout: float = 0.0,
                targets: Sequence[str] = TARGET_MODULES, base_name: str | None = None):
    """Wrap `model` in a PeftModelForCausalLM with a fresh (B = 0) float32 LoRA adapter."""
    from peft import get_peft_model

    if base_name:
        model.config.name_or_path = base_name  # recorded as base_model_name_or_path
    peft_model = get_peft_model(model, lora_config(rank, alpha, dropout, targets), autocast_adapter_dtype=True)
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return peft_model


def adapter_state(peft_model) -> dict[str, Tensor]:
    """The adapter's tensors under the names PEFT saves them (…q_proj.lora_A.weight)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def read_adapter_config(adapter_dir: Path) -> dict:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file() or not (Path(adapter_dir) / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{adapter_dir} is not a PEFT adapter: need {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r} is not LORA")
    return cfg


def check_adapter_config(acfg: dict, rank: int, alpha: float, targets: Iterable[str], where: str) -> None:
    """ConfigError unless the adapter was trained with this rank, alpha and targets."""
    if acfg.get("r") != rank:
        raise ConfigError(f"{where}: adapter rank mismatch: the adapter has r={acfg.get('r')}, "
                          f"the config asks for lora_rank={rank}")
    if float(acfg.get("lora_alpha", -1)) != float(alpha):
        raise ConfigError(f"{where}: adapter alpha mismatch: the adapter has lora_alpha={acfg.get('lora_alpha')}, "
                          f"the config asks for lora_alpha={alpha}")
    got = acfg.get("target_modules")
    got = sorted([got] if isinstance(got, str) else (got or []))
    if got != sorted(targets):
        raise ConfigError(f"{where}: adapter targets {got} differ from {sorted(targets)}")
    for key in ("use_dora", "use_rslora"):
        if acfg.get(key):
            raise ConfigError(f"{where}: {key} adapters are not supported")
    if acfg.get("modules_to_save"):
        raise ConfigError(f"{where}: adapters with modules_to_save are not supported (vLLM cannot serve them)")


def load_adapter_weights(peft_model, adapter_dir: Path, where: str = "adapter") -> None:
    """Copy a saved adapter's tensors into `peft_model`'s adapter, checking names and shapes."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    want = {k: tuple(v.shape) for k, v in adapter_state(peft_model).items()}
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    if missing or extra:
        raise ConfigError(f"{where} does not fit the base model: "
                          + (f"{len(missing)} tensor(s) missing, e.g. {missing[0]}" if missing else "")
                          + ("; " if missing and extra else "")
                          + (f"{len(extra)} unexpected tensor(s), e.g. {extra[0]}" if extra else ""))
    for k, shape in want.items():
        if tuple(saved[k].shape) != shape:
            raise ConfigError(f"{where} does not fit the base model: {k} has shape {tuple(saved[k].shape)}, "
                              f"the base needs {shape}")
        if not torch.isfinite(saved[k]).all():
            raise ConfigError(f"{where}: {k} has NaN/Inf values")
    result = set_peft_model_state_dict(peft_model, {k: v.float() for k, v in saved.items()})
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"{where}: PEFT did not place {result.unexpected_keys[:3]}")


def save_adapter(peft_model, out_dir: Path) -> None:
    """The standard PEFT adapter: adapter_config.json + adapter_model.safetensors."""
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    readme = Path(out_dir) / "README.md"
    if readme.exists():  # PEFT's model-card boilerplate: not part of the artifact
        readme.unlink()


# ----------------------------------------------------------------------------- log-probs

def _causal_lm(model):
    """The transformers CausalLM inside a (possibly PEFT-wrapped) model."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def _chunk_logp(head: nn.Module, h: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logits = head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, *,
             temperature: float = 1.0, with_entropy: bool = False,
             max_chunk_elements: int = 1 << 25) -> tuple[Tensor, Tensor | None]:
    """log p(token_t | tokens_<t) at every completion position, and optionally the mean entropy.

    Args:
        input_ids, attention_mask: [B, L] right-padded prompt + completion.
        completion_mask: [B, L] 1 at completion tokens (never at position 0).
        temperature: logits are divided by it (match the sampler's logprob convention).
        with_entropy: also return the mean next-token entropy over the completion tokens
            (objective.token_entropy; computed without grad).

    Returns:
        logp [B, L] float32, 0 outside completion_mask (grad flows when enabled), and the
        entropy (0-dim tensor) or None.
    """
    from components.train.objective import token_entropy

    causal = _causal_lm(model)
    backbone, head = causal.get_decoder(), causal.get_output_embeddings()
    sel = completion_mask[:, 1:].to(torch.bool)
    if completion_mask[:, 0].any():
        raise ValueError("completion_mask must be 0 at position 0 (a completion needs a prompt)")
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    h = hidden[:, :-1][sel]                    # [N, H]: the positions that predict a completion token
    targets = input_ids[:, 1:][sel]            # [N]
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    chunk = max(1, max_chunk_elements // max(1, vocab))
    grad = torch.is_grad_enabled() and h.requires_grad
    pieces, ent_sum = [], torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk):
        hc, tc = h[s:s + chunk], targets[s:s + chunk]
        if grad:
            from torch.utils.checkpoint import checkpoint
            pieces.append(checkpoint(_chunk_logp, head, hc, tc, temperature, use_reentrant=False))
            if with_entropy:
                with torch.no_grad():
                    logits = head(hc.detach()).float() / temperature
                    ent_sum += token_entropy(logits[None], torch.ones(1, len(tc), dtype=torch.bool,
                                                                      device=h.device)) * len(tc)
        else:
            logits = head(hc).float()
            if temperature != 1.0:
                logits = logits / temperature
            pieces.append(logits.gather(-1, tc[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1))
            if with_entropy:
                ent_sum += token_entropy(logits[None], torch.ones(1, len(tc), dtype=torch.bool,
                                                                  device=h.device)) * len(tc)
            del logits
    flat = torch.cat(pieces) if pieces else h.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(sel.shape, dtype=torch.float32, device=h.device).masked_scatter(sel, flat)
    out = torch.nn.functional.pad(out, (1, 0))
    entropy = ent_sum / max(1, h.shape[0]) if with_entropy else None
    return out, entropy


@torch.no_grad()
def reference_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                       temperature: float = 1.0) -> Tensor:
    """Log-probs of the reference policy: the same model with the LoRA adapter disabled."""
    with model.disable_adapter():
        lp, _ = logprobs(model, input_ids, attention_mask, completion_mask, temperature=temperature)
    return lp
