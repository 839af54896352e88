"""The stage CLI convention, shared by every stage.

Each stage has one config dataclass; every field is documented once, in its `help` metadata.
`run_stage` turns it into `python -m components.<stage>`:

* `--help` lists every field with its default;
* `--config FILE` (YAML) sets any fields; a flag given on the command line overrides it;
* the dataclass's `__post_init__` validates the result;
* bad input ends with one line `error: …` and exit status 2 (a failure inside the stage:
  status 1), with no traceback unless `--debug`;
* logs go to stderr with timestamps.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import json
import os
import sys
import types
import typing
from typing import Any, Callable

import yaml

from .schemas import SchemaError
from .storage import StorageError

log = logging.getLogger("qerl")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field."""


USER_ERRORS = (ConfigError, StorageError, SchemaError, FileNotFoundError)


def field(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
          default_factory: Any = dataclasses.MISSING, **meta) -> Any:
    """A config field with its one-line documentation (and an optional custom flag name)."""
    md = {"help": help, "flag": flag, **meta}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _base_type(tp):
    """(python type, is_list) for an annotation such as `int`, `str | None`, `list[str]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return (typing.get_args(tp) or (str,))[0], True
    return tp, False


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def build_parser(prog: str, description: str, config_cls) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML file with any of the fields below; flags override it")
    p.add_argument("--config-text", metavar="YAML", help="the same as YAML text (how KFP components pass it); "
                   "applied after --config")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--output-uri-file", metavar="PATH", help="after publishing, write the output URI here "
                   "(a KFP output parameter)")
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        tp, is_list = _base_type(hints[f.name])
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS,
                                  help=(f.metadata.get("help") or "") + (f" (default: {default})" if default not in (None, "", []) else ""))
        if tp is dict:  # a YAML/JSON mapping on the command line: --params '{a: {b: 1}}'
            kw.update(type=yaml.safe_load, metavar="YAML")
        elif tp is bool:  # `--flag` alone means true; `--flag false` also works
            kw.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
        elif is_list:
            kw.update(type=tp, nargs="+", metavar=f.metadata.get("metavar") or f.name.upper())
        else:
            kw.update(type=tp, metavar=f.metadata.get("metavar") or f.name.upper())
        p.add_argument(flag, **kw)
    return p


def config_mapping(config_cls, text: str, where: str) -> dict:
    """The YAML mapping in `text`, checked against the fields of `config_cls`."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping of field: value")
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return data


def load_config(config_cls, argv: list[str] | None, prog: str, description: str):
    """Parse argv into a validated config: YAML file first, then explicit flags."""
    parser = build_parser(prog, description, config_cls)
    args = vars(parser.parse_args(argv))
    debug = args.pop("debug")
    uri_file = args.pop("output_uri_file", None)
    values: dict[str, Any] = {}
    path, text = args.pop("config", None), args.pop("config_text", None)
    if path:
        try:
            with open(path) as fh:
                values.update(config_mapping(config_cls, fh.read(), f"--config {path}"))
        except OSError as e:
            raise ConfigError(f"cannot read --config {path}: {e.strerror}") from e
    if text and text.strip():
        values.update(config_mapping(config_cls, text, "--config-text"))
    values.update(args)
    try:
        return config_cls(**values), debug, uri_file
    except TypeError as e:
        raise ConfigError(str(e)) from e


def setup_logging(debug: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def run_stage(main: Callable[[Any], Any], config_cls, argv: list[str] | None = None, *,
              prog: str, description: str) -> int:
    """Parse, validate and run one stage; return the process exit status."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    setup_logging(debug)
    try:
        cfg, debug, uri_file = load_config(config_cls, argv, prog, description)
        if _published_by_an_earlier_attempt(cfg, prog.rsplit(".", 1)[-1]):
            log.warning("%s is already published by this stage with this same config (a retried task?): "
                        "nothing to do", cfg.output)
        else:
            main(cfg)
        if uri_file:
            os.makedirs(os.path.dirname(os.path.abspath(uri_file)), exist_ok=True)
            with open(uri_file, "w") as fh:
                fh.write(cfg.output)
        return 0
    except USER_ERRORS as e:
        if debug:
            raise
        msg = str(e) if not isinstance(e, FileNotFoundError) else f"file not found: {e.filename or e}"
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing was published", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user, traceback with --debug
        if debug:
            raise
        print(f"{prog}: error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def _published_by_an_earlier_attempt(cfg, stage: str) -> bool:
    """True when `cfg.output` already holds what this run would publish: an artifact of the same
    stage with the same config. A retried task (KFP retries one whose attempt published and then
    lost its pod or its status report) then succeeds instead of failing on "already exists".
    Anything else at the output (another config, another stage) still fails when publishing."""
    output = getattr(cfg, "output", "")
    if not isinstance(output, str) or not output or getattr(cfg, "overwrite", False):
        return False
    from .storage import Artifact, exists

    if not exists(output):
        return False
    manifest = Artifact(output).manifest
    return manifest.get("stage") == stage and manifest.get("config") == json.loads(json.dumps(config_dict(cfg)))


def config_dict(cfg) -> dict:
    """The config as plain data, for manifests and metrics."""
    return dataclasses.asdict(cfg)


def require(cond: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless cond: for `__post_init__` validation."""
    if not cond:
        raise ConfigError(msg)


def set_cpu_threads() -> None:
    """Honour QERL_TORCH_THREADS (tests set 1: on 2 cores torch's default threads thrash)."""
    n = os.environ.get("QERL_TORCH_THREADS")
    if n:
        import torch
        torch.set_num_threads(int(n))
