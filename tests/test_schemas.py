"""Arrow schemas v1: round trips, version and kind checks."""
from __future__ import annotations

import pyarrow as pa
import pytest

from components.common.schemas import (PROMPTS, REWARDS, ROLLOUTS, SchemaError, read_artifact_table,
                                       read_ipc, to_table, write_ipc)
from components.common.storage import publish_dir

ROLLOUT_ROW = {"prompt_id": "gsm8k-ab", "sample_index": 3, "prompt_token_ids": [1, 2, 3],
               "completion_token_ids": [7, 8], "completion_logprobs": [-0.5, -1.25], "completion_text": "hi",
               "finish_reason": "stop", "answer": "42", "iteration": 2, "adapter_digest": "abc",
               "aqn_sigma": 0.01, "aqn_seed": 7, "sampling_seed": 11, "max_tokens": 64,
               "temperature": 1.0, "top_p": 1.0}
ROWS = {
    "prompts": (PROMPTS, [{"prompt_id": "p1", "split": "train", "question": "1+1?", "answer": "2", "solution": "",
                           "prompt_text": "<s>1+1?", "prompt_token_ids": [1, 5], "source": "gsm8k"}]),
    "rollouts": (ROLLOUTS, [ROLLOUT_ROW]),
    "rewards": (REWARDS, [{"prompt_id": "p1", "sample_index": 0, "reward": 1.1,
                           "components": {"gsm8k": 1.0, "format": 1.0}}]),
}


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_round_trip(kind):
    schema, rows = ROWS[kind]
    table = read_ipc(write_ipc(to_table(rows, schema)), kind)
    assert table.schema.metadata[b"qerl.schema_version"] == b"1.1"
    back = table.to_pylist()
    assert back[0]["prompt_id"] == rows[0]["prompt_id"]
    if kind == "rollouts":
        assert back[0]["completion_logprobs"] == [-0.5, -1.25] and back[0]["aqn_seed"] == 7
    if kind == "rewards":
        assert dict(back[0]["components"]) == {"gsm8k": 1.0, "format": 1.0}


def _retag(table: pa.Table, **meta) -> pa.Table:
    md = dict(table.schema.metadata)
    md.update({k.encode(): v.encode() for k, v in meta.items()})
    return table.replace_schema_metadata(md)


def test_unknown_major_version_refused():
    t = _retag(to_table([ROLLOUT_ROW], ROLLOUTS), **{"qerl.schema_version": "2.0"})
    with pytest.raises(SchemaError, match="unknown major version '2.0' of the rollouts schema"):
        read_ipc(write_ipc(t), "rollouts")


def test_newer_minor_version_accepted():
    t = _retag(to_table([ROLLOUT_ROW], ROLLOUTS), **{"qerl.schema_version": "1.7"})
    assert read_ipc(write_ipc(t), "rollouts").num_rows == 1


def test_wrong_kind_and_missing_column_refused():
    t = to_table([ROLLOUT_ROW], ROLLOUTS)
    with pytest.raises(SchemaError, match="holds a rollouts table, expected rewards"):
        read_ipc(write_ipc(t), "rewards")
    with pytest.raises(SchemaError, match="column 'aqn_sigma' is missing"):
        read_ipc(write_ipc(t.drop_columns(["aqn_sigma"])), "rollouts")
    with pytest.raises(SchemaError, match="not an Arrow IPC file"):
        read_ipc(b"definitely not arrow", "rollouts")


def test_columns_added_by_a_minor_version_may_be_missing_from_older_shards():
    old = to_table([ROLLOUT_ROW], ROLLOUTS).drop_columns(["temperature", "top_p"])
    assert read_ipc(write_ipc(_retag(old, **{"qerl.schema_version": "1.0"})), "rollouts").num_rows == 1
    with pytest.raises(SchemaError, match="column 'temperature' is missing"):
        read_ipc(write_ipc(old), "rollouts")  # a 1.1 shard must have it


def test_rows_that_do_not_fit_are_refused():
    bad = dict(ROLLOUT_ROW, sample_index="three")
    with pytest.raises(SchemaError, match="do not fit the rollouts schema"):
        to_table([bad], ROLLOUTS)


def test_read_artifact_table_concatenates_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"part-{i}.arrow").write_bytes(write_ipc(to_table([dict(ROLLOUT_ROW, sample_index=i)], ROLLOUTS)))
    publish_dir(src, str(tmp_path / "art"), stage="test")
    table = read_artifact_table(str(tmp_path / "art"), "rollouts")
    assert table.column("sample_index").to_pylist() == [0, 1, 2]
