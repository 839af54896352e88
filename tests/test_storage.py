"""Storage contract, against a real S3 endpoint (moto server) and local paths."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import urllib.request

import pytest

from components.common import storage
from components.common.storage import Artifact, ArtifactExists, StorageError, list_artifacts, publish_dir


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """An artifact root URI on each backend."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_bucket") + "/runs"


def _src(tmp_path, files: dict[str, bytes]):
    d = tmp_path / "src"
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def test_round_trip(root, tmp_path):
    files = {"a.txt": b"hello", "sub/b.bin": os.urandom(1000), "metrics.json": b'{"x": 1}'}
    m = publish_dir(_src(tmp_path, files), f"{root}/art", stage="test", config={"k": 1})
    assert {o["name"] for o in m["objects"]} == set(files)
    art = Artifact(f"{root}/art")
    assert art.manifest["stage"] == "test" and art.manifest["config"] == {"k": 1}
    assert art.manifest["packages"]["pyarrow"] and art.manifest["code_version"]
    for name, data in files.items():
        assert art.read_bytes(name) == data
    assert art.read_json("metrics.json") == {"x": 1}
    local = art.local_dir()
    for name, data in files.items():
        assert (local / name).read_bytes() == data
    assert storage.exists(f"{root}/art") and not storage.exists(f"{root}/other")


def test_killed_publish_leaves_nothing_readable_and_retry_succeeds(root, tmp_path, monkeypatch):
    src = _src(tmp_path, {"a.bin": b"1" * 100, "b.bin": b"2" * 100, "c.bin": b"3" * 100})
    real_open, calls = storage._open_output, []

    def dying_open(loc):
        calls.append(loc)
        if len(calls) == 2:
            raise ConnectionError("simulated crash during upload")
        return real_open(loc)

    monkeypatch.setattr(storage, "_open_output", dying_open)
    with pytest.raises(ConnectionError):
        publish_dir(src, f"{root}/art", stage="test")
    monkeypatch.setattr(storage, "_open_output", real_open)
    assert not storage.exists(f"{root}/art")
    with pytest.raises(StorageError, match="does not exist"):
        Artifact(f"{root}/art")
    assert list_artifacts(root) == []
    publish_dir(src, f"{root}/art", stage="test")  # the retry: no overwrite needed
    assert Artifact(f"{root}/art").read_bytes("c.bin") == b"3" * 100


def test_sigkilled_publish_leaves_nothing_readable(tmp_path):
    """A real kill -9 in the middle of a multi-object publish (local store)."""
    src = _src(tmp_path, {f"f{i:02d}.bin": os.urandom(1 << 20) for i in range(40)})
    dest = tmp_path / "store" / "art"
    code = ("import sys, time; from components.common import storage as s\n"
            "real = s._open_output\n"
            "def slow(loc):\n"
            "    if loc.path.endswith('f05.bin'): print('midway', flush=True); time.sleep(60)\n"
            "    return real(loc)\n"
            "s._open_output = slow\n"
            f"s.publish_dir({str(src)!r}, {str(dest)!r}, stage='t')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "midway"
    proc.kill()
    proc.wait()
    assert any(dest.iterdir()) and not storage.exists(str(dest))
    publish_dir(src, str(dest), stage="t")
    assert len(Artifact(str(dest)).names()) == 40


def test_corrupted_object_detected(root, tmp_path):
    publish_dir(_src(tmp_path, {"w.bin": b"x" * 5000}), f"{root}/art", stage="test")
    loc = storage.parse_uri(f"{root}/art/w.bin")
    if loc.scheme == "file":
        with open(loc.path, "r+b") as f:
            f.seek(10)
            f.write(b"y")
    else:
        storage.s3_client().put_object(Bucket=loc.bucket, Key=loc.path, Body=b"x" * 4999 + b"y")
    art = Artifact(f"{root}/art")
    with pytest.raises(StorageError, match=r"checksum mismatch for .*w\.bin"):
        art.read_bytes("w.bin")
    with pytest.raises(StorageError, match="checksum mismatch"):
        art.download("w.bin", tmp_path / "copy.bin")
    assert not (tmp_path / "copy.bin").exists()


def test_overwrite_refused_unless_asked(root, tmp_path):
    publish_dir(_src(tmp_path, {"v.txt": b"one", "old.txt": b"gone"}), f"{root}/art", stage="test")
    src2 = tmp_path / "src2"
    src2.mkdir()
    (src2 / "v.txt").write_bytes(b"two")
    with pytest.raises(ArtifactExists, match="already exists"):
        publish_dir(src2, f"{root}/art", stage="test")
    assert Artifact(f"{root}/art").read_bytes("v.txt") == b"one"
    publish_dir(src2, f"{root}/art", stage="test", overwrite=True)
    art = Artifact(f"{root}/art")
    assert art.read_bytes("v.txt") == b"two" and art.names() == ["v.txt"]


def test_manifest_write_is_conditional(root, tmp_path):
    """Two publishers racing: the second manifest write is refused, not silently replaced."""
    publish_dir(_src(tmp_path, {"a": b"1"}), f"{root}/art", stage="first")
    with pytest.raises(ArtifactExists):
        storage._put_manifest(storage.parse_uri(f"{root}/art"), b"{}", overwrite=False)
    assert Artifact(f"{root}/art").manifest["stage"] == "first"


def test_listing(root, tmp_path):
    src = _src(tmp_path, {"x": b"1"})
    for name in ("run/prompts", "run/iter-0000/rewards", "run/iter-0000/rollouts/shard-000-of-002"):
        publish_dir(src, f"{root}/{name}", stage="test")
    # an unfinished one (objects, no manifest) is not listed
    storage._open_output(storage.parse_uri(f"{root}/run/iter-0001/rewards/x")).close()
    found = list_artifacts(f"{root}/run")
    assert [f.split("/run/")[1] for f in found] == [
        "iter-0000/rewards", "iter-0000/rollouts/shard-000-of-002", "prompts"]


def test_a_retry_removes_what_a_dead_publish_left(root, tmp_path):
    """Objects without a manifest (a publish that died) are not read with the next publish's."""
    for name in ("model-00002-of-00002.safetensors", "sub/stale.txt"):
        storage._open_output(storage.parse_uri(f"{root}/ckpt/{name}")).close()
    publish_dir(_src(tmp_path, {"model.safetensors": b"new"}), f"{root}/ckpt", stage="test")
    assert [n for n, _ in storage._list(storage.parse_uri(f"{root}/ckpt"))] == ["MANIFEST.json", "model.safetensors"]
    if not root.startswith("s3://"):
        assert sorted(p.name for p in Artifact(f"{root}/ckpt").local_dir().rglob("*")) == [
            "MANIFEST.json", "model.safetensors"]
    publish_dir(_src(tmp_path, {"model.safetensors": b"new"}), f"{root}/run/a", stage="test")
    with pytest.raises(StorageError, match="holds other artifacts"):
        publish_dir(_src(tmp_path, {"model.safetensors": b"new"}), f"{root}/run", stage="test")
    assert Artifact(f"{root}/run/a").read_bytes("model.safetensors") == b"new"


def test_a_prefix_of_shards_expands_only_when_complete(root, tmp_path):
    src = _src(tmp_path, {"x": b"1"})
    it = f"{root}/run/iter-0000"
    for s in (0, 2):
        publish_dir(src, f"{it}/rollouts/shard-{s:03d}-of-003", stage="test")
    with pytest.raises(StorageError, match=r"rollouts is incomplete: shard-001-of-003 not published .* 2 of 3"):
        storage.expand_artifacts([f"{it}/rollouts"], "rollout shard")
    # one shard given directly is read as it is
    assert storage.expand_artifacts([f"{it}/rollouts/shard-000-of-003"]) == [f"{it}/rollouts/shard-000-of-003"]
    publish_dir(src, f"{it}/rollouts/shard-001-of-003", stage="test")
    assert [u.rsplit("/", 1)[1] for u in storage.expand_artifacts([f"{it}/rollouts"])] == [
        "shard-000-of-003", "shard-001-of-003", "shard-002-of-003"]
    publish_dir(src, f"{it}/rollouts.v2/shard-000-of-001", stage="test")  # a rerun beside it
    with pytest.raises(StorageError, match="holds 2 sets of rollout shards"):
        storage.expand_artifacts([it], "rollout shard")
    assert storage.expand_artifacts([f"{it}/rollouts.v2"]) == [f"{it}/rollouts.v2/shard-000-of-001"]


def test_multipart_100mb_object(s3_bucket, tmp_path):
    big = tmp_path / "src" / "big.bin"
    big.parent.mkdir()
    block = os.urandom(1 << 20)
    with open(big, "wb") as f:
        for _ in range(100):
            f.write(block)
    m = publish_dir(big.parent, f"{s3_bucket}/big", stage="test", progress=False)
    assert m["objects"][0]["size"] == 100 << 20
    loc = storage.parse_uri(f"{s3_bucket}/big/big.bin")
    head = storage.s3_client().head_object(Bucket=loc.bucket, Key=loc.path)
    assert "-" in head["ETag"], "expected a multipart upload (ETag of the form <md5>-<parts>)"
    out = Artifact(f"{s3_bucket}/big").download("big.bin", tmp_path / "back.bin")
    assert out.stat().st_size == 100 << 20
    with open(out, "rb") as f:
        assert f.read(1 << 20) == block


def test_remote_cache_keyed_by_digest(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    publish_dir(_src(tmp_path, {"w": b"weights"}), f"{s3_bucket}/base", stage="test")
    art = Artifact(f"{s3_bucket}/base")
    first = art.local_dir()
    assert first.is_relative_to(tmp_path / "cache") and (first / "w").read_bytes() == b"weights"
    monkeypatch.setattr(Artifact, "download", lambda *a, **k: pytest.fail("cache not used"))
    assert Artifact(f"{s3_bucket}/base").local_dir() == first


def test_s3_failures_are_storage_errors_naming_the_object(s3_bucket, tmp_path):
    """An object gone from under its manifest, a bucket that does not exist, and an S3 error code
    no branch knows all reach the user as one StorageError line, not a botocore/pyarrow traceback."""
    from botocore.exceptions import ClientError

    publish_dir(_src(tmp_path, {"a.txt": b"a"}), f"{s3_bucket}/art", stage="test")
    loc = storage.parse_uri(f"{s3_bucket}/art/a.txt")
    storage.s3_client().delete_object(Bucket=loc.bucket, Key=loc.path)
    with pytest.raises(StorageError, match=rf"cannot read {s3_bucket}/art/a\.txt"):
        Artifact(f"{s3_bucket}/art").read_bytes("a.txt")
    with pytest.raises(StorageError, match="S3 bucket does not exist"):
        publish_dir(_src(tmp_path, {"b.txt": b"b"}), "s3://no-such-bucket-here/art", stage="test")

    def slow_down():
        raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "PutObject")
    with pytest.raises(StorageError, match=r"S3 error SlowDown \(put x\): Please reduce your request rate"):
        storage._s3_call("put x", slow_down)
    with pytest.raises(ClientError):  # codes the caller handles pass through
        storage._s3_call("put x", slow_down, expected=("SlowDown",))

    from botocore.exceptions import ParamValidationError, ResponseStreamingError

    def broken_body():
        raise ResponseStreamingError(error="Connection reset by peer")
    with pytest.raises(StorageError, match=r"S3 client error \(get x\): .*Connection reset by peer"):
        storage._s3_call("get x", broken_body)

    def bad_call():  # this code's bug, not the store's: its own traceback
        raise ParamValidationError(report="Missing required parameter Key")
    with pytest.raises(ParamValidationError):
        storage._s3_call("get x", bad_call)

    class Broken(io.BytesIO):  # a stream that dies after its first chunk (pyarrow raises OSError)
        def read(self, n=-1):
            if self.tell():
                raise OSError("AWS Error NETWORK_CONNECTION")
            return super().read(n)
    with pytest.raises(StorageError, match=r"reading s3://b/a.txt failed after \d+ bytes: AWS Error NETWORK"):
        storage._verify_stream(Broken(b"x" * (2 * storage.CHUNK)), {"size": 0, "sha256": ""}, "s3://b/a.txt")


def test_presigned_url_sigv4(s3_bucket, tmp_path):
    publish_dir(_src(tmp_path, {"p.txt": b"presigned"}), f"{s3_bucket}/art", stage="test")
    url = storage.presigned_url(f"{s3_bucket}/art/p.txt", expires=60)
    assert "X-Amz-Signature=" in url and "X-Amz-Algorithm=AWS4-HMAC-SHA256" in url
    assert f"/{s3_bucket[5:]}/art/p.txt" in url  # path-style addressing
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == b"presigned"


@pytest.mark.parametrize("uri, msg", [
    ("", "empty URI"),
    ("gs://bucket/x", "unsupported URI scheme"),
    ("s3://", "bad S3 URI"),
    ("s3://bucket", "needs a key prefix"),
    ("s3://Bad_Bucket/x", "lower-case bucket"),
    ("file://relative/path", "absolute"),
])
def test_bad_uris(uri, msg):
    with pytest.raises(StorageError, match=msg):
        storage.parse_uri(uri)


def _cli_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_ENDPOINT_URL"}
    env.update(extra)
    return env


def _prompts_cli(output: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "components.prompts", "--model", "s3://b/m", "--output", output,
                           "--reasoning-gym", "basic_arithmetic", "--size", "4"],
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_missing_credentials_is_one_line(tmp_path):
    env = _cli_env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_CONFIG_FILE=str(tmp_path / "none"),
                   AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    p = _prompts_cli("s3://b/out", env)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("python -m components.prompts: error: no S3 credentials")
    assert "Traceback" not in p.stderr


def test_cli_unreachable_endpoint_is_one_line():
    env = _cli_env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    p = _prompts_cli("s3://b/out", env)
    assert p.returncode == 2, p.stderr
    assert "cannot reach the S3 endpoint http://127.0.0.1:9" in p.stderr and "Traceback" not in p.stderr


def test_cli_bad_uri_is_one_line():
    p = _prompts_cli("gs://nope/x", _cli_env())
    assert p.returncode == 2 and "unsupported URI scheme" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
