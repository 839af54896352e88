"""Run a stage CLI as a subprocess: what the local pipeline's lightweight twins call.

`kfp.local`'s SubprocessRunner runs only lightweight Python components, so each container
stage has a twin (in pipeline.py) with the same inputs as its component.yaml; the twin calls
`run("<stage>", **inputs)`, which runs `python -m components.<stage>` with the same flags
the container would get. Output streams through, so the local run shows each stage's log.
"""
from __future__ import annotations

import subprocess
import sys


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries its exit status and last error line."""


def argv(stage: str, config: str = "", **inputs) -> list[str]:
    """The command line a stage's container gets for these inputs (empty strings are kept)."""
    cmd = [sys.executable, "-m", f"components.{stage}"]
    for name, value in inputs.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    if config:
        cmd += ["--config-text", config]
    return cmd


def run(stage: str, config: str = "", **inputs) -> str:
    """Run one stage; return its output URI. Raise StageFailed on a non-zero exit."""
    from collections import deque

    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(argv(stage, config, **inputs), stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:  # stream the stage's log through, keep its end for the error
            sys.stderr.write(line)
            if line.strip():
                tail.append(line.strip())
    if proc.returncode:
        raise StageFailed(f"stage {stage} exited {proc.returncode}: {tail[-1] if tail else ''}")
    return str(inputs.get("output", ""))
