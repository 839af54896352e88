"""Shared fixtures: a real S3 endpoint (moto in server mode on 127.0.0.1) and the embedded
SmolLM2 base checkpoint, built once by the base_model stage and cached under .cache/."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "test-artifacts"

# One thread: on 2 cores torch's default threads make small matmuls many times slower.
os.environ.setdefault("QERL_TORCH_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("QERL_CACHE_DIR", str(ROOT / ".cache" / "qerl"))

try:
    import torch
    torch.set_num_threads(1)
except ImportError:  # the reward image's tests run without torch
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 in server mode on 127.0.0.1, in its own process; the environment points boto3
    and pyarrow at it. (In-process, moto's Flask globals break vLLM's CPU kernel registration,
    which probes every module attribute.)"""
    import time
    import urllib.request

    port = _free_port()
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    log = open(CACHE.parent / "moto-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}; see {log.name}")
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"moto server did not start on {endpoint}")
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket for one test: `s3://<name>`."""
    import boto3

    name = "t-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40].strip("-")
    boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return f"s3://{name}"


def run_cli(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m …` as a user would; return the completed process."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def smollm2_artifact() -> Path:
    """The embedded base model as published by the base_model stage (cached across sessions)."""
    out = CACHE / "smollm2-base"
    if not (out / "MANIFEST.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        run_cli("components.base_model", "--output", str(out))
    return out


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_artifact) -> Path:
    """Path to the bf16 HF safetensors checkpoint of SmolLM2-135M-Instruct."""
    return smollm2_artifact


@pytest.fixture(scope="session")
def smollm2_nvfp4(smollm2_artifact) -> Path:
    """SmolLM2-135M-Instruct quantized to NVFP4A16 by the quantize stage (cached across sessions)."""
    out = CACHE / "smollm2-nvfp4"
    if not (out / "MANIFEST.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        run_cli("components.quantize", "--input", str(smollm2_artifact), "--output", str(out))
    return out


def kfp_argv(spec_path: Path, outputs_dir: Path | None = None, **inputs) -> list[str]:
    """The command line KFP gives a component.yaml's container for these inputs (inputs left out
    take their defaults), as a local argv: `python` becomes this interpreter."""
    import yaml

    spec = yaml.safe_load(Path(spec_path).read_text())
    defaults = {i["name"]: i.get("default", "") for i in spec.get("inputs", [])}
    values = {**defaults, **inputs}
    c = spec["implementation"]["container"]
    argv = []
    for a in [*c["command"], *c.get("args", [])]:
        if isinstance(a, dict) and "inputValue" in a:
            argv.append(str(values[a["inputValue"]]))
        elif isinstance(a, dict) and "outputPath" in a:
            argv.append(str((outputs_dir or Path("/tmp")) / a["outputPath"]))
        else:
            argv.append(str(a))
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def interpreter_report(test_file: str, timeout: int) -> dict:
    """Run `test_file --interpreter-check` in a fresh process with TRITON_INTERPRET=1 (triton
    reads the variable when a kernel is decorated, so it must be set before the kernels are
    first imported) and return the JSON report its last stdout line holds."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, test_file, "--interpreter-check"], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
