"""Which kernel serves the NVFP4 Linear layers during rollouts, chosen from measurements.

Backends (all serve the same weights: the NVFP4 checkpoint's dequantized values):

* ``marlin``  – vLLM's MarlinNvFp4LinearKernel (W4A16, reads 4-bit weights; vLLM's default);
* ``humming`` – vLLM's Humming W4A16 kernel (``linear_backend="humming"``);
* ``dequant`` – the project's dequantize-once kernel (`kernels/vllm_nvfp4_dequant.py`): the
  weights are expanded to bf16 once at load and served by cuBLAS. Fastest at large batches,
  costs the bf16 weight memory (the packed tensors are freed once dequantized). The only
  backend on CPUs.
* ``fused``   – the project's own W4A16 Triton GEMMs on the packed weights
  (`kernels/nvfp4/serving.py`: a GEMV for one sequence, the split-K tensor-core kernel up to
  64 rows, 128 on the 7B gate_up and down shapes, dequantize + cuBLAS above). On the H200 it was
  measured at 1 and 16 sequences only, where it is the fastest NVFP4 backend since the word
  decode (232 / 3,418 tok/s vs Marlin's 227 / 3,094); on the H100 at 1-256 sequences, before the
  tensor-core kernel served more than 32 rows (backend_throughput.json).

``auto`` picks from the measured table `backend_throughput.json` (written by
``benchmarks/rollout.py --write-table``; one table per GPU model, the one of this GPU if it was
measured, else the first, with a note in the reason), at the nearest measured concurrency (log scale) to
the task's sequences in flight. When the stage says how many tokens it will generate at most
and the table has every backend's engine start time, it takes the backend with the shortest
expected stage time, start + tokens / (tokens/s): each stage run starts its own engine, and
on the H200 Humming's start took 105 s longer than Marlin's, more than its higher throughput
gives back on a rollout of a few million tokens. Otherwise it takes the most tokens/s.
No GPU imports here: the pipeline and tests read this module.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from components.common.cli import ConfigError

NVFP4_BACKENDS = ("marlin", "humming", "dequant", "fused")
CHOICES = ("auto",) + NVFP4_BACKENDS
TABLE_PATH = Path(__file__).with_name("backend_throughput.json")


def load_tables(path: Path = TABLE_PATH) -> list[dict]:
    """Every measured table in the file, one per GPU model (`{"tables": [...]}`; a file holding
    one table at the top level is read as that one); [] if there is no file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ConfigError(f"backend table {path} is unreadable: {e}") from e
    tables = data["tables"] if isinstance(data, dict) and "tables" in data else [data]
    if not isinstance(tables, list) or not all(isinstance(t, dict) and isinstance(t.get("tokens_per_second"), dict)
                                               for t in tables):
        raise ConfigError(f"backend table {path} has a table without a 'tokens_per_second' mapping")
    return tables


def _gpu_of(table: dict) -> str:
    """The GPU model a table was measured on (older tables name it first in `measured_on`)."""
    return table.get("gpu") or str(table.get("measured_on", "")).split(",")[0]


def load_table(path: Path = TABLE_PATH, gpu_name: str = "") -> dict | None:
    """The measured table for this GPU model (its `gpu` is `gpu_name`), else the first in the
    file (choose_backend then says it was measured on other hardware); None if there is none."""
    tables = load_tables(path)
    same = [t for t in tables if gpu_name and _gpu_of(t) == gpu_name]
    return (same or tables or [None])[0]


def merge_table(path: Path, table: dict) -> list[dict]:
    """Write the figures of `table` into the file at `path`: into the table of the same GPU model
    (`gpu`) if there is one, where each backend's measured concurrencies, engine start and LoRA
    kernel settings replace the old ones and everything else stays (its `measured_on` gets
    this run's appended); tables of other GPUs stay as they are. Returns what the file holds."""
    tables, gpu = load_tables(path), _gpu_of(table)
    old = next((t for t in tables if _gpu_of(t) == gpu), None)
    if old is not None:
        merged = {**old, "gpu": gpu, "measured_on": f"{old.get('measured_on', '?')}; then "
                  f"{', '.join(sorted(table['tokens_per_second']))}: {table.get('measured_on', '?')}"}
        for key in ("tokens_per_second", "engine_start_s", "lora_kernels"):
            merged[key] = dict(old.get(key) or {})
        for b, tps in table["tokens_per_second"].items():
            merged["tokens_per_second"][b] = {**merged["tokens_per_second"].get(b, {}), **tps}
            for key in ("engine_start_s", "lora_kernels"):
                if b in (table.get(key) or {}):
                    merged[key][b] = table[key][b]
        table = merged
    tables = [t for t in tables if _gpu_of(t) != gpu] + [table]
    Path(path).write_text(json.dumps({"tables": tables}, indent=1) + "\n")
    return tables


def _nearest(measured: list[int], concurrency: int) -> int:
    return min(measured, key=lambda c: (round(abs(math.log(c) - math.log(max(concurrency, 1))), 9), c))


def choose_backend(requested: str, concurrency: int, cuda: bool, table: dict | None,
                   gpu_name: str = "", tokens: int | None = None) -> tuple[str, str]:
    """(backend, reason): the backend to serve NVFP4 with and a sentence saying why.

    tokens: the most output tokens the stage will generate (prompts × samples × max tokens);
    with it, and engine start times in the table, the expected stage time decides."""
    if requested not in CHOICES:
        raise ConfigError(f"nvfp4 backend must be one of {', '.join(CHOICES)}, not {requested!r}")
    if not cuda:
        if requested not in ("auto", "dequant"):
            raise ConfigError(f"nvfp4 backend {requested!r} needs a CUDA GPU; on CPU only 'dequant' exists")
        return "dequant", "CPU: the dequantize-once plugin is the only NVFP4 kernel"
    if requested != "auto":
        return requested, "requested"
    if table is None:
        return "marlin", "no measured table (run benchmarks/rollout.py --write-table): vLLM's default"
    tps = table["tokens_per_second"]
    rows = {b: {int(c): float(v) for c, v in tps.get(b, {}).items() if v} for b in NVFP4_BACKENDS}
    measured = sorted({c for r in rows.values() for c in r})
    if not measured:
        return "marlin", "the measured table has no NVFP4 rows: vLLM's default"
    at = _nearest(measured, concurrency)
    rates = {b: r[at] for b, r in rows.items() if at in r}
    where = table.get("measured_on", "?")
    same = _gpu_of(table) == gpu_name
    note = "" if not gpu_name or same else f"; measured on other hardware than this {gpu_name}"
    bf16 = tps.get("bf16", {}).get(str(at))
    starts = table.get("engine_start_s") or {}
    if tokens and all(isinstance(starts.get(b), (int, float)) for b in rates):
        secs = {b: float(starts[b]) + tokens / v for b, v in rates.items()}
        best = min(secs, key=secs.get)
        others = ", ".join(f"{b} {v:,.0f} s" for b, v in sorted(secs.items(), key=lambda kv: kv[1]) if b != best)
        return best, (f"{best}: about {secs[best]:,.0f} s for up to {tokens:,} tokens (engine start "
                      f"{float(starts[best]):,.0f} s + {rates[best]:,.0f} tok/s) vs {others or 'nothing else'}, "
                      f"at concurrency {at} (nearest measured to {concurrency}; {where}){note}")
    best = max(rates, key=rates.get)
    others = ", ".join(f"{b} {v:,.0f}" for b, v in sorted(rates.items(), key=lambda kv: -kv[1]) if b != best)
    vs = f", bf16 {float(bf16):,.0f}" if bf16 else ""
    return best, (f"{best}: {rates[best]:,.0f} output tok/s vs {others or 'nothing else'}{vs} at concurrency "
                  f"{at} (nearest measured to {concurrency}; {where}){note}")


LORA_KERNELS = {"vllm": "0", "expand": "expand", "fused": "1"}  # -> QERL_NVFP4_LORA_EPILOGUE


def engine_settings(backend: str, lora_kernels: str | None = None) -> tuple[dict, dict]:
    """(extra vLLM LLM kwargs, environment variables) that select `backend`, and for the fused
    backend where its layers' LoRA runs (`lora_kernels`, one of LORA_KERNELS; None leaves
    QERL_NVFP4_LORA_EPILOGUE as the environment has it)."""
    if lora_kernels is not None and lora_kernels not in LORA_KERNELS:
        raise ConfigError(f"nvfp4 LoRA kernels must be one of {', '.join(LORA_KERNELS)}, not {lora_kernels!r}")
    if backend == "humming":
        return {"linear_backend": "humming"}, {"QERL_NVFP4_BACKEND": ""}
    if backend == "dequant":
        # vLLM's torch.compile (AOT) cache key does not see which kernel the plugin chose: a
        # graph compiled for one backend was loaded for the other and failed (seen with vLLM
        # 0.26: KeyError 'qerl_weight_dequant' under marlin). The dequant engine neither
        # loads nor saves compiled graphs, so each backend only ever sees its own.
        return {}, {"QERL_NVFP4_BACKEND": "dequant", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    if backend == "fused":  # same compile-cache caveat as dequant
        env = {"QERL_NVFP4_BACKEND": "fused", "VLLM_DISABLE_COMPILE_CACHE": "1"}
        if lora_kernels is not None:
            env["QERL_NVFP4_LORA_EPILOGUE"] = LORA_KERNELS[lora_kernels]
        return {}, env
    if backend == "marlin":  # vLLM 0.26 forces Marlin for W4A16 under linear_backend=auto
        return {}, {"QERL_NVFP4_BACKEND": ""}
    raise ConfigError(f"unknown nvfp4 backend {backend!r}")
