"""python -m components.prompts --model URI --output URI
       (--gsm8k-jsonl PATH | --reasoning-gym NAME --size N | --table PATH) --seed S

Builds the prompt shards of a run: each task gets a stable id, the base model's chat template
with a system/format instruction, its token ids and its gold answer. A deterministic hash of
(id, seed) puts `eval_fraction` of the prompts in `eval.arrow` and the rest in `train.arrow`.

Sources:
  --gsm8k-jsonl   GSM8K-style JSON lines: `question`, `answer` ending in `#### <final>`
  --reasoning-gym a seeded reasoning-gym generator by name (e.g. basic_arithmetic,
                  gsm_symbolic), `--size` tasks
  --table         Parquet or Arrow file with `question` and `answer` columns
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from components.common.cli import ConfigError, config_dict, field, require, run_stage
from components.common.schemas import PROMPTS, to_table, write_ipc
from components.common.storage import Artifact, Staging, fetch_external_file, parse_uri

log = logging.getLogger("qerl.prompts")

DEFAULT_SYSTEM = ("You are a careful math tutor. Think step by step inside <think> </think>, "
                  "then give only the final answer inside <answer> </answer>.")


@dataclass
class PromptsConfig:
    model: str = field("", help="base model artifact URI (its tokenizer and chat template are used)")
    output: str = field("", help="URI to publish the prompt shards at")
    gsm8k_jsonl: str = field("", help="GSM8K-style JSONL file (question, answer with '#### final')")
    reasoning_gym: str = field("", help="reasoning-gym generator name, e.g. basic_arithmetic")
    size: int = field(0, help="number of tasks to generate with --reasoning-gym")
    reasoning_gym_config: dict = field(default_factory=dict, help="generator options, e.g. {max_digits: 2} for basic_arithmetic")
    table: str = field("", help="Parquet/Arrow file with question and answer columns")
    limit: int = field(0, help="keep at most this many tasks from a file source (0 = all)")
    seed: int = field(0, help="seed of the generator and of the train/eval split")
    eval_fraction: float = field(0.1, help="fraction of prompts held out for evaluation")
    system_prompt: str = field(DEFAULT_SYSTEM, help="system message (format instruction); '' for none")
    max_prompt_tokens: int = field(1024, help="drop prompts longer than this many tokens (counted in metrics)")
    overwrite: bool = field(False, help="replace an artifact already published at --output")

    def __post_init__(self):
        require(bool(self.model), "--model is required (the base model artifact, for its chat template)")
        require(bool(self.output), "--output is required")
        parse_uri(self.output)
        sources = [s for s in (self.gsm8k_jsonl, self.reasoning_gym, self.table) if s]
        require(len(sources) == 1, "give exactly one source: --gsm8k-jsonl, --reasoning-gym or --table")
        require(not self.reasoning_gym or self.size > 0, "--reasoning-gym needs --size N > 0")
        require(0.0 <= self.eval_fraction < 1.0, f"--eval-fraction must be in [0, 1), not {self.eval_fraction}")
        require(self.max_prompt_tokens > 0, "--max-prompt-tokens must be positive")
        require(self.limit >= 0 and self.size >= 0, "--limit and --size must not be negative")


_FINAL = re.compile(r"####\s*(.+?)\s*$")


def gsm8k_final(answer: str) -> str:
    """The gold final answer of a GSM8K solution (`… #### 1,234` → `1234`)."""
    m = _FINAL.search(answer.strip())
    if not m:
        raise ConfigError("a GSM8K answer does not end in '#### <final>': " + answer[-60:].replace("\n", " "))
    return m.group(1).replace(",", "").strip()


def _read_tasks(path: str, local: Path, gsm8k: bool) -> tuple[list[dict], str]:
    """Tasks from a GSM8K-style JSONL file, or a Parquet / Arrow table with question and answer."""
    if gsm8k:
        tasks = []
        with open(local) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    q, a = row["question"], row["answer"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ConfigError(f"{path}:{n}: not a GSM8K record with question and answer ({e})") from e
                tasks.append({"question": q.strip(), "answer": gsm8k_final(a), "solution": a.strip()})
        source = "gsm8k"
    else:
        import pyarrow.ipc as ipc
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(local) if str(local).endswith(".parquet") else ipc.open_file(local).read_all()
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"cannot read {path} as Parquet or Arrow: {e}") from e
        missing = {"question", "answer"} - set(table.column_names)
        if missing:
            raise ConfigError(f"{path} lacks column(s) {', '.join(sorted(missing))}")
        tasks = [{"question": str(q), "answer": str(a), "solution": ""}
                 for q, a in zip(table.column("question").to_pylist(), table.column("answer").to_pylist())]
        source = "table"
    return tasks, source


def load_tasks(cfg: PromptsConfig) -> tuple[list[dict], str]:
    """[{question, answer, solution}], source tag."""
    if cfg.reasoning_gym:
        import reasoning_gym
        try:
            data = reasoning_gym.create_dataset(cfg.reasoning_gym, size=cfg.size, seed=cfg.seed,
                                                **cfg.reasoning_gym_config)
        except (KeyError, ValueError, TypeError, AssertionError) as e:
            raise ConfigError(f"reasoning-gym generator {cfg.reasoning_gym!r} with {cfg.reasoning_gym_config}: {e}") from e
        tasks = [{"question": e["question"], "answer": str(e["answer"]), "solution": ""} for e in data]
        return tasks, f"reasoning_gym:{cfg.reasoning_gym}"
    path = cfg.gsm8k_jsonl or cfg.table
    with tempfile.TemporaryDirectory(prefix="qerl-prompts-") as tmp:  # an s3 object is fetched, alone, here
        tasks, source = _read_tasks(path, fetch_external_file(path, tmp), gsm8k=bool(cfg.gsm8k_jsonl))
    if cfg.limit:
        tasks = tasks[: cfg.limit]
    if not tasks:
        raise ConfigError(f"{path} holds no tasks")
    return tasks, source


def prompt_id(source: str, question: str, answer: str) -> str:
    digest = hashlib.sha256(f"{question}\x00{answer}".encode()).hexdigest()[:16]
    return f"{source.split(':')[-1]}-{digest}"


def is_eval(pid: str, seed: int, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{pid}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def main(cfg: PromptsConfig) -> None:
    from transformers import AutoTokenizer

    tasks, source = load_tasks(cfg)
    model_dir = Artifact(cfg.model).local_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if not tok.chat_template:
        raise ConfigError(f"the model at {cfg.model} has no chat template")
    rows, seen, too_long = {"train": [], "eval": []}, set(), 0
    from tqdm import tqdm
    for task in tqdm(tasks, desc="prompts", unit="task", disable=len(tasks) < 500):
        pid = prompt_id(source, task["question"], task["answer"])
        if pid in seen:
            continue
        seen.add(pid)
        messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
        messages.append({"role": "user", "content": task["question"]})
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            too_long += 1
            continue
        split = "eval" if is_eval(pid, cfg.seed, cfg.eval_fraction) else "train"
        rows[split].append({"prompt_id": pid, "split": split, "question": task["question"],
                            "answer": task["answer"], "solution": task["solution"], "prompt_text": text,
                            "prompt_token_ids": ids, "source": source})
    if not rows["train"]:
        raise ConfigError("no training prompts left (all too long or held out)")
    if cfg.eval_fraction and not rows["eval"]:
        raise ConfigError(f"eval_fraction {cfg.eval_fraction} held out none of the {len(rows['train'])} prompts: "
                          "raise it or the number of prompts, or set it to 0 for no eval split")
    lengths = [len(r["prompt_token_ids"]) for split in rows.values() for r in split]
    metrics = {"source": source, "tasks": len(tasks), "duplicates": len(tasks) - len(seen),
               "too_long": too_long, "train": len(rows["train"]), "eval": len(rows["eval"]),
               "prompt_tokens_mean": statistics.fmean(lengths), "prompt_tokens_max": max(lengths)}
    with Staging() as st:
        for split, split_rows in rows.items():
            (st.path / f"{split}.arrow").write_bytes(write_ipc(to_table(split_rows, PROMPTS)))
        (st.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        st.publish(cfg.output, stage="prompts", config=config_dict(cfg), overwrite=cfg.overwrite)
    log.info("prompts: %d train, %d eval (%d duplicates, %d too long) → %s", metrics["train"],
             metrics["eval"], metrics["duplicates"], too_long, cfg.output)


if __name__ == "__main__":
    sys.exit(run_stage(main, PromptsConfig, prog="python -m components.prompts", description=__doc__))
