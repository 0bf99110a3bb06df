"""SLEAP on the fleet, the pure part: what a training package's script and configs say,
and sleap-nn's own progress channels as gpufleet progress records.

A SLEAP GUI exports a training package: a zip with the labels (``*.pkg.slp``), one
sleap-nn config per model, and ``train-script.sh`` with one line per model, like::

    sleap train --config-name centroid.yaml --config-dir . \\
        'trainer_config.ckpt_dir="models"' 'trainer_config.run_name="260825.centroid.n=145"'

Each such line becomes one job that runs ``sleap-nn train`` with the same arguments. While
it trains, sleap-nn publishes JSON messages over ZMQ (``train_begin``, ``epoch_end`` with
its logs, ``batch_end``, ...); ``sleap-nn track --gui`` prints JSON progress lines. This
module turns both into progress records (see :mod:`gpufleet.domain.progress`). No I/O
here: the callers read the zip, the YAML and the sockets.
"""

from __future__ import annotations

import csv
import io
import json
import math
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.domain import progress
from gpufleet.errors import PackageError

SCRIPT = "train-script.sh"
#: The commands a train-script line may start with; all run as ``sleap-nn train``.
TRAIN_COMMANDS = (("sleap", "train"), ("sleap-nn", "train"), ("sleap-train",))
TOOL = "sleap-nn"
#: sleap-nn's model types: the keys of ``model_config.head_configs``.
MODEL_TYPES = (
    "single_instance",
    "centroid",
    "centered_instance",
    "bottomup",
    "multi_class_bottomup",
    "multi_class_topdown",
)
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
# sleap-nn train's options that take values (kept as they are, never read as a config)
_VALUE_OPTIONS = {"--video-paths": 1, "--video-path-map": 2, "--prefix-map": 2, "--video-config": 1}
_CONFIG_OPTIONS = {"--config-name": "name", "-c": "name", "--config-dir": "dir", "-d": "dir"}
CKPT_DIR = "trainer_config.ckpt_dir"
RUN_NAME = "trainer_config.run_name"
MAX_EPOCHS = "trainer_config.max_epochs"
PUBLISH_PORT = "trainer_config.zmq.publish_port"
CONTROLLER_PORT = "trainer_config.zmq.controller_port"
STOP = {"command": "stop"}
#: What a training whose run folder the fleet keeps is given: checkpoints on, ``last.ckpt``
#: written at the end of every epoch, and on a resumed attempt the restored one to go on from.
SAVE_CKPT = "trainer_config.save_ckpt"
SAVE_LAST = "trainer_config.model_ckpt.save_last"
RESUME = "trainer_config.resume_ckpt_path"
LAST_CKPT = "last.ckpt"
BEST_CKPT = "best.ckpt"
TRAINING_LOG = "training_log.csv"
#: Shell words that would make a train line more than one command: not run, refused.
SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1"})
#: epoch_end log keys and the metric names they are plotted under
PLOTTED = {"loss": "loss", "val/loss": "val_loss", "train/loss": "loss", "val_loss": "val_loss"}


@dataclass(frozen=True)
class TrainLine:
    """One model's line of ``train-script.sh``: the arguments after ``train``."""

    number: int  # the line in the script (1-based; the first line of a continued one)
    args: tuple[str, ...]
    config: str  # the config file, relative to the package root ("centroid.yaml")
    env: tuple[tuple[str, str], ...] = ()  # VAR=value words before the command

    def value(self, key: str) -> str | None:
        """The value the line's last Hydra override of ``key`` gives (its quotes
        removed), or None when it sets none."""
        return override_value(self.args, key)


def override_key(arg: str) -> str | None:
    """The key a Hydra override sets (``++a.b=1`` sets ``a.b``); None for other args."""
    if arg.startswith("-") or "=" not in arg:
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def override_value(args: Sequence[str], key: str) -> str | None:
    """The value the last Hydra override of ``key`` in ``args`` gives (quotes removed),
    or None when none sets it."""
    found = None
    for arg in args:
        if override_key(arg) == key:
            found = _unquote(arg.split("=", 1)[1])
    return found


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        inner = value[1:-1]
        return inner.replace("\\" + value[0], value[0]).replace("\\\\", "\\")
    return value


def hydra_quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value (a run name may hold ``=``)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def with_override(args: Sequence[str], key: str, value: str) -> list[str]:
    """``args`` with every override of ``key`` replaced by one ``++key=value`` at the end
    (``++`` adds the key where the config has none, and overrides it where it has)."""
    return [a for a in args if override_key(a) != key] + [f"++{key}={value}"]


def kept_args(args: Sequence[str], resume_from: str | None) -> list[str]:
    """``args`` of a training whose run folder the fleet keeps: sleap-nn saves its
    checkpoints and a ``last.ckpt`` every epoch, and, given ``resume_from`` (the restored
    ``last.ckpt``), continues from it (``trainer_config.resume_ckpt_path``)."""
    out = with_override(args, SAVE_CKPT, "true")
    out = with_override(out, SAVE_LAST, "true")
    if resume_from is not None:
        out = with_override(out, RESUME, hydra_quoted(resume_from))
    return out


def merged_log(earlier: str, later: str) -> str:
    """One ``training_log.csv`` from the log of the attempts before a resume and the one a
    resumed sleap-nn wrote afresh: the earlier rows of epochs before the later log's first,
    then the later rows, under the later log's columns (the earlier's when it has none).
    sleap-nn numbers epochs from 0 and goes on from the resumed epoch's number."""
    old, new = csv.DictReader(io.StringIO(earlier)), csv.DictReader(io.StringIO(later))
    old_rows, new_rows = list(old), list(new)
    columns = list(new.fieldnames or old.fieldnames or [])
    first = min((e for r in new_rows if (e := _epoch(r)) is not None), default=None)
    kept = [r for r in old_rows if first is None or (_epoch(r) or 0) < first]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    if columns:
        writer.writeheader()
    writer.writerows([*kept, *new_rows])
    return out.getvalue()


def _epoch(row: Mapping[str, Any]) -> int | None:
    value = row.get("epoch")
    try:
        return int(float(value)) if isinstance(value, str) and value else None
    except ValueError:
        return None


def parse_train_script(text: str, where: str = SCRIPT) -> list[TrainLine]:
    """The train lines of a package's script, in order. Other lines (a shebang, comments,
    ``set -e``) are passed over. Raises :class:`PackageError` for a line that cannot be
    split, names no config, or places it outside the package; and when there is no train
    line at all."""
    found = []
    for number, env, words in _commands(text, where):
        rest = _after_train(words)
        said = f"{where}, line {number}"
        if rest is None:
            if "train" in words and any("sleap" in w for w in words):
                forms = ", ".join(" ".join(c) for c in TRAIN_COMMANDS)
                raise PackageError(f"{said}: a train command gpufleet does not read; use {forms}")
            continue
        if shell := sorted(SHELL_OPERATORS.intersection(rest)):
            raise PackageError(
                f"{said}: {' '.join(shell)} makes it more than one command; give each model "
                "one plain sleap train line"
            )
        found.append(TrainLine(number, tuple(rest), config_of(rest, said), env))
    if not found:
        commands = ", ".join(" ".join(c) for c in TRAIN_COMMANDS)
        raise PackageError(f"{where}: no train line (a line starting with {commands})")
    return found


def _commands(text: str, where: str) -> list[tuple[int, tuple[tuple[str, str], ...], list[str]]]:
    """Each logical line of a script as (its number, its ``VAR=value`` prefix, its words).
    Raises :class:`PackageError` for a line that cannot be split."""
    out = []
    for number, line in _logical_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise PackageError(f"{where}, line {number}: cannot be read ({exc})") from None
        out.append((number, *_env_prefix(words)))
    return out


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with their numbers, a line ending in a backslash joined to the next."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        start, held = pending if pending is not None else (number, "")
        line = held + raw
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending = (start, line[:-1] + " ")
            continue
        pending = None
        out.append((start, line))
    if pending is not None:
        out.append(pending)
    return out


def _env_prefix(words: list[str]) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """``VAR=value`` words before a command (the shell's way to set its environment)."""
    env = []
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words[0].split("=", 1)
        env.append((name, value))
        words = words[1:]
    return tuple(env), words


def _after_train(words: list[str]) -> list[str] | None:
    for command in TRAIN_COMMANDS:
        if tuple(words[: len(command)]) == command:
            return words[len(command) :]
    return None


def config_of(args: Sequence[str], where: str) -> str:
    """The config file a train line's arguments name, relative to the package root."""
    name = folder = path = None
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        if flag in _CONFIG_OPTIONS or flag == "--config":
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
            if value is None:
                raise PackageError(f"{where}: {flag} has no value")
            if flag == "--config":
                path = value
            elif _CONFIG_OPTIONS[flag] == "name":
                name = value
            else:
                folder = value
            i += 1 if eq else 2
            continue
        if flag in _VALUE_OPTIONS:
            i += 1 if eq else 1 + _VALUE_OPTIONS[flag]
            continue
        named = not arg.startswith("-") and override_key(arg) is None
        if path is None and named and arg.lower().endswith(CONFIG_SUFFIXES):
            path = arg
        i += 1
    if path is None and name is not None:
        path = posixpath.join(folder or ".", name)
    if path is None:
        raise PackageError(f"{where}: names no config (--config-name NAME.yaml)")
    return inside_package(path, f"{where}: {path}")


def inside_package(path: str, what: str) -> str:
    """``path`` normalized, if it stays inside the package (the job's directory); else
    :class:`PackageError` saying ``what`` is not."""
    normal = posixpath.normpath(path)
    if posixpath.isabs(normal) or normal == ".." or normal.startswith("../"):
        raise PackageError(f"{what} is not inside the package")
    return normal


#: The commands a track line of an inference package may start with; all run as
#: ``sleap-nn track``.
TRACK_COMMANDS = (("sleap-nn", "track"), ("sleap", "track"), ("sleap-track",))
#: The scripts an inference package may hold its track lines in: sleap-rtc's, then SLEAP's.
TRACK_SCRIPTS = ("track-script.sh", "inference-script.sh")
_TRACK_OPTIONS = {
    "--data_path": "data",
    "-i": "data",
    "--model_paths": "model",
    "-m": "model",
    "-o": "output",
    "--output_path": "output",
}


@dataclass(frozen=True)
class TrackLine:
    """One ``sleap-nn track`` line of an inference package's script."""

    number: int
    data: str | None  # as the line names it (SLEAP writes the exporting machine's path)
    models: tuple[str, ...]
    output: str | None
    args: tuple[str, ...]  # the rest (--batch_size 4, --tracking, ...): passed on


def parse_track_script(text: str, where: str) -> list[TrackLine]:
    """The track lines of an inference package's script, in order (other lines are passed
    over; none at all is an empty list). Raises :class:`PackageError` for a line that
    cannot be split or chains commands."""
    found = []
    for number, _, words in _commands(text, where):
        rest = next((words[len(c) :] for c in TRACK_COMMANDS if tuple(words[: len(c)]) == c), None)
        if rest is None:
            continue
        said = f"{where}, line {number}"
        if shell := sorted(SHELL_OPERATORS.intersection(rest)):
            raise PackageError(f"{said}: {' '.join(shell)} makes it more than one command")
        found.append(_track_line(number, rest, said))
    return found


def _track_line(number: int, args: Sequence[str], said: str) -> TrackLine:
    named: dict[str, list[str]] = {"data": [], "model": [], "output": []}
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        if flag in _TRACK_OPTIONS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
            if value is None:
                raise PackageError(f"{said}: {flag} has no value")
            named[_TRACK_OPTIONS[flag]].append(value)
            i += 1 if eq else 2
            continue
        if i == 0 and not args[i].startswith("-"):  # `sleap track DATA -m ...` (SLEAP 1.4)
            named["data"].append(args[i])
        elif args[i] != "--gui":  # gpufleet adds its own
            rest.append(args[i])
        i += 1
    if len(named["data"]) > 1:
        raise PackageError(f"{said}: names {len(named['data'])} data files; give one a line")
    data = named["data"][0] if named["data"] else None
    output = named["output"][-1] if named["output"] else None
    return TrackLine(number, data, tuple(named["model"]), output, tuple(rest))


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]*(?:Error|Exception|Interrupt)\b|Error\b|CUDA error)")


def error_line(lines: Sequence[str]) -> str | None:
    """What a failed sleap-nn run said went wrong, from the last lines of its stderr: the
    last exception line (``RuntimeError: CUDA out of memory...``) or logged ERROR, else its
    last line. None when it printed nothing."""
    said = [line.strip() for line in lines if line.strip()]
    for line in reversed(said):
        if _ERROR_LINE.match(line) or "| ERROR" in line:
            return line
    return said[-1] if said else None


@dataclass(frozen=True)
class ConfigFacts:
    """What gpufleet reads of one sleap-nn config."""

    model_type: str | None
    max_epochs: int | None
    train_labels: tuple[str, ...]
    val_labels: tuple[str, ...]
    ckpt_dir: str | None
    run_name: str | None


def config_facts(cfg: Any, where: str) -> ConfigFacts:
    """The facts of a parsed config (YAML loaded by the caller). Raises
    :class:`PackageError` when it is not a sleap-nn config."""
    if not isinstance(cfg, Mapping):
        raise PackageError(f"{where}: not a sleap-nn config (a YAML mapping)")
    model = _section(cfg, "model_config")
    heads = _section(model, "head_configs")
    if not model or not heads:
        raise PackageError(f"{where}: not a sleap-nn config (no model_config.head_configs)")
    chosen = [k for k in MODEL_TYPES if heads.get(k) is not None]
    data, trainer = _section(cfg, "data_config"), _section(cfg, "trainer_config")
    epochs = trainer.get("max_epochs")
    return ConfigFacts(
        model_type=chosen[0] if len(chosen) == 1 else None,
        max_epochs=epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None,
        train_labels=_paths(data.get("train_labels_path")),
        val_labels=_paths(data.get("val_labels_path")),
        ckpt_dir=_text(trainer.get("ckpt_dir")),
        run_name=_text(trainer.get("run_name")),
    )


def _section(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = cfg.get(key)
    return value if isinstance(value, Mapping) else {}


def _paths(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str) and v)
    return ()


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value and value != "None" else None


def model_type_of(config: str, facts: ConfigFacts | None = None) -> str:
    """The model type a config trains: from its heads, else from its file name."""
    if facts is not None and facts.model_type:
        return facts.model_type
    stem = posixpath.basename(config).rsplit(".", 1)[0]
    return stem if stem in MODEL_TYPES else "model"


# ---- progress ----------------------------------------------------------------------------


def message(text: str | bytes) -> dict[str, Any] | None:
    """One sleap-nn ZMQ message (jsonpickle's JSON of a dict), or None if it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class TrainProgress:
    """sleap-nn's training messages as progress records: each ``epoch_end`` one record
    (epoch, epochs, loss, val_loss, and the rest of its logs as metrics), batch events at
    most one every ``every`` seconds (where training is within the epoch), and a message at
    the start and the end."""

    def __init__(self, epochs: int | None, every: float = 1.0) -> None:
        self.epochs = epochs
        self.every = every
        self.last_batch = -math.inf
        self.epoch = 0  # epochs finished

    def record(self, msg: Mapping[str, Any], now: float) -> dict[str, Any] | None:
        """The record for ``msg`` (``now``: seconds on any steady clock), or None."""
        event = msg.get("event")
        if event == "train_begin":
            return checked({"message": "training started", "epochs": self.epochs})
        if event == "train_end":
            return checked({"message": "training ended", "epoch": self.epoch})
        if event == "epoch_end":
            return self._epoch_end(msg)
        if event == "batch_end" and now - self.last_batch >= self.every:
            self.last_batch = now
            # the epoch under way, as sleap-nn counts it: right from a resumed run's start
            self.epoch = _count(msg.get("epoch")) or self.epoch
            batch = _count(msg.get("batch"))
            said = f"epoch {self.epoch + 1}" + (f"/{self.epochs}" if self.epochs else "")
            return checked(
                {
                    "epoch": self.epoch,
                    "epochs": self.epochs,
                    "step": None if batch is None else batch + 1,
                    "message": said + ("" if batch is None else f", batch {batch + 1}"),
                }
            )
        return None

    def _epoch_end(self, msg: Mapping[str, Any]) -> dict[str, Any] | None:
        epoch = _count(msg.get("epoch"))
        self.epoch = self.epoch + 1 if epoch is None else epoch + 1
        logs = msg.get("logs")
        logs = logs if isinstance(logs, Mapping) else {}
        out: dict[str, Any] = {"epoch": self.epoch, "epochs": self.epochs}
        numbers = {k: v for k, v in logs.items() if isinstance(k, str) and progress.is_number(v)}
        # sleap-nn's names first (loss, val/loss), then the rest under their own names
        for key in (*PLOTTED, *numbers):
            name = PLOTTED.get(key, key)
            if key in numbers and name not in progress.KNOWN and name not in out:
                out[name] = numbers[key]
            if len(out) >= progress.MAX_METRICS:
                break
        return checked(out)


def checked(record: dict[str, Any]) -> dict[str, Any] | None:
    """``record`` (its None values left out) in its stored form, or None if it is not a
    record: a tool's odd message never stops the relay."""
    try:
        return progress.check({k: v for k, v in record.items() if v is not None})
    except progress.BadProgress:
        return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def track_record(line: str) -> dict[str, Any] | None:
    """A ``sleap-nn track --gui`` progress line (``{"n_processed", "n_total", "rate",
    "eta"}``) as a record, or None when the line is not one."""
    if not line.startswith("{") or '"n_processed"' not in line:
        return None
    value = message(line)
    if value is None or _count(value.get("n_processed")) is None:
        return None
    done, total = value["n_processed"], _count(value.get("n_total"))
    record: dict[str, Any] = {"step": done, "steps": total}
    if total:
        record["progress"] = min(1.0, done / total)
    for key, name in (("eta", "eta_s"), ("rate", "frames_per_s")):
        n: Any = value.get(key)
        if progress.is_number(n) and math.isfinite(float(n)) and float(n) >= 0:
            record[name] = float(n)
    return checked(record)


# ---- a plain labels file -----------------------------------------------------------------

#: The heads ``--model-type`` trains without a config of the user's: sleap-nn's own
#: defaults fill what these leave out (part names, edges and anchor from the skeleton).
DEFAULT_HEADS: dict[str, dict[str, Any]] = {
    "single_instance": {"confmaps": {"part_names": None, "sigma": 5.0, "output_stride": 2}},
    "centroid": {"confmaps": {"anchor_part": None, "sigma": 5.0, "output_stride": 2}},
    "centered_instance": {
        "confmaps": {"part_names": None, "anchor_part": None, "sigma": 5.0, "output_stride": 2}
    },
    "bottomup": {
        "confmaps": {"part_names": None, "sigma": 5.0, "output_stride": 4, "loss_weight": 1.0},
        "pafs": {"edges": None, "sigma": 15.0, "output_stride": 8, "loss_weight": 1.0},
    },
}


def default_config(model_type: str) -> dict[str, Any]:
    """A sleap-nn config that trains ``model_type`` (one of :data:`DEFAULT_HEADS`) with a
    UNet and sleap-nn's defaults for the rest; the labels are set by :func:`on_labels`."""
    if model_type not in DEFAULT_HEADS:
        known = ", ".join(DEFAULT_HEADS)
        raise PackageError(
            f"--model-type {model_type}: gpufleet has no default config for it ({known}); "
            "give one with --config"
        )
    return {
        "data_config": {"validation_fraction": 0.1},
        "model_config": {
            "backbone_config": {"unet": {"filters": 32, "filters_rate": 1.5, "max_stride": 16}},
            "head_configs": {model_type: DEFAULT_HEADS[model_type]},
        },
        "trainer_config": {"max_epochs": 200, "save_ckpt": True},
    }


def on_labels(cfg: Mapping[str, Any], labels: str, where: str) -> dict[str, Any]:
    """``cfg`` (a parsed sleap-nn config) training on ``labels`` alone: its
    ``data_config.train_labels_path`` replaced. A config naming validation labels is
    refused (only ``labels`` is sent; ``validation_fraction`` splits it)."""
    facts = config_facts(cfg, where)
    if facts.model_type is None:
        raise PackageError(f"{where}: trains no one model type (one of model_config.head_configs)")
    if facts.val_labels:
        raise PackageError(
            f"{where}: names validation labels ({', '.join(facts.val_labels)}); gpufleet sends "
            "one labels file: remove data_config.val_labels_path (validation_fraction splits it)"
        )
    data = dict(_section(cfg, "data_config"))
    data["train_labels_path"] = [labels]
    data["val_labels_path"] = None
    return {**cfg, "data_config": data}
