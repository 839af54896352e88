"""Arrow schemas v1 of the data that stages exchange: prompts, rollouts, rewards.

Each shard is one Arrow IPC file whose schema metadata names the schema and its version
(`qerl.schema`, `qerl.schema_version`). Readers accept any 1.x and refuse another major
version, or a shard of the wrong kind, with a clear error. A minor version only adds columns;
each added column says since when (field metadata `qerl.since`), and a shard of an older minor
version may lack it (readers then use the documented default). A rollout sample is keyed by
(prompt_id, sample_index); a reward row carries the same key.

1.1: rollouts gained `temperature` and `top_p`; `completion_logprobs` became the log-probs of
the distribution sampled from (vLLM's processed log-probs: logits / temperature, renormalized
over the top-p nucleus). 1.0 rollouts hold log-probs of the unscaled logits (temperature 1).
"""
from __future__ import annotations

import io
import math

import pyarrow as pa
import pyarrow.ipc as ipc

SCHEMA_VERSION = "1.1"


class SchemaError(ValueError):
    """A shard that does not follow its schema."""


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={"qerl.schema": name, "qerl.schema_version": SCHEMA_VERSION})


PROMPTS = _schema("prompts", [
    pa.field("prompt_id", pa.string(), nullable=False),        # stable id: source + content hash
    pa.field("split", pa.string(), nullable=False),            # "train" or "eval"
    pa.field("question", pa.string(), nullable=False),         # the task as given to the model
    pa.field("answer", pa.string(), nullable=False),           # gold final answer
    pa.field("solution", pa.string(), nullable=False),         # full gold solution text ("" if none)
    pa.field("prompt_text", pa.string(), nullable=False),      # chat-templated prompt
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("source", pa.string(), nullable=False),           # e.g. "gsm8k", "reasoning_gym:basic_arithmetic"
])

ROLLOUTS = _schema("rollouts", [
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),      # 0..G-1 within the prompt's group
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_logprobs", pa.list_(pa.float32()), nullable=False),  # engine logprob per sampled token
    # … under the sampling distribution: logits / temperature over the top-p nucleus (1.0: plain logits)
    pa.field("completion_text", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),    # "stop" or "length"
    pa.field("answer", pa.string(), nullable=False),           # gold answer, carried for the reward stage
    pa.field("iteration", pa.int32(), nullable=False),         # policy version: the iteration …
    pa.field("adapter_digest", pa.string(), nullable=False),   # … and the adapter's digest ("" = base)
    pa.field("aqn_sigma", pa.float32(), nullable=False),       # AQN noise std used for this rollout
    pa.field("aqn_seed", pa.int64(), nullable=False),
    pa.field("sampling_seed", pa.int64(), nullable=False),
    pa.field("max_tokens", pa.int32(), nullable=False),
    pa.field("temperature", pa.float32(), nullable=False, metadata={"qerl.since": "1.1"}),  # sampling; 0 = greedy
    pa.field("top_p", pa.float32(), nullable=False, metadata={"qerl.since": "1.1"}),
])

REWARDS = _schema("rewards", [
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),          # weighted total
    pa.field("components", pa.map_(pa.string(), pa.float64()), nullable=False),  # named parts, unweighted
])

SCHEMAS = {"prompts": PROMPTS, "rollouts": ROLLOUTS, "rewards": REWARDS}


def to_table(rows: list[dict] | dict[str, list], schema: pa.Schema) -> pa.Table:
    """Build a table in `schema` from row dicts or columns; missing or mistyped fields raise."""
    try:
        if isinstance(rows, dict):
            return pa.Table.from_pydict(rows, schema=schema)
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as e:
        raise SchemaError(f"rows do not fit the {schema.metadata[b'qerl.schema'].decode()} schema: {e}") from e


def write_ipc(table: pa.Table) -> bytes:
    """Serialize a table as an Arrow IPC file (the shard format)."""
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def read_ipc(data: bytes, expect: str, where: str = "shard") -> pa.Table:
    """Read an Arrow IPC shard and check that it is a `expect` shard of a known major version."""
    try:
        table = ipc.open_file(pa.BufferReader(data)).read_all()
    except pa.ArrowInvalid as e:
        raise SchemaError(f"{where} is not an Arrow IPC file: {e}") from e
    validate(table, expect, where)
    return table


def validate(table: pa.Table, expect: str, where: str = "shard") -> None:
    """Schema name, major version, columns and types; values are checked by each consumer."""
    meta = table.schema.metadata or {}
    name = meta.get(b"qerl.schema", b"").decode()
    version = meta.get(b"qerl.schema_version", b"").decode()
    if name != expect:
        raise SchemaError(f"{where} holds a {name or 'untagged'!s} table, expected {expect}")
    major = version.split(".")[0]
    if major != SCHEMA_VERSION.split(".")[0]:
        raise SchemaError(f"{where}: unknown major version {version!r} of the {expect} schema "
                          f"(this code reads {SCHEMA_VERSION.split('.')[0]}.x)")
    want = SCHEMAS[expect]
    for field in want:
        if field.name not in table.schema.names:
            since = (field.metadata or {}).get(b"qerl.since", b"").decode()
            if since and _minor(version) < _minor(since):
                continue  # added after this shard's version: readers use the column's default
            raise SchemaError(f"{where}: column {field.name!r} is missing from the {expect} table")
        got = table.schema.field(field.name).type
        if got != field.type:
            raise SchemaError(f"{where}: column {field.name!r} has type {got}, expected {field.type}")
        if table.column(field.name).null_count:
            raise SchemaError(f"{where}: column {field.name!r} has null values")


def _minor(version: str) -> int:
    parts = version.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def check_finite(values, what: str) -> None:
    """Raise naming the first NaN/inf in `values`."""
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            raise SchemaError(f"{what}: row {i} is {v} (rewards must be finite numbers)")


def read_artifact_table(uri: str, expect: str, names: list[str] | None = None) -> pa.Table:
    """Read and concatenate the `*.arrow` shards of a published artifact, verified and validated."""
    from .storage import Artifact

    art = Artifact(uri)
    names = names if names is not None else [n for n in art.names() if n.endswith(".arrow")]
    if not names:
        raise SchemaError(f"artifact {uri} holds no .arrow shard")
    tables = [read_ipc(art.read_bytes(n), expect, f"{uri}/{n}") for n in names]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]
