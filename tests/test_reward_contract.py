"""The custom reward contract (docs/reward-contract.md): the shard checks, the component-spec
checks, and user reward programs run locally through `run_custom_reward`."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
import yaml

from components.common.schemas import REWARDS, SchemaError, to_table
from components.common.storage import Artifact, exists
from components.reward.plugin import RewardPluginError, check_component_spec, run_custom_reward
from components.reward.validate import check_rewards
from tests.conftest import ROOT
from tests.test_reward_stage import COMPLETIONS, publish_rollouts, rollouts_table

EXAMPLE = ROOT / "examples" / "length_reward"
BUILTIN = ROOT / "components" / "reward" / "component.yaml"
TEMPLATE = ROOT / "components" / "reward" / "custom_template.yaml"
KEYS = list(COMPLETIONS)


# --------------------------------------------------------------------------- check_rewards

def rewards(keys=KEYS, reward=0.5, comps=None, meta=None) -> pa.Table:
    t = to_table([{"prompt_id": p, "sample_index": i, "reward": reward, "components": comps or {"x": 1.0}}
                  for p, i in keys], REWARDS)
    return t.replace_schema_metadata({**REWARDS.metadata, **(meta or {})}) if meta else t


def test_check_rewards_accepts_a_good_shard_in_any_order_and_minor_version():
    check_rewards(rollouts_table(), rewards(list(reversed(KEYS))))
    check_rewards(rollouts_table(), rewards(meta={b"qerl.schema_version": b"1.7"}))


@pytest.mark.parametrize("table, msg", [
    (lambda: rewards(KEYS[:3]), "1 rollout sample(s) have no reward, e.g. p2#1"),
    (lambda: rewards(KEYS + [KEYS[0]]), "rollout sample p1#0 is scored more than once"),
    (lambda: rewards(KEYS + [("p9", 0)]), "1 reward row(s) match no rollout sample, e.g. p9#0"),
    (lambda: rewards(reward=float("nan")), "reward of p1#0 is nan"),
    (lambda: rewards(reward=float("inf")), "reward of p1#0 is inf"),
    (lambda: rewards(comps={"len": float("nan")}), "component 'len' of p1#0 is nan"),
    (lambda: rewards(comps={"ok": 1.0, "len": -float("inf")}), "component 'len' of p1#0 is -inf"),
    (lambda: rewards(meta={b"qerl.schema_version": b"2.0"}), "unknown major version '2.0'"),
    (lambda: rewards(meta={b"qerl.schema": b"rollouts"}), "holds a rollouts table, expected rewards"),
    (lambda: rollouts_table(), "holds a rollouts table, expected rewards"),
    (lambda: rewards().cast(pa.schema([f.with_type(pa.float32()) if f.name == "reward" else f for f in REWARDS],
                                      metadata=REWARDS.metadata)), "column 'reward' has type float"),
])
def test_check_rewards_names_each_problem(table, msg):
    with pytest.raises(SchemaError, match="reward shard") as e:
        check_rewards(rollouts_table(), table())
    assert msg in str(e.value)


# --------------------------------------------------------------------------- check_component_spec

def test_builtin_example_and_template_specs():
    info = check_component_spec(BUILTIN)
    assert info.image == "qerl/reward:0.1.0" and set(info.inputs) == {"rollouts", "output", "config"}
    assert info.inputs["config"].default == ""
    ex = check_component_spec(str(EXAMPLE / "component.yaml"))
    assert ex.name == "length-reward" and ex.command[:2] == ["sh", "-ec"]
    with pytest.raises(ValueError, match="template placeholder REPLACE_ME"):
        check_component_spec(TEMPLATE)
    assert check_component_spec(TEMPLATE, allow_placeholders=True).image.endswith("/my-reward:0.1.0")


def test_example_program_matches_dockerfile_entrypoint():
    entry = next(line for line in (EXAMPLE / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT"))
    program = " ".join(json.loads(entry.split(None, 1)[1]))
    script = yaml.safe_load((EXAMPLE / "component.yaml").read_text())["implementation"]["container"]["command"][2]
    assert f'PROGRAM="{program}"' in script


def test_specs_compile_into_a_pipeline(tmp_path):
    from kfp import compiler, dsl

    op = check_component_spec(EXAMPLE / "component.yaml").component

    @dsl.pipeline(name="reward-only")
    def p():  # no pipeline parameters: this module's annotations are strings (__future__)
        op(rollouts="s3://b/run/iter-0000/rollouts", output="s3://b/run/iter-0000/rewards", config="target_tokens: 64")

    compiler.Compiler().compile(p, str(tmp_path / "p.yaml"))
    assert "length_reward.py" in (tmp_path / "p.yaml").read_text()


def _example():
    return yaml.safe_load((EXAMPLE / "component.yaml").read_text())


def _broken(edit):
    spec = copy.deepcopy(_example())
    edit(spec)
    return spec


@pytest.mark.parametrize("spec, msg", [
    (_broken(lambda s: s["inputs"].pop(1)), "missing input 'output'"),
    (_broken(lambda s: s["inputs"].pop(0)), "missing input 'rollouts'"),
    (_broken(lambda s: s["implementation"]["container"].pop("image")), "image is missing"),
    (_broken(lambda s: s["implementation"]["container"].update(image=" ")), "image is missing"),
    (_broken(lambda s: s["implementation"]["container"].pop("command")), "command is missing"),
    (_broken(lambda s: s["inputs"].append({"name": "model", "type": "String"})), "unexpected input(s) ['model']"),
    (_broken(lambda s: s["inputs"][0].update(type="JsonArray")), "input 'rollouts' has type List"),
    (_broken(lambda s: s["inputs"].__setitem__(2, {"name": "config", "type": "String"})), "'config' must be optional"),
    (_broken(lambda s: s.update(outputs=[{"name": "metrics", "type": "String"}])), "declares output(s) ['metrics']"),
    (_broken(lambda s: s["implementation"]["container"]["args"].pop(1)), "input 'output' is never passed"),
    (_broken(lambda s: s.update(implementation={"graph": {}})), "needs implementation.container"),
    ("name: x\njust: [a, list\n", "not valid YAML"),
    ("- a\n- b\n", "expected a KFP component mapping"),
    ("/nonexistent/reward.yaml", "file not found"),
])
def test_broken_specs_are_refused(spec, msg):
    with pytest.raises(ValueError) as e:
        check_component_spec(spec)
    assert msg in str(e.value)


# --------------------------------------------------------------------------- run_custom_reward

@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store" / "run")
    return request.getfixturevalue("s3_bucket") + "/run"


def test_example_reward_runs_and_its_shard_is_consumed(root, tmp_path):
    prefix = publish_rollouts(root)
    cfg = tmp_path / "length.yaml"
    cfg.write_text("target_tokens: 4\nkeywords: ['<answer>']\nkeyword_weight: 0.5\n")
    out = f"{root}/iter-0000/rewards"
    table = run_custom_reward([sys.executable, str(EXAMPLE / "length_reward.py")], [prefix], out, str(cfg))
    # tokens 6, 6, 8, 12 with target 4 -> length -0.5, -0.5, -1, -1; only p1's completions have <answer>.
    got = {(r["prompt_id"], r["sample_index"]): (r["reward"], dict(r["components"])) for r in table.to_pylist()}
    assert got == {("p1", 0): (0.0, {"length": -0.5, "keyword": 1.0}), ("p1", 1): (0.0, {"length": -0.5, "keyword": 1.0}),
                   ("p2", 0): (-1.0, {"length": -1.0, "keyword": 0.0}), ("p2", 1): (-1.0, {"length": -1.0, "keyword": 0.0})}
    art = Artifact(out)
    assert art.manifest["stage"] == "reward:length_reward" and art.manifest["config"]["target_tokens"] == 4
    m = art.read_json("metrics.json")
    assert m["samples"] == 4 and m["reward_mean"] == pytest.approx(-0.5) and m["keyword_rate"] == 0.5


def test_example_imports_no_torch():
    code = (f"import sys; sys.path.insert(0, {str(EXAMPLE)!r}); import length_reward; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_example_bad_config_is_exit_2_and_publishes_nothing(tmp_path):
    prefix = publish_rollouts(str(tmp_path / "run"))
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("target_tokens: 4\nbrevity: 3\n")
    out = str(tmp_path / "rewards")
    with pytest.raises(RewardPluginError, match=r"rejected its input or config \(exit 2\)") as e:
        run_custom_reward([sys.executable, str(EXAMPLE / "length_reward.py")], [prefix], out, str(cfg))
    assert "unknown key(s) ['brevity']" in str(e.value) and not exists(out)


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "user_reward.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_reward_that_fails_reports_its_last_stderr_lines(tmp_path):
    prefix = publish_rollouts(str(tmp_path / "run"))
    cmd = _script(tmp_path, """
        import sys
        for i in range(40):
            print(f"log line {i}", file=sys.stderr)
        print("KeyError: 'completion'", file=sys.stderr)
        sys.exit(1)
    """)
    with pytest.raises(RewardPluginError) as e:
        run_custom_reward(cmd, [prefix], str(tmp_path / "rewards"))
    msg = str(e.value)
    assert "failed (exit 1)" in msg and "stops before training" in msg
    assert "KeyError: 'completion'" in msg and "log line 39" in msg and "log line 5\n" not in msg


def test_reward_that_writes_duplicates_is_refused(tmp_path):
    prefix = publish_rollouts(str(tmp_path / "run"))
    cmd = _script(tmp_path, """
        import argparse
        from components.common.schemas import REWARDS, to_table, write_ipc
        from components.common.storage import Staging
        p = argparse.ArgumentParser()
        p.add_argument("--rollouts", nargs="+"); p.add_argument("--output"); p.add_argument("--config")
        a = p.parse_args()
        rows = [{"prompt_id": pid, "sample_index": i, "reward": 1.0, "components": {}}
                for pid, i in [("p1", 0), ("p1", 1), ("p2", 0), ("p2", 1), ("p2", 1)]]
        with Staging() as st:
            (st.path / "rewards.arrow").write_bytes(write_ipc(to_table(rows, REWARDS)))
            st.publish(a.output, stage="reward:dup")
    """)
    out = str(tmp_path / "rewards")
    with pytest.raises(RewardPluginError, match=r"invalid reward shard.*p2#1 is scored more than once"):
        run_custom_reward(cmd, [prefix], out)


def test_reward_that_exits_0_without_publishing_is_refused(tmp_path):
    prefix = publish_rollouts(str(tmp_path / "run"))
    with pytest.raises(RewardPluginError, match="exited 0 but published nothing"):
        run_custom_reward(_script(tmp_path, "print('done')\n"), [prefix], str(tmp_path / "rewards"))


def test_reward_with_wrong_shard_name_is_refused(tmp_path):
    prefix = publish_rollouts(str(tmp_path / "run"))
    cmd = _script(tmp_path, """
        import sys
        from components.common.storage import Staging
        with Staging() as st:
            (st.path / "scores.csv").write_text("p1,0,1.0\\n")
            st.publish(sys.argv[sys.argv.index("--output") + 1], stage="reward:csv")
    """)
    with pytest.raises(RewardPluginError, match=r"has no rewards.arrow \(it has: scores.csv\)"):
        run_custom_reward(cmd, [prefix], str(tmp_path / "rewards"))
