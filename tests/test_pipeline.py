"""pipeline.py: the compiled IR, submission to a (fake) KFP API server, and the whole DAG run
locally with kfp.local — two iterations, a rerun of one stage, and a chained iteration with a
user's reward component swapped in."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

import pipeline
from components.common.cli import ConfigError
from components.common.layout import RunLayout
from components.common.schemas import read_artifact_table
from components.common.storage import Artifact, exists, list_artifacts
from tests.conftest import ROOT


def compiled(tmp_path: Path, **overrides) -> tuple[dict, dict]:
    cfg = pipeline.load_run_config(None, root="s3://qerl/runs", run="ci", **overrides)
    out = tmp_path / "p.yaml"
    pipeline.cmd_compile(cfg, str(out))
    docs = list(yaml.safe_load_all(out.read_text()))
    return docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _component_config(spec: dict, task: dict) -> str:
    return task["inputs"]["parameters"]["config"]["runtimeValue"]["constant"]


def _executor(spec: dict, task: dict) -> str:
    """The executor label of a task (KFP gives each use of a component its own)."""
    return spec["components"][task["componentRef"]["name"]]["executorLabel"]


@pytest.mark.parametrize("iterations", [1, 3])
def test_compiled_dag(tmp_path, iterations):
    spec, k8s = compiled(tmp_path, iterations=iterations, rollout_shards=2)
    tasks = spec["root"]["dag"]["tasks"]
    key = {t["taskInfo"]["name"]: n for n, t in tasks.items()}  # display name → task key (KFP numbers repeats)
    assert {"qerl-base-model", "qerl-quantize", "qerl-prompts"} <= set(tasks)
    assert tasks["qerl-quantize"]["dependentTasks"] == ["qerl-base-model"]
    loops = sorted(t for t in tasks if t.startswith("for-loop"))
    assert len(loops) == iterations
    for i in range(iterations):
        reward, train, fan_in = (tasks[key[f"reward {i}"]], tasks[key[f"train {i}"]],
                                 tasks[key[f"collect rollouts {i}"]])
        assert reward["inputs"]["parameters"]["rollouts"]["taskOutputParameter"]["producerTask"] == key[f"collect rollouts {i}"]
        assert set(train["dependentTasks"]) >= {key[f"reward {i}"], key[f"collect rollouts {i}"]}
        assert fan_in["inputs"]["parameters"]["expected"]["runtimeValue"]["constant"] == 2
        loop = tasks[key[f"rollouts-{i:04d}"]]
        items = json.loads(loop["parameterIterator"]["items"]["raw"])
        assert [x["output"] for x in items] == [f"s3://qerl/runs/ci/iter-{i:04d}/rollouts/shard-{s:03d}-of-002" for s in (0, 1)]
        upstream = ["qerl-prompts", "qerl-quantize"] if i == 0 else [key[f"train {i - 1}"]]
        assert sorted(loop["dependentTasks"]) == upstream  # the next rollout waits for the last train
        inner = spec["components"][loop["componentRef"]["name"]]["dag"]["tasks"]
        roll = next(t for n, t in inner.items() if n.startswith("qerl-rollout"))
        cfg = yaml.safe_load(_component_config(spec, roll))
        assert cfg["iteration"] == i and cfg["num_shards"] == 2
        assert cfg["aqn_sigma"] == pytest.approx(pipeline.sigma_schedule(i, iterations))
        adapter = roll["inputs"]["parameters"]["adapter"]["runtimeValue"]["constant"]
        assert adapter == ("" if i == 0 else f"s3://qerl/runs/ci/iter-{i - 1:04d}/adapter")
    execs = spec["deploymentSpec"]["executors"]
    inner = spec["components"][tasks[key["rollouts-0000"]]["componentRef"]["name"]]["dag"]["tasks"]
    roll_label = _executor(spec, next(t for n, t in inner.items() if n.startswith("qerl-rollout")))
    reward_label = _executor(spec, tasks[key["reward 0"]])
    roll_exec = execs[roll_label]["container"]
    assert roll_exec["image"] == "qerl/rollout:0.1.0" and roll_exec["command"] == ["python", "-m", "components.rollout"]
    assert roll_exec["resources"]["accelerator"] == {"count": "1", "resourceCount": "1", "resourceType": "nvidia.com/gpu",
                                                     "type": "nvidia.com/gpu"}
    assert "accelerator" not in execs[reward_label]["container"].get("resources", {})
    rk = k8s[roll_label]
    assert rk["emptyDirMounts"][0] == {"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi", "volumeName": "dshm"}
    assert rk["nodeSelector"]["labels"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert rk["activeDeadlineSeconds"] == "21600" and rk["secretAsEnv"][0]["secretName"] == "qerl-s3"
    assert rk["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert k8s[reward_label]["secretAsEnv"][0]["secretName"] == "qerl-s3-reward"
    assert k8s[reward_label]["podMetadata"]["labels"] == {"qerl.io/role": "reward"}
    assert k8s[reward_label]["securityContext"]["runAsNonRoot"] is True
    assert "securityContext" not in rk
    res = execs[reward_label]["container"]["resources"]
    assert res["cpuLimit"] == res["cpuRequest"] and res["memoryLimit"] == res["memoryRequest"]
    cm_env = {k["envVar"] for e in rk["configMapAsEnv"] for k in e["keyToEnv"]}
    assert cm_env == {"AWS_ENDPOINT_URL", "AWS_REGION"}
    for i in range(iterations + 1):  # the policy of every iteration, and the final adapter, answer the eval split
        roll, reward = tasks[key[f"eval rollout {i}"]], tasks[key[f"eval reward {i}"]]
        params = roll["inputs"]["parameters"]
        ecfg = yaml.safe_load(params["config"]["runtimeValue"]["constant"])
        assert (ecfg["split"], ecfg["samples"], ecfg["temperature"], ecfg["aqn_sigma"], ecfg["num_shards"]) == (
            "eval", 1, 0.0, 0.0, 1)
        assert params["output"]["runtimeValue"]["constant"] == f"s3://qerl/runs/ci/eval/iter-{i:04d}/rollouts"
        assert params["adapter"]["runtimeValue"]["constant"] == ("" if i == 0 else f"s3://qerl/runs/ci/iter-{i - 1:04d}/adapter")
        # after the policy's train, and after the evaluation before it (one eval GPU task at a time)
        assert sorted(roll["dependentTasks"]) == (["qerl-prompts", "qerl-quantize"] if i == 0 else
                                                  sorted([key[f"train {i - 1}"], key[f"eval reward {i - 1}"]]))
        assert _executor(spec, roll) != roll_label and _executor(spec, reward) != reward_label
        assert reward["inputs"]["parameters"]["rollouts"]["taskOutputParameter"]["producerTask"] == key[f"eval rollout {i}"]
    retry = next(t for n, t in tasks.items() if n.startswith("qerl-train"))["retryPolicy"]
    assert retry["maxRetryCount"] == 2
    assert tasks["qerl-train"].get("cachingOptions", {}).get("enableCache") in (None, False)
    assert tasks["qerl-quantize"]["cachingOptions"]["enableCache"] is True


def _eval_tasks(spec: dict) -> list[str]:
    return sorted(t["taskInfo"]["name"] for t in spec["root"]["dag"]["tasks"].values()
                  if t["taskInfo"]["name"].startswith("eval "))


def test_compiled_evaluations(tmp_path, caplog, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)  # the store stays unreadable here (a chained case below)
    spec, _ = compiled(tmp_path, iterations=5, eval={"every": 2, "max_tokens": 64})
    assert _eval_tasks(spec) == [f"eval {k} {i}" for k in ("reward", "rollout") for i in (0, 2, 4, 5)]
    roll = next(t for t in spec["root"]["dag"]["tasks"].values() if t["taskInfo"]["name"] == "eval rollout 2")
    assert yaml.safe_load(_component_config(spec, roll))["max_tokens"] == 64
    assert _eval_tasks(compiled(tmp_path, eval={"every": 0})[0]) == []
    assert _eval_tasks(compiled(tmp_path, prompts={**pipeline.RunConfig().prompts, "eval_fraction": 0.0})[0]) == []
    # a chained run whose store cannot be read here: the policy it starts from is left to the run before
    with caplog.at_level("WARNING"):
        spec, _ = compiled(tmp_path, start_iteration=3, iterations=2, init_adapter="s3://qerl/runs/ci/iter-0002/adapter")
    assert _eval_tasks(spec) == ["eval reward 4", "eval reward 5", "eval rollout 4", "eval rollout 5"]
    assert "planning the evaluations from the config" in caplog.text
    with pytest.raises(ConfigError, match="eval: split cannot be set"):
        pipeline.load_run_config(None, eval={"split": "train"})


def test_compiling_a_chained_run_checks_what_it_continues_from(s3_bucket, tmp_path):
    cfg = pipeline.load_run_config(None, root=f"{s3_bucket}/runs", run="r", start_iteration=2,
                                   init_adapter=f"{s3_bucket}/runs/r/iter-0001/adapter")
    with pytest.raises(ConfigError, match="continues from s3://.*/runs/r/base-nvfp4, which is not published"):
        pipeline.cmd_compile(cfg, str(tmp_path / "p.yaml"))


def test_a_chained_run_reads_the_newest_base_and_prompts(tmp_path, caplog):
    """After `rerun quantize` (base-nvfp4.v2) a chained run's rollouts, evaluations and training
    read the new base, as a stage rerun would; the prompts, never rerun, stay at their first version."""
    import logging

    from kfp import compiler

    from components.common.storage import publish_dir

    caplog.set_level(logging.INFO, logger="qerl.pipeline")
    L, src = RunLayout(str(tmp_path), "r"), tmp_path / "src"
    src.mkdir()
    (src / "metrics.json").write_text(json.dumps({"train": 9, "eval": 3}))
    base_v2 = L.base_nvfp4() + ".v2"
    for uri in (L.base_nvfp4(), base_v2, L.prompts(), L.adapter(1)):
        publish_dir(src, uri, stage="test", progress=False)
    cfg = pipeline.load_run_config(None, root=str(tmp_path), run="r", start_iteration=2, iterations=1,
                                   init_adapter=L.adapter(1))
    inputs = pipeline.check_chain(cfg, strict=True)
    assert inputs == {"base_nvfp4": base_v2, "prompts": L.prompts()}
    assert f"reads the newest version of {L.base_nvfp4()}: {base_v2}" in caplog.text
    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(pipeline.build_pipeline(cfg, "cluster", inputs=inputs), package_path=str(out))
    spec = next(yaml.safe_load_all(out.read_text()))
    tasks = [t for c in [spec["root"]["dag"]["tasks"], *(c["dag"]["tasks"] for c in spec["components"].values()
                                                        if "dag" in c)] for t in c.values()]
    models = {t["taskInfo"]["name"]: t["inputs"]["parameters"]["model"]["runtimeValue"]["constant"]
              for t in tasks if "model" in t.get("inputs", {}).get("parameters", {})}
    assert set(models) == {"rollout 2", "train 2", "eval rollout 2", "eval rollout 3"} and set(models.values()) == {base_v2}
    with pytest.raises(ConfigError, match="continues from .*iter-0009/adapter, which is not published"):
        pipeline.check_chain(pipeline.load_run_config(None, root=str(tmp_path), run="r", start_iteration=2,
                                                      init_adapter=L.adapter(9)), strict=True)


def test_a_chained_run_evaluates_what_the_run_before_did_not(tmp_path, caplog):
    from components.common.storage import publish_dir

    L, src = RunLayout(str(tmp_path), "r"), tmp_path / "src"
    src.mkdir()
    (src / "metrics.json").write_text(json.dumps({"train": 9, "eval": 0}))
    publish_dir(src, L.prompts(), stage="prompts", config={"eval_fraction": 0.0}, progress=False)
    cfg = pipeline.load_run_config(None, root=str(tmp_path), run="r", start_iteration=2, iterations=2,
                                   init_adapter=L.adapter(1))
    assert pipeline.evaluations(cfg) == []  # the first run's prompts hold no eval split, whatever cfg says
    assert "hold no eval split" in caplog.text
    (src / "metrics.json").write_text(json.dumps({"train": 9, "eval": 3}))
    publish_dir(src, L.prompts(), stage="prompts", config={"eval_fraction": 0.2}, progress=False, overwrite=True)
    assert pipeline.evaluations(cfg) == [2, 3, 4]  # the run before never evaluated policy 2
    publish_dir(src, L.eval_rollouts(2), stage="rollout", config={"adapter": L.adapter(1)}, progress=False)
    publish_dir(src, L.eval_rewards(2), stage="reward", progress=False)
    assert pipeline.evaluations(cfg) == [3, 4]
    other = pipeline.load_run_config(None, root=str(tmp_path), run="r", start_iteration=2, iterations=2,
                                     init_adapter=L.adapter(1, version=2))
    with caplog.at_level("WARNING"):
        assert pipeline.evaluations(other) == [3, 4]
    assert "not of init_adapter" in caplog.text


def test_irsa_and_local_roots(tmp_path):
    _, k8s = compiled(tmp_path, cluster={"s3_secret": "", "reward_s3_secret": ""})  # the pods' own identity signs
    assert not any(e.get("secretAsEnv") for e in k8s.values())
    cfg = pipeline.load_run_config(None, root=str(tmp_path / "runs"), run="ci")
    with pytest.raises(pipeline.ConfigError, match="needs an s3:// root"):
        pipeline.cmd_compile(cfg, str(tmp_path / "p.yaml"))


def test_kernel_cache_volume_on_gpu_tasks_only(tmp_path):
    spec, k8s = compiled(tmp_path, cluster={"kernel_cache_pvc": "qerl-kernel-cache"})
    execs = spec["deploymentSpec"]["executors"]
    for stage in ("rollout", "train", "quantize", "reward", "prompts"):
        name = next(n for n in execs if n.startswith(f"exec-qerl-{stage}"))
        env = {e["name"]: e["value"] for e in execs[name]["container"].get("env", [])}
        mounts = k8s[name].get("pvcMount", [])
        if stage in pipeline.GPU_STAGES:
            assert [(m["constant"], m["mountPath"]) for m in mounts] == [("qerl-kernel-cache", "/var/cache/qerl")]
            assert env == pipeline.KERNEL_CACHE_ENV and env["TRITON_CACHE_DIR"].startswith("/var/cache/qerl/")
        else:
            assert mounts == [] and not set(env) & set(pipeline.KERNEL_CACHE_ENV), stage
    _, k8s = compiled(tmp_path)  # the default: no claim, nothing mounted
    assert not any(e.get("pvcMount") for e in k8s.values())


def test_bad_run_config_is_refused(tmp_path):
    with pytest.raises(pipeline.ConfigError, match="RolloutConfig"):
        pipeline.load_run_config(None, rollout={"samplez": 3})
    bad = tmp_path / "run.yaml"
    bad.write_text("iterashuns: 3\n")
    with pytest.raises(pipeline.ConfigError, match="unknown field"):
        pipeline.load_run_config(str(bad))
    assert pipeline.main(["compile", "--config", str(bad), "--output", str(tmp_path / "x.yaml")]) == 2
    with pytest.raises(pipeline.ConfigError, match="bad run name"):
        pipeline.load_run_config(None, run="Has Spaces")
    with pytest.raises(pipeline.ConfigError, match="aqn .*keys: sigma_start, sigma_end, stages"):
        pipeline.load_run_config(None, aqn={"sigma_begin": 0.01})
    with pytest.raises(pipeline.ConfigError, match="aqn .*finite"):
        pipeline.load_run_config(None, aqn={"sigma_start": -1.0, "sigma_end": 5e-4, "stages": 10})
    # a custom reward's config is its own: not checked against the built-in reward's fields
    example = str(ROOT / "examples/length_reward/component.yaml")
    assert pipeline.load_run_config(None, reward_component=example, reward={"target_tokens": 64}).reward


def test_a_custom_reward_without_a_config_input(tmp_path):
    spec = yaml.safe_load((ROOT / "examples/length_reward/component.yaml").read_text())
    spec["inputs"] = [i for i in spec["inputs"] if i["name"] != "config"]  # the contract allows dropping it
    c = spec["implementation"]["container"]
    c["command"] = ["python", "/app/length_reward.py", "--rollouts", {"inputValue": "rollouts"},
                    "--output", {"inputValue": "output"}]
    del c["args"]
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(spec))
    ir, _ = compiled(tmp_path, reward_component=str(path), reward={})
    task = next(t for t in ir["root"]["dag"]["tasks"].values() if t["taskInfo"]["name"] == "reward 0")
    assert task["componentRef"]["name"].startswith("comp-length-reward")
    assert "config" not in task["inputs"]["parameters"]
    with pytest.raises(pipeline.ConfigError, match="declares no 'config' input"):
        compiled(tmp_path, reward_component=str(path), reward={"target_tokens": 64})


class FakeKFP(BaseHTTPRequestHandler):
    """The few KFP v2beta1 REST endpoints kfp.Client uses to start a run; records what it got."""
    posted: list = []

    def _reply(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        if "healthz" in self.path:
            return self._reply({"multi_user": False})
        return self._reply({})  # no experiment of that name yet

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        FakeKFP.posted.append((self.path, body, self.headers.get("Authorization")))
        if self.path.endswith("/experiments"):
            return self._reply({"experiment_id": "exp-1", "display_name": body.get("display_name")})
        return self._reply({"run_id": "run-42", "display_name": body.get("display_name"), "experiment_id": "exp-1"})

    def log_message(self, *args):
        pass


def test_submit_posts_the_pipeline_spec(capsys):
    server = HTTPServer(("127.0.0.1", 0), FakeKFP)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = pipeline.main(["submit", "--host", f"http://127.0.0.1:{server.server_port}", "--run", "sub",
                              "--root", "s3://qerl/runs", "--iterations", "2", "--token", "secret-token"])
    finally:
        server.shutdown()
    assert code == 0 and "submitted run run-42" in capsys.readouterr().out
    runs = [(p, b, a) for p, b, a in FakeKFP.posted if p.endswith("/runs")]
    assert len(runs) == 1
    path, body, auth = runs[0]
    assert path == "/apis/v2beta1/runs" and auth == "Bearer secret-token"
    assert body["display_name"] == "qerl-sub" and body["experiment_id"] == "exp-1"
    assert body["service_account"] == "qerl-pipeline"
    spec = body["pipeline_spec"]["pipeline_spec"]  # with its platform_spec (the kfp-kubernetes settings)
    assert spec["pipelineInfo"]["name"] == "qerl-sub"
    assert "qerl-train-2" in spec["root"]["dag"]["tasks"]
    assert "exec-qerl-rollout" in body["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert body.get("runtime_config", {}).get("parameters", {}) == {}
    assert any(p.endswith("/experiments") and b["display_name"] == "qerl" for p, b, _ in FakeKFP.posted)


def test_rerun_pipeline_imports_its_inputs(tmp_path):
    cfg = pipeline.load_run_config(None, root="s3://qerl/runs", run="ci")
    tasks = [dict(rollouts="s3://qerl/runs/ci/iter-0001/rollouts", output="s3://qerl/runs/ci/iter-0001/rewards.v2", config="")]
    from kfp import compiler
    out = tmp_path / "rerun.yaml"
    compiler.Compiler().compile(pipeline.build_rerun_pipeline(cfg, "reward", tasks), package_path=str(out))
    spec = yaml.safe_load_all(out.read_text()).__next__()
    dag = spec["root"]["dag"]["tasks"]
    assert any(n.startswith("importer") for n in dag) and "qerl-reward" in dag
    importer = next(e for n, e in spec["deploymentSpec"]["executors"].items() if "importer" in n)["importer"]
    assert importer["artifactUri"]["constant"] == "s3://qerl/runs/ci/iter-0001/rollouts"


def test_rerun_train_refuses_rewards_of_older_rollouts(tmp_path):
    import time

    from components.common.storage import publish_dir

    cfg = pipeline.load_run_config(None, root=str(tmp_path), run="r")
    L = RunLayout(str(tmp_path), "r")
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("x")
    for uri in (L.base_nvfp4(), L.rollouts(0), L.rewards(0)):
        publish_dir(src, uri, stage="test", progress=False)
    assert pipeline.rerun_inputs(cfg, "train", 0)[0]["rewards"] == L.rewards(0)
    time.sleep(1.1)  # manifests record the second they were published
    publish_dir(src, L.rollouts(0, version=2), stage="test", progress=False)  # a rollout rerun
    with pytest.raises(ConfigError, match="are older than its newest rollouts .*Rerun reward first"):
        pipeline.rerun_inputs(cfg, "train", 0)
    publish_dir(src, L.rewards(0, version=2), stage="test", progress=False)  # … then a reward rerun
    task = pipeline.rerun_inputs(cfg, "train", 0)[0]
    assert task["rollouts"] == L.rollouts_prefix(0, 2) and task["rewards"] == L.rewards(0, 2)


def test_rerun_repeats_the_recorded_settings(tmp_path, caplog):
    import logging

    from components.common.storage import publish_dir

    caplog.set_level(logging.INFO, logger="qerl.pipeline")
    L = RunLayout(str(tmp_path), "r")
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("x")
    ran_with = {"rollouts": [L.rollouts_prefix(0)], "output": L.rewards(0), "overwrite": False,
                "reward": ["gsm8k:1.0", "overlong:0.5"], "params": {"overlong": {"buffer": 20}}}
    publish_dir(src, L.rewards(0), stage="reward", config=ran_with, progress=False)
    roll = {"model": "m", "prompts": "p", "output": "o", "adapter": "", "shard": 1, "num_shards": 3,
            "iteration": 0, "samples": 7, "aqn_sigma": 0.0, "retired_setting": 1}
    for s in range(3):
        publish_dir(src, L.rollouts(0, s, 3), stage="rollout", config=dict(roll, shard=s), progress=False)
    publish_dir(src, L.base(), stage="base_model", config={"source": "embedded"}, progress=False)
    cfg = pipeline.load_run_config(None, root=str(tmp_path), run="r")  # today's (default) config
    [task] = pipeline.rerun_inputs(cfg, "quantize", 0)  # nothing ran there yet: the run config's
    assert task["config"] == "" and "rerun quantize: nothing is published yet" in caplog.text
    for uri in (L.base_nvfp4(), L.prompts()):
        publish_dir(src, uri, stage="test", progress=False)

    [task] = pipeline.rerun_inputs(cfg, "reward", 0)
    assert yaml.safe_load(task["config"]) == {"reward": ["gsm8k:1.0", "overlong:0.5"],
                                              "params": {"overlong": {"buffer": 20}}}
    assert "the run config differs in params, reward" in caplog.text
    [task] = pipeline.rerun_inputs(cfg, "reward", 0, from_config=True)
    assert yaml.safe_load(task["config"])["reward"] == cfg.reward["reward"]
    assert "reward ['gsm8k:1.0', 'overlong:0.5'] → ['gsm8k:1.0', 'format:0.1']" in caplog.text

    tasks = pipeline.rerun_inputs(cfg, "rollout", 0)  # the run had 3 shards; today's config says 1
    assert [t["output"] for t in tasks] == [L.rollouts(0, s, 3, version=2) for s in range(3)]
    assert [t["shard"] for t in tasks] == ["0", "1", "2"]
    assert yaml.safe_load(tasks[0]["config"]) == {"num_shards": 3, "iteration": 0, "samples": 7, "aqn_sigma": 0.0}
    assert "left out: retired_setting" in caplog.text
    assert len(pipeline.rerun_inputs(cfg, "rollout", 0, from_config=True)) == 1

    with pytest.raises(ConfigError, match="published by another stage .*--from-config"):
        pipeline.rerun_inputs(cfg, "quantize", 0)
    assert pipeline.rerun_inputs(cfg, "quantize", 0, from_config=True)[0]["output"] == L.base_nvfp4() + ".v2"

    custom = pipeline.load_run_config(None, root=str(tmp_path), run="r",
                                      reward_component=str(ROOT / "examples/length_reward/component.yaml"))
    with pytest.raises(ConfigError, match="scored by the built-in reward, but the run config names reward_component"):
        pipeline.rerun_inputs(custom, "reward", 0)  # would silently swap the reward function
    assert pipeline.rerun_inputs(custom, "reward", 0, from_config=True)[0]["output"] == L.rewards(0, 2)

    publish_dir(src, L.rewards(0, version=2), stage="reward:length_reward", config={"keywords": ["a"]}, progress=False)
    with pytest.raises(ConfigError, match="published by a custom reward .*reward_component"):
        pipeline.rerun_inputs(cfg, "reward", 0)
    with pytest.raises(ConfigError, match="unknown stage"):
        pipeline.rerun_inputs(cfg, "evaluate", 0)


def test_rerun_eval_repeats_the_recorded_evaluation(tmp_path, caplog):
    """`rerun eval` is the evaluation's rollout (from the policy that rolls out the iteration,
    with the settings it recorded) and then the reward of exactly what that rollout publishes."""
    import logging

    from kfp import compiler

    from components.common.storage import StorageError, publish_dir

    caplog.set_level(logging.INFO, logger="qerl.pipeline")
    L = RunLayout(str(tmp_path), "r")
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("x")
    for uri in (L.base_nvfp4(), L.prompts(), L.adapter(0), L.adapter(0, version=2)):
        publish_dir(src, uri, stage="test", progress=False)
    evaluated = {"split": "eval", "samples": 1, "temperature": 0.0, "max_tokens": 33, "num_shards": 1, "iteration": 1,
                 "prompts_per_iteration": 0, "aqn_sigma": 0.0, "adapter": L.adapter(0), "output": L.eval_rollouts(1)}
    publish_dir(src, L.eval_rollouts(1), stage="rollout", config=evaluated, progress=False)
    publish_dir(src, L.eval_rewards(1), stage="reward", config={"reward": ["gsm8k:1.0"]}, progress=False)
    cfg = pipeline.load_run_config(None, root=str(tmp_path), run="r")

    roll, reward = pipeline.rerun_inputs(cfg, "eval", 1)
    assert (roll["stage"], reward["stage"]) == ("rollout", "reward")
    assert roll["output"] == L.eval_rollouts(1, 2) and reward["output"] == L.eval_rewards(1, 2)
    assert reward["rollouts"] == roll["output"]  # scores the new answers, not the old ones
    assert roll["adapter"] == L.adapter(0, version=2) and roll["shard"] == "0"  # the newest policy of iteration 0
    assert yaml.safe_load(roll["config"])["max_tokens"] == 33 and yaml.safe_load(reward["config"]) == {
        "reward": ["gsm8k:1.0"]}
    assert "rerun eval rollout: settings recorded in " + L.eval_rollouts(1) in caplog.text
    roll, _ = pipeline.rerun_inputs(cfg, "eval", 1, from_config=True)
    assert yaml.safe_load(roll["config"]) == cfg.eval_rollout(1)
    assert "max_tokens 33 → " in caplog.text

    first, _ = pipeline.rerun_inputs(cfg, "eval", 0)  # the base's evaluation: nothing published yet, no adapter
    assert first["adapter"] == "" and first["output"] == L.eval_rollouts(0)
    assert "rerun eval rollout: nothing is published for the evaluation at iteration 0 yet" in caplog.text
    with pytest.raises(StorageError, match="nothing published at .*iter-0002/adapter"):
        pipeline.rerun_inputs(cfg, "eval", 3)  # no policy of iteration 2

    out = tmp_path / "rerun.yaml"
    compiler.Compiler().compile(pipeline.build_rerun_pipeline(cfg, "eval", pipeline.rerun_inputs(cfg, "eval", 1)),
                                package_path=str(out))
    dag = yaml.safe_load_all(out.read_text()).__next__()["root"]["dag"]["tasks"]
    assert "qerl-rollout" in dag and "qerl-reward" in dag
    assert dag["qerl-reward"]["inputs"]["parameters"]["rollouts"]["taskOutputParameter"]["producerTask"] == \
        "qerl-rollout"

    publish_dir(src, L.eval_rollouts(1, 2), stage="rollout", config=evaluated, progress=False)
    [again] = pipeline.rerun_inputs(cfg, "eval_reward", 1)  # the reward alone, of the newest answers
    assert again["stage"] == "reward" and again["rollouts"] == L.eval_rollouts(1, 2)
    assert again["output"] == L.eval_rewards(1, 2) and yaml.safe_load(again["config"]) == {"reward": ["gsm8k:1.0"]}
    with pytest.raises(StorageError, match="nothing published at .*eval/iter-0002/rollouts"):
        pipeline.rerun_inputs(cfg, "eval_reward", 2)
    compiler.Compiler().compile(pipeline.build_rerun_pipeline(cfg, "eval_reward", [again]), package_path=str(out))
    dag = yaml.safe_load_all(out.read_text()).__next__()["root"]["dag"]["tasks"]
    assert "qerl-reward" in dag and "qerl-rollout" not in dag


def test_a_rerun_with_a_chained_config_finds_each_iterations_policy(tmp_path, caplog):
    """Given a chained run's config (start_iteration 2, init_adapter of iteration 1), a rerun of
    an earlier iteration of the same run rolls out with that iteration's own policy: the newest
    adapter of the iteration before, or at the first run's start what its rollouts recorded."""
    import argparse
    import logging

    from components.common.storage import StorageError, publish_dir

    caplog.set_level(logging.INFO, logger="qerl.pipeline")
    L, src = RunLayout(str(tmp_path), "r"), tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("x")
    for uri in (L.base_nvfp4(), L.prompts(), L.adapter(0), L.adapter(0, version=2), L.adapter(1)):
        publish_dir(src, uri, stage="test", progress=False)
    publish_dir(src, L.rollouts(0), stage="rollout", config={"adapter": "/elsewhere/warm-start"}, progress=False)
    publish_dir(src, L.adapter(1, version=2), stage="test", progress=False)
    chained = pipeline.load_run_config(None, root=str(tmp_path), run="r", start_iteration=2, iterations=1,
                                       init_adapter=L.adapter(1))
    policy = {i: pipeline.rerun_inputs(chained, "eval", i)[0]["adapter"] for i in (0, 1, 2)}
    assert policy == {0: "/elsewhere/warm-start", 1: L.adapter(0, version=2), 2: L.adapter(1)}
    assert "its policy is the one its rollouts " + L.rollouts(0) in caplog.text
    assert pipeline.rerun_inputs(chained, "rollout", 1)[0]["adapter"] == L.adapter(0, version=2)
    with pytest.raises(StorageError, match="nothing published at .*iter-0002/adapter"):
        pipeline.rerun_inputs(chained, "rollout", 3)
    assert pipeline.check_chain(chained, strict=True)
    assert f"init_adapter {L.adapter(1)} is read as given, though a newer version" in caplog.text
    later = pipeline.load_run_config(None, root=str(tmp_path), run="r", start_iteration=9, init_adapter=L.adapter(1))
    with pytest.raises(ConfigError, match="iteration 5 comes before .*start_iteration 9.*which policy rolls it out"):
        pipeline.rerun_inputs(later, "rollout", 5)

    # A custom reward with no local command: refused before the evaluation's rollout runs.
    custom = pipeline.load_run_config(None, root=str(tmp_path), run="r",
                                      reward_component=str(ROOT / "examples/length_reward/component.yaml"))
    ran = []
    import components.common.twin as twin
    monkey = pytest.MonkeyPatch()
    monkey.setattr(twin, "run", lambda stage, **inputs: ran.append(stage))
    try:
        with pytest.raises(ConfigError, match="a custom reward needs reward_command"):
            pipeline.cmd_rerun(custom, argparse.Namespace(stage="eval", iteration=1, from_config=True, host=None))
    finally:
        monkey.undo()
    assert ran == []


def test_report_reads_the_newest_version_of_each_artifact(tmp_path):
    from components.common.storage import publish_dir

    cfg = pipeline.load_run_config(None, root=str(tmp_path), run="r", iterations=1)
    L = RunLayout(str(tmp_path), "r")

    def publish(uri, metrics):
        src = tmp_path / "src" / uri.rsplit("/", 2)[-2] / uri.rsplit("/", 1)[-1]
        src.mkdir(parents=True)
        (src / "metrics.json").write_text(json.dumps(metrics))
        publish_dir(src, uri, stage="test", progress=False)

    roll = {"completion_len_mean": 10.0, "samples": 4, "tokens_per_second": 5.0}
    publish(L.rollouts(0), roll)
    publish(L.rollouts(0, version=2), dict(roll, completion_len_mean=20.0))
    publish(L.rewards(0), {"reward_mean": 0.1})
    publish(L.rewards(0, version=3), {"reward_mean": 0.3})
    publish(L.adapter(0), {"loss": 1.0})
    [row] = pipeline.collect_metrics(cfg)
    assert row["completion_len"] == 20.0 and row["reward"] == 0.3 and row["loss"] == 1.0


# --------------------------------------------------------------------------- local end to end

def run_pipeline_cli(*args) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, str(ROOT / "pipeline.py"), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=1500)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


LOCAL_CONFIG = {
    "run": "e2e", "iterations": 2,
    "prompts": {"reasoning_gym": "basic_arithmetic", "size": 16, "seed": 0, "eval_fraction": 0.2,  # 4 eval prompts
                "reasoning_gym_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
    "rollout": {"prompts_per_iteration": 3, "samples": 4, "max_tokens": 24, "max_model_len": 512, "max_lora_rank": 16},
    # overlong shaping makes the rewards of a group differ, so every iteration really trains
    "reward": {"reward": ["gsm8k:1.0", "overlong:0.5"], "params": {"overlong": {"buffer": 20}}},
    "train": {"lr": 5e-3, "lora_rank": 8, "lora_alpha": 16, "micro_batch_tokens": 1024},
}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg_path = root / "run.yaml"
    cfg_path.write_text(yaml.safe_dump({**LOCAL_CONFIG, "root": str(root)}))
    return root, cfg_path, run_pipeline_cli("run", "--config", str(cfg_path))


@pytest.mark.slow
def test_local_run_two_iterations(local_run):
    root, _, proc = local_run
    L = RunLayout(str(root), "e2e")
    for uri in (L.base(), L.base_nvfp4(), L.prompts(), L.rewards(0), L.rewards(1), L.adapter(0), L.adapter(1), L.report()):
        assert exists(uri), uri  # committed, with its manifest
    assert list_artifacts(L.rollouts_prefix(0)) == [L.rollouts(0)]
    a0, a1 = Artifact(L.adapter(0)), Artifact(L.adapter(1))
    assert a0.digest != a1.digest  # the adapter changes between iterations …
    it0 = read_artifact_table(L.rollouts(0), "rollouts").to_pylist()
    it1 = read_artifact_table(L.rollouts(1), "rollouts").to_pylist()
    assert {r["adapter_digest"] for r in it0} == {""}
    assert {r["adapter_digest"] for r in it1} == {a0.digest}  # … and iteration 1 served iteration 0's
    assert {r["iteration"] for r in it1} == {1}
    # iteration 0 samples from the base: its engine runs without LoRA; iteration 1's has one slot
    assert Artifact(L.rollouts(0)).read_json("metrics.json")["lora_slot_rank"] == 0
    assert Artifact(L.rollouts(1)).read_json("metrics.json")["lora_slot_rank"] >= 1
    assert Artifact(L.adapter(0)).read_json("metrics.json")["updated"] is True
    # the base, the policy of iteration 1 and the final adapter answered the 4 eval prompts, greedily
    eval_prompts = {r["prompt_id"] for r in read_artifact_table(L.prompts(), "prompts", ["eval.arrow"]).to_pylist()}
    for i, digest in ((0, ""), (1, a0.digest), (2, a1.digest)):
        rows = read_artifact_table(L.eval_rollouts(i), "rollouts").to_pylist()
        assert len(eval_prompts) == 4 and {r["prompt_id"] for r in rows} == eval_prompts and len(rows) == 4
        assert {(r["adapter_digest"], r["temperature"], r["aqn_sigma"]) for r in rows} == {(digest, 0.0, 0.0)}
        assert exists(L.eval_rewards(i))
    report = Path(L.report())
    table = (report / "metrics.md").read_text()
    assert table.startswith("| iteration |") and "eval_accuracy" in table and len(table.strip().splitlines()) == 5
    assert (report / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| iteration |" in proc.stdout


@pytest.mark.slow
def test_rerun_one_stage_publishes_a_new_version(local_run):
    root, cfg_path, _ = local_run
    L = RunLayout(str(root), "e2e")
    before = Artifact(L.rewards(1)).manifest
    # no --config: the defaults' reward differs from the run's, the recorded one is what reruns
    p = run_pipeline_cli("rerun", "reward", "--iteration", "1", "--root", str(root), "--run", "e2e")
    assert p.stdout.strip().endswith("iter-0001/rewards.v2")
    assert "settings recorded in" in p.stderr
    assert Artifact(L.rewards(1)).manifest == before  # the old version is untouched
    v2 = read_artifact_table(L.rewards(1) + ".v2", "rewards")
    assert v2.equals(read_artifact_table(L.rewards(1), "rewards"))  # deterministic reward, same rollouts
    assert L.latest(L.rewards(1)) == L.rewards(1) + ".v2"


@pytest.mark.slow
def test_chained_iteration_with_a_user_reward_component(local_run):
    root, cfg_path, _ = local_run
    L = RunLayout(str(root), "e2e")
    chained = root / "chained.yaml"
    chained.write_text(yaml.safe_dump({
        **LOCAL_CONFIG, "root": str(root), "iterations": 1, "start_iteration": 2, "schedule_iterations": 3,
        "init_adapter": L.adapter(1),
        "reward_component": str(ROOT / "examples/length_reward/component.yaml"),
        "reward_command": f"python {ROOT / 'examples/length_reward/length_reward.py'}",
        "reward": {"keywords": ["answer"], "keyword_weight": 0.25}}))  # reaches the program as a --config FILE
    p = run_pipeline_cli("run", "--config", str(chained))
    rewards = read_artifact_table(L.rewards(2), "rewards").to_pylist()
    assert {k for r in rewards for k, _ in r["components"]} >= {"length"}
    assert Artifact(L.rewards(2)).manifest["config"]["keywords"] == ["answer"]  # the config file reached it
    it2 = read_artifact_table(L.rollouts(2), "rollouts").to_pylist()
    assert {r["adapter_digest"] for r in it2} == {Artifact(L.adapter(1)).digest}
    assert exists(L.adapter(2)) and "| 2 |" in p.stdout and "| 0 |" in p.stdout  # the report spans the whole run
    assert exists(L.eval_rewards(3)) and L.versions(L.eval_rewards(2)) == [1]  # the last run evaluated policy 2
    assert "| 3 |" in p.stdout

    # `rerun eval` redoes the final adapter's evaluation; here its reward is the user's program too
    p = run_pipeline_cli("rerun", "eval", "--iteration", "3", "--config", str(chained))
    assert p.stdout.strip().splitlines()[-2:] == [L.eval_rollouts(3, 2), L.eval_rewards(3, 2)]
    answers = [read_artifact_table(u, "rollouts").sort_by("prompt_id").column("completion_token_ids").to_pylist()
               for u in (L.eval_rollouts(3), L.eval_rollouts(3, 2))]
    assert answers[0] == answers[1]  # greedy, same adapter (iteration 2's), same engine settings
    assert Artifact(L.eval_rewards(3, 2)).manifest["stage"] == "reward:length_reward"
    scores = [read_artifact_table(u, "rewards").sort_by("prompt_id").column("reward").to_pylist()
              for u in (L.eval_rewards(3), L.eval_rewards(3, 2))]
    assert scores[0] == scores[1]


