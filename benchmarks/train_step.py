"""Benchmark one LoRA learner step of the train stage: NVFP4 base vs BF16 base.

    python benchmarks/train_step.py --shape qwen2.5-7b --seqs 8 --seq-len 2048 [--base both]

Makes random checkpoints of the shape (the bf16 one only when the BF16 base is asked for; the
NVFP4 one directly, layer by layer, so a 32B base fits a 64 GB disk), synthetic rollout and
reward shards (groups of 4 samples with distinct rewards), then runs `python -m components.train`
once per base with gradient checkpointing on and prints the learner's update tokens/s, its
wall time and peak memory (from the stage's metrics).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantize_stage import SHAPES, make_checkpoint, make_in_child, make_nvfp4_checkpoint  # noqa: E402


def make_shards(root: Path, vocab: int, seqs: int, seq_len: int, prompt_len: int = 64) -> tuple[str, str]:
    import random

    from components.common.schemas import REWARDS, ROLLOUTS, to_table, write_ipc
    from components.common.storage import Staging

    rng = random.Random(0)
    rollouts, rewards = [], []
    for i in range(seqs):
        pid, k = f"p{i // 4}", i % 4
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        comp = [rng.randrange(vocab) for _ in range(seq_len - prompt_len)]
        rollouts.append(dict(prompt_id=pid, sample_index=k, prompt_token_ids=prompt, completion_token_ids=comp,
                             completion_logprobs=[-rng.uniform(5, 15) for _ in comp], completion_text="",
                             finish_reason="stop", answer="0", iteration=0, adapter_digest="", aqn_sigma=0.0,
                             aqn_seed=0, sampling_seed=0, max_tokens=seq_len, temperature=1.0, top_p=1.0))
        rewards.append(dict(prompt_id=pid, sample_index=k, reward=float(k), components={"synthetic": float(k)}))
    out = []
    for name, rows, schema, kind in (("rollouts", rollouts, ROLLOUTS, "rollout"), ("rewards", rewards, REWARDS, "reward")):
        uri = str(root / f"{name}-{seqs}x{seq_len}")
        if not (Path(uri) / "MANIFEST.json").exists():
            with Staging() as st:
                (st.path / f"{name}.arrow").write_bytes(write_ipc(to_table(rows, schema)))
                st.publish(uri, stage=kind)
        out.append(uri)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--seqs", type=int, default=8, help="sequences (groups of 4)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (prompt 64 + completion)")
    ap.add_argument("--base", choices=["nvfp4", "bf16", "both"], default="both")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--micro-batch-seqs", type=int, nargs="+", default=[2], metavar="N",
                    help="sequences per forward/backward micro-batch (the stage's micro_batch_tokens = N x seq-len); "
                         "several values: one run per value and base")
    ap.add_argument("--epochs", type=int, default=1, help="optimizer steps over the batch (the first pays one-time costs)")
    ap.add_argument("--cudnn-attention", action="store_true", help="let SDPA use cuDNN attention (the stage's cudnn_attention)")
    ap.add_argument("--dequant-prefetch", choices=["on", "off", "both"], default="on",
                    help="the stage's dequant_prefetch for the NVFP4 base; both: one run each")
    ap.add_argument("--nvfp4-gemm", nargs="+", choices=["auto", "wgmma", "swap", "dequant"], default=["auto"],
                    metavar="BACKEND", help="QERL_NVFP4_GEMM for the NVFP4 base, one run each: auto (the stage's "
                    "default), wgmma (Hopper: the wgmma kernel), swap (Hopper: swap_gemm's forward, dX by dequantize + "
                    "cuBLAS), dequant (dequantize + cuBLAS)")
    ap.add_argument("--auto-gc", action="store_true",
                    help="leave Python's automatic garbage collection on during the update (the stage's manual_gc off)")
    ap.add_argument("--workdir", default="/tmp/qerl-bench")
    ap.add_argument("--json", help="save the figures here")
    ap.add_argument("--profile", metavar="DIR", help="also write DIR/<base>/update_profile.txt (torch.profiler)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="warn at every GPU->host sync in the update (QERL_SYNC_DEBUG=1; the stage log names each site)")
    args = ap.parse_args()
    work = Path(args.workdir)
    bf16, nvfp4 = work / f"{args.shape}-bf16", work / f"{args.shape}-nvfp4-random"
    bases = ["nvfp4", "bf16"] if args.base == "both" else [args.base]
    for base, path, make in (("bf16", bf16, make_checkpoint), ("nvfp4", nvfp4, make_nvfp4_checkpoint)):
        if base in bases:
            seconds = make_in_child(make, path, args.shape)
            print(f"random {base} checkpoint of {args.shape} at {path} ({seconds:.0f}s)", flush=True)
    vocab = SHAPES[args.shape][5]
    rollouts, rewards = make_shards(work, vocab, args.seqs, args.seq_len)
    rows = []
    prefetch = {"on": [True], "off": [False], "both": [True, False]}[args.dequant_prefetch]
    runs = [(b, p, mb, gemm) for mb in args.micro_batch_seqs for b in bases
            for gemm in (args.nvfp4_gemm if b == "nvfp4" else ["auto"])
            for p in (prefetch if b == "nvfp4" and gemm not in ("wgmma", "swap") else [False])]
    for base, pf, mb, gemm in runs:
        out = work / f"adapter-{base}-{int(time.time())}"
        cfg = json.dumps({"lora_rank": args.lora_rank, "lora_alpha": 2 * args.lora_rank, "gradient_checkpointing": True,
                          "micro_batch_tokens": mb * args.seq_len, "tis_cap": 2.0, "epochs": args.epochs,
                          "cudnn_attention": args.cudnn_attention, "dequant_prefetch": pf,
                          "manual_gc": not args.auto_gc})
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "components.train", "--model", str(nvfp4 if base == "nvfp4" else bf16),
                        "--rollouts", rollouts, "--rewards", rewards, "--output", str(out), "--config-text", cfg],
                       check=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "QERL_NVFP4_GEMM": gemm,
                                        **({"QERL_PROFILE_DIR": f"{args.profile}/{base}"} if args.profile else {}),
                                        **({"QERL_SYNC_DEBUG": "1"} if args.sync_debug else {})})
        m = json.loads((out / "metrics.json").read_text())
        rows.append({"shape": args.shape, "base": base, "nvfp4_gemm": gemm, "tokens": args.seqs * args.seq_len,
                     "micro_batch_tokens": mb * args.seq_len,
                     "update_tok_s": round(m["tokens_per_s"], 1), "update_s": round(m["seconds_update"], 2),
                     "epoch_s": [round(e["seconds"], 2) for e in m["epochs"]], "cudnn_attention": args.cudnn_attention,
                     "dequant_prefetch": pf, "logp_old_s": round(m["seconds_logp_old"], 2), "stage_wall_s": round(time.time() - t0, 1),
                     "peak_mem_gb": round(m["peak_memory_mb"] / 1024, 2),  # GPU on CUDA, host RSS on CPU
                     "loss": m["loss"], "grad_norm": m["grad_norm"],
                     "prefetch_hits": m.get("dequant_prefetch_hits"), "prefetch_issued": m.get("dequant_prefetch_issued"),
                     "manual_gc": not args.auto_gc, "gc_full_passes": m.get("gc_full_passes"),
                     "gc_s": round(m.get("gc_seconds", 0.0), 3)})
        print(" | ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
