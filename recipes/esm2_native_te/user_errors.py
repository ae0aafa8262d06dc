# Copied from common/user_errors.py — edit the source, then run ci/check_copies.py --fix
"""Mistakes the user fixes end a run with one line, not a traceback.

A wrong data path, a misspelled config key, a value of the wrong type, a setting this machine cannot run: the
entrypoints report each as one line on stderr and exit with status 2::

    error: dataset.path='/no/such.fasta': no such file(s); point dataset.path at a FASTA, Parquet or JSONL file

``HYDRA_FULL_ERROR=1`` (Hydra's own switch) shows the full traceback instead. Any other exception is a bug and
keeps its traceback.

- Where input is validated, raise :class:`UserError`, or the subclass that is also the builtin exception callers
  may catch (:class:`ConfigError` is a ``ValueError``, :class:`PathNotFoundError` a ``FileNotFoundError``, ...).
  The message says what is wrong and what to do.
- An entrypoint is decorated ``@report_user_errors(hydra.main(...))`` (which also turns Hydra's own errors about
  the command line into one line) and calls :func:`check_config` first thing: a ``???`` value left unset, or an
  override whose type does not match the config's value (``num_train_steps=abc``), fails there by name. A script
  without Hydra calls its main through :func:`run`.
- Under torchrun only rank 0 prints the line. Every rank writes it to torchrun's error file, so torchrun's
  failure report names it (in its ``traceback :`` field) also when another rank failed first.
"""

import contextlib
import difflib
import functools
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


EXIT_STATUS = 2  # like argparse: the command, its config or its input is wrong
DEBUG_SWITCH = "HYDRA_FULL_ERROR"


class UserError(Exception):
    """A problem with the command, config, data or machine that the user fixes; the message says how."""


class ConfigError(UserError, ValueError):
    """A config value, or data content, that cannot work."""


class PathNotFoundError(UserError, FileNotFoundError):
    """A file or directory the config names does not exist or holds nothing usable."""


class MissingPackageError(UserError, ImportError):
    """The config asks for a feature whose package is not installed."""


class UnsupportedHardwareError(UserError, RuntimeError):
    """The config asks for something this machine cannot run (FP8 without FP8 tensor cores, ...)."""


# ------------------------------------------------------------------------------------------------ running a main

_switch_as_given: list[str | None] = []  # HYDRA_FULL_ERROR as the user set it, while run() has replaced it


def _debug() -> bool:
    value = _switch_as_given[-1] if _switch_as_given else os.environ.get(DEBUG_SWITCH)
    return (value or "") not in ("", "0")


def report_user_errors(hydra_main: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """``@report_user_errors(hydra.main(...))`` on an entrypoint: ``hydra.main``, reporting user errors in one line.

    Errors inside the task are caught there, before Hydra prints its "Error executing job" preamble; Hydra's own
    errors about the command line (raised before the task starts) are caught around it, by :func:`run`.
    """

    def decorator(task: Callable) -> Callable:
        @functools.wraps(task)
        def task_reporting_user_errors(*args: Any, **kwargs: Any) -> Any:
            try:
                return task(*args, **kwargs)
            except Exception as error:
                message = user_error_message(error)
                if message is None or _debug():
                    raise
                _exit_with(message)  # SystemExit, which Hydra lets through

        hydra_entry = hydra_main(task_reporting_user_errors)

        @functools.wraps(hydra_entry)
        def entry(*args: Any, **kwargs: Any) -> Any:
            return run(hydra_entry, *args, **kwargs)

        return entry

    return decorator


def run(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``main`` (a script's main function); report a user error in one line and exit with status 2.

    For a ``@hydra.main`` function (see :func:`report_user_errors`): Hydra prints exceptions itself unless
    ``HYDRA_FULL_ERROR`` is set, so it is set during the call and every exception reaches this function. When the
    user set ``HYDRA_FULL_ERROR=1`` everything propagates with its traceback.
    """
    previous = os.environ.get(DEBUG_SWITCH)
    _switch_as_given.append(previous)
    os.environ[DEBUG_SWITCH] = "1"
    try:
        return main(*args, **kwargs)
    except Exception as error:
        message = user_error_message(error)
        if message is None or _debug():
            raise
        _exit_with(message)
    finally:
        _switch_as_given.pop()
        if previous is None:
            os.environ.pop(DEBUG_SWITCH, None)
        else:
            os.environ[DEBUG_SWITCH] = previous


def user_error_message(error: BaseException) -> str | None:
    """The one line to show for ``error``, or None when it is not a user error (a bug: keep the traceback)."""
    if isinstance(error, UserError):
        return _one_line(_unwrap_worker_message(str(error)))
    hydra_errors = sys.modules.get("hydra.errors")  # only a script that uses Hydra can raise its errors
    if hydra_errors is not None and isinstance(error, hydra_errors.CompactHydraException):
        return _hydra_message(error)
    return None


def _exit_with(message: str) -> None:
    line = f"error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's failure report shows the line instead of "To enable traceback see ..."
        extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
        with contextlib.suppress(OSError), open(error_file, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": extra}}, file)
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        # A live gloo group can hang the interpreter's teardown (see distributed.cleanup_distributed): leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATUS)
    sys.exit(EXIT_STATUS)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _unwrap_worker_message(text: str) -> str:
    """A DataLoader worker's exception arrives as "Caught X in DataLoader worker ... Original Traceback ...":
    keep the original message (the traceback's last line, without its class name)."""
    if "Original Traceback" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _hydra_message(error: Exception) -> str:
    """Hydra's errors about the command line (unknown key, unknown config name, bad override syntax), in one line."""
    from hydra.errors import MissingConfigException, OverrideParseException

    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    if key and "not in struct" in str(cause):
        parent = getattr(cause, "parent_node", None)
        known = [str(k) for k in parent] if isinstance(parent, Mapping) else []
        close = difflib.get_close_matches(str(getattr(cause, "key", key)), known, n=1)
        prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
        hint = f"did you mean {prefix}{close[0]}? " if close else ""
        # Training entrypoints read defaults.yaml's keys; an inference script (predict.py, embed.py) has its own
        # file named after it (predict.yaml, embed.yaml).
        script = Path(sys.argv[0])
        own = script.parent / "hydra_config" / f"{script.stem}.yaml"
        listing = own.name if own.is_file() else "defaults.yaml"
        return (
            f"{key} is not a config key: {hint}hydra_config/{listing} lists every key "
            f"(a new key in an open dict such as model_config_overrides takes a '+': +{key}=...)"
        )
    if isinstance(error, MissingConfigException) and "primary config" in str(error):
        # The message names the search path; list the configs of the recipe's own config directory.
        found = re.search(r"provider=main, path=file://(\S+)", str(error))
        names = sorted(p.stem for p in Path(found.group(1)).glob("*.yaml")) if found else []
        names = [name for name in names if name != "defaults"]
        choices = f": choose one of {', '.join(names)}" if names else ""
        return f"--config-name {error.missing_cfg_file}: no such config in hydra_config/{choices}"
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override {error.override!r}: {_one_line(error.message)}"
    text = str(error)
    if cause is not None and str(cause) not in text:
        text += f" ({cause})"
    return _one_line(text)


# ------------------------------------------------------------------------------------------------ checking a config


def check_config(cfg: Any) -> None:
    """Fail, by name, on a ``???`` value nobody set and on an override whose type does not fit the config.

    Call it first in a ``@hydra.main`` function. The types come from the config composed without the command
    line's overrides: an integer, number, boolean or list there must stay one (null is always allowed).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    _check_override_types(cfg)
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        key = getattr(error, "full_key", None) or str(error)
        raise ConfigError(f"{key} has no value ('???' in the config): add {key}=<value> to the command") from None


_KINDS = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (list, "a list such as [1, 2]"))


def _expected_kind(value: Any) -> tuple[type, str] | None:
    for kind, words in _KINDS:
        if isinstance(value, kind):
            return kind, words
    return None


def _fits(value: Any, kind: type) -> bool:
    if value is None:
        return True
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _as_override(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, list)) else str(value)


def _check_override_types(cfg: Any) -> None:
    try:
        from hydra import compose
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import ListConfig, OmegaConf

        hydra_cfg = HydraConfig.get()
    except (ImportError, ValueError):  # not running under @hydra.main
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    last = {}  # the override of a key that wins: the last one
    for override in OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task)):
        last[override.key_or_group] = override
    overrides = [o for o in last.values() if o.type == OverrideType.CHANGE and o.package is None]
    if not overrides:
        return
    try:
        base = compose(config_name=hydra_cfg.job.config_name, overrides=[])
    except Exception:  # a setup this check does not foresee must not stop a run that would work
        return
    for override in overrides:
        key = override.key_or_group
        try:
            default = OmegaConf.select(base, key, throw_on_resolution_failure=False, throw_on_missing=False)
        except Exception:  # an interpolation only Hydra's runtime resolves: nothing to compare with
            continue
        if isinstance(default, ListConfig):
            default = list(default)
        expected = _expected_kind(default)
        if expected is None:
            continue
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        if isinstance(value, ListConfig):
            value = list(value)
        if not _fits(value, expected[0]):
            raise ConfigError(
                f"{key}={override.get_value_element_as_str()} is not {expected[1]}: "
                f"give {key} {expected[1]} (the config's value is {_as_override(default)})"
            )
