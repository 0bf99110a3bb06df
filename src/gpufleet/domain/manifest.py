"""Manifests: a TOML plan of jobs and host policies, parsed into domain objects.

A manifest looks like this::

    schema_version = 1                 # required; this gpufleet reads version 1
    name = "lab-plan"                  # required; becomes every job's ``manifest``

    hyper_style = "dash"               # optional: how hyper.* become flags (see below)

    [defaults]                         # optional: any job field except ``name`` ...
    command = "python train.py --model {model} --seed {seed}"
    seed = 0                           # ... plus template variables (scalars or arrays)

    [hosts.office-pc]                  # optional: one table per host
    priority = 0                       # higher is preferred
    allow_jobs = ["gbt", "mlp"]        # absent: the host may run everything
    deny_jobs = []
    cuda = false                       # declared capability: cuda, gpus, vram_gib, ram_gib

    [[jobs]]                           # one table per job
    name = "mlp-realistic"
    model = "mlp"
    hyper.epochs = 60

Job fields override ``[defaults]``; the ``hyper``, ``env`` and ``labels`` tables are merged
key by key (the job wins). A job may override a variable declared in ``[defaults]``. A
top-level ``hyper_style`` is the plan's default for it, below ``[defaults]``.

A string ``command`` is a template: ``{model}``, ``{mode}``, ``{name}``, every variable and
``{manifest_dir}`` are substituted shell-quoted, then the line is split into argv. An array
``command`` is argv as written (each element formatted, unquoted). With ``shell = true`` the
formatted string is handed to a shell as it is.

Unknown keys are errors (with a "did you mean"), types are strict, and every problem raises
:class:`~gpufleet.errors.ManifestError` naming the file, the job or host, and the field.
Pure: no file or network I/O and no clock; the caller reads the file.
"""

from __future__ import annotations

import copy
import difflib
import re
import shlex
import string
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from gpufleet.domain.environments import EnvRequest
from gpufleet.domain.limits import MAX_ARG, MAX_NAME, SCHEMA_VERSION
from gpufleet.domain.manifest_values import (
    _ALIASES,
    _DECLARED_FIELDS,
    _ENV_FIELDS,
    _HOST_FIELDS,
    _JOB_FIELDS,
    _REQUIREMENT_FIELDS,
    _SPEC_FIELDS,
    _hyper_style,
    _kind,
    _name,
    _show,
    _unknown,
    _variable,
    _Where,
    _wrong_type,
)
from gpufleet.domain.models import (
    DeclaredCapability,
    HostPolicy,
    JobSpec,
    Requirements,
    is_gpu_label,
)
from gpufleet.domain.retries import exit_codes_problem

_TOP_KEYS = ("schema_version", "name", "hyper_style", "defaults", "hosts", "jobs")
_MERGED_TABLES = ("hyper", "env", "labels")
_RESERVED_VARIABLES = ("manifest_dir",)
_FORMATTER = string.Formatter()
_WIDE_SPEC = re.compile(r"\d{5,}")
_CONVERSIONS: dict[str, Callable[[object], str]] = {"r": repr, "s": str, "a": ascii}


@dataclass(frozen=True)
class Plan:
    """A parsed manifest: its name, the path it came from, host policies and jobs in order."""

    name: str
    path: str
    hosts: tuple[HostPolicy, ...]
    jobs: tuple[JobSpec, ...]


# ---- top level -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Defaults:
    fields: dict[str, Any]
    variables: dict[str, Any]


@dataclass(frozen=True)
class _Context:
    file: str
    manifest: str
    defaults: _Defaults
    base_dir: str | None


def parse_manifest(text: str, path: str = "<manifest>", *, base_dir: str | None = None) -> Plan:
    """Parse manifest ``text`` (read from ``path``; ``base_dir`` fills ``{manifest_dir}``).

    Raises :class:`ManifestError` on any problem, naming the file, the job and the field.
    """
    data = _load(text, path)
    top = _Where(path)
    _check_top_level(data, top)
    name = _name(data["name"], top, "name")
    defaults = _parse_defaults(data.get("defaults", {}), top, _template_names(_raw_commands(data)))
    if "hyper_style" in data and "hyper_style" not in defaults.fields:
        defaults.fields["hyper_style"] = _hyper_style(data["hyper_style"], top, "hyper_style")
    hosts = _parse_hosts(data.get("hosts", {}), top)
    jobs = _parse_jobs(data.get("jobs", []), _Context(path, name, defaults, base_dir))
    return Plan(name=name, path=path, hosts=hosts, jobs=jobs)


def _load(text: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, and int() refusing a huge literal
        _Where(path).fail(None, f"invalid TOML: {exc}")
    except RecursionError:
        _Where(path).fail(None, "invalid TOML: nested too deeply")


def _check_top_level(data: dict[str, Any], where: _Where) -> None:
    if "schema_version" not in data:
        where.fail("schema_version", f"missing (add schema_version = {SCHEMA_VERSION} at the top)")
    version = data["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:  # true == 1 is not a version
        shown = _show(version) or _kind(version)
        where.fail(
            "schema_version",
            f"unsupported schema_version {shown} (this gpufleet reads {SCHEMA_VERSION})",
        )
    for key in data:
        if key not in _TOP_KEYS:
            hint = "expected one of " + ", ".join(_TOP_KEYS)
            _unknown(where, key, _TOP_KEYS, "top-level key", hint)
    if "name" not in data:
        where.fail("name", 'missing (add name = "..." naming the plan)')


def _table(value: Any, where: _Where, field: str | None, expected: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _wrong_type(value, where, field, expected)
    return value


# ---- defaults --------------------------------------------------------------------------


def _raw_commands(data: dict[str, Any]) -> list[str]:
    """Every command string in the file, before validation (to see which variables are used)."""
    jobs = data.get("jobs")
    tables = [data.get("defaults"), *(jobs if isinstance(jobs, list) else [])]
    found: list[str] = []
    for table in tables:
        command = table.get("command") if isinstance(table, dict) else None
        if isinstance(command, str):
            found.append(command)
        elif isinstance(command, list):
            found.extend(item for item in command if isinstance(item, str))
    return found


def _template_names(commands: Iterable[str]) -> set[str]:
    names: set[str] = set()
    for command in commands:
        try:
            names.update(field for _, field, _, _ in _FORMATTER.parse(command) if field)
        except ValueError:
            continue  # reported later, for the job that uses it
    return names


def _parse_defaults(raw: Any, top: _Where, used: Collection[str]) -> _Defaults:
    table = _table(raw, top, "defaults", "a table ([defaults])")
    where = _Where(top.file, "[defaults]")
    fields: dict[str, Any] = {}
    variables: dict[str, Any] = {}
    for key, value in table.items():
        if key == "name":
            where.fail(key, "a job name cannot have a default; set it in each [[jobs]]")
        if _ALIASES.get(key, key) in _JOB_FIELDS:
            _set_field(fields, key, value, where)
        else:
            _check_variable_name(key, where, used)
            variables[key] = _variable(value, where, key)
    return _Defaults(fields, variables)


_GPU_FIELDS = ("require_cuda", "prefer_cuda", "gpu_count", "min_vram_gib", "gpu_name")


def _check_variable_name(key: str, where: _Where, used: Collection[str]) -> None:
    """A variable is any extra key; one that looks like a misspelt field must be used."""
    if key in _RESERVED_VARIABLES:
        where.fail(key, f"{key} is a builtin template variable and cannot be set")
    known = [*_JOB_FIELDS, *_ALIASES]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if key not in used and is_gpu_label(key):
        # A GPU requirement under a wrong name would quietly send GPU jobs to CPUs.
        where.fail(
            key,
            "unknown field that reads like a GPU requirement; GPU fields are "
            + ", ".join(f'"{f}"' for f in _GPU_FIELDS)
            + " (a template variable must be used in a command)",
        )
    if close and key not in used:
        where.fail(
            key,
            f'unknown field (did you mean "{close[0]}"?); a template variable this close '
            "to a field name must be used in a command",
        )


def _set_field(fields: dict[str, Any], key: str, value: Any, where: _Where) -> None:
    target = _ALIASES.get(key, key)
    if target in fields:
        where.fail(key, f'"{key}" and "{target}" are the same field; set only one')
    fields[target] = _JOB_FIELDS[target](value, where, key)


# ---- hosts -----------------------------------------------------------------------------


def _parse_hosts(raw: Any, top: _Where) -> tuple[HostPolicy, ...]:
    hosts = _table(raw, top, "hosts", "a table of host tables ([hosts.NAME])")
    return tuple(_parse_host(name, table, top.file) for name, table in hosts.items())


def _parse_host(name: str, raw: Any, file: str) -> HostPolicy:
    where = _Where(file, f'host "{name}"', host=name)
    if not name.strip() or len(name) > MAX_NAME:
        where.fail(None, f"a host name must be 1 to {MAX_NAME} characters")
    table = _table(raw, where, None, f'a table ([hosts."{name}"])')
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _HOST_FIELDS:
            _unknown(where, key, _HOST_FIELDS, "host key", "expected " + ", ".join(_HOST_FIELDS))
        values[key] = _HOST_FIELDS[key](value, where, key)
    declared = DeclaredCapability(**{k: values.pop(k) for k in _DECLARED_FIELDS if k in values})
    return HostPolicy(name=name, declared=declared, **values)


# ---- jobs ------------------------------------------------------------------------------


def _parse_jobs(raw: Any, ctx: _Context) -> tuple[JobSpec, ...]:
    if not isinstance(raw, list):
        _wrong_type(raw, _Where(ctx.file), "jobs", "an array of tables ([[jobs]])")
    jobs = tuple(_parse_job(index, item, ctx) for index, item in enumerate(raw))
    seen: dict[str, int] = {}
    for index, job in enumerate(jobs):
        if job.name in seen:
            where = _job_where(ctx.file, index, job.name)
            where.fail("name", f'duplicate job name "{job.name}" (also jobs[{seen[job.name]}])')
        seen[job.name] = index
    return jobs


def _job_where(file: str, index: int, name: Any) -> _Where:
    if isinstance(name, str) and name.strip() and len(name) <= MAX_NAME:
        return _Where(file, f'job "{name}" (jobs[{index}])', job=name)
    return _Where(file, f"jobs[{index}]")


def _parse_job(index: int, raw: Any, ctx: _Context) -> JobSpec:
    where = _job_where(ctx.file, index, raw.get("name") if isinstance(raw, dict) else None)
    table = _table(raw, where, None, "a table ([[jobs]])")
    fields, overrides = _job_fields(table, where, ctx.defaults.variables)
    if "name" not in fields:
        where.fail("name", 'missing (every job needs name = "...")')
    merged = _merge(ctx.defaults.fields, fields)
    variables = {**ctx.defaults.variables, **overrides}
    command = _build_command(merged, variables, where, ctx.base_dir)
    requirements = Requirements(**{k: merged[k] for k in _REQUIREMENT_FIELDS if k in merged})
    problem = requirements.contradiction()
    if problem:
        where.fail("cpu_only", problem)
    problem = exit_codes_problem(merged.get("retry_on", ()), merged.get("no_retry_on", ()))
    if problem:
        where.fail("no_retry_on", problem)
    spec = {k: merged[k] for k in _SPEC_FIELDS if k in merged and k != "command"}
    spec["inputs"] = spec.pop("packages", ()) + spec.pop("inputs", ())
    env = {("with_" if k == "with" else k): merged[k] for k in _ENV_FIELDS if k in merged}
    if env:  # its files are uploaded by the client, as packages are
        spec["environment"] = EnvRequest(**env)
    return JobSpec(
        name=fields["name"],
        command=command,
        requirements=requirements,
        manifest=ctx.manifest,
        vars=copy.deepcopy(variables),
        **spec,
    )


def _job_fields(
    table: dict[str, Any], where: _Where, variables: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a job table into checked fields and variable overrides; refuse anything else."""
    fields: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for key, value in table.items():
        if _ALIASES.get(key, key) in _JOB_FIELDS:
            _set_field(fields, key, value, where)
        elif key in variables:
            overrides[key] = _variable(value, where, key)
        else:
            hint = "template variables must first be declared in [defaults]"
            _unknown(where, key, [*_JOB_FIELDS, *_ALIASES, *variables], "field", hint)
    return fields, overrides


def _merge(defaults: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    merged = {**defaults, **job}
    for key in _MERGED_TABLES:
        if key in defaults and key in job:
            merged[key] = {**defaults[key], **job[key]}
    return copy.deepcopy(merged)  # jobs must not share mutable tables


# ---- commands --------------------------------------------------------------------------


def _build_command(
    merged: dict[str, Any], variables: dict[str, Any], where: _Where, base_dir: str | None
) -> tuple[str, ...]:
    template = merged.get("command")
    if template is None:
        where.fail("command", "missing (set command in the job or in [defaults])")
    values = _template_values(merged, variables, base_dir)
    if isinstance(template, tuple):
        if merged.get("shell", False):
            where.fail("command", "shell = true needs a command string, not an array")
        argv = tuple(_render(item, values, where, quote=False) for item in template)
    elif merged.get("shell", False):
        argv = (_render(template, values, where, quote=False),)
    else:
        argv = _split(_render(template, values, where, quote=True), where)
    for arg in argv:
        if len(arg) > MAX_ARG:
            where.fail("command", f"an argument is longer than {MAX_ARG} characters")
    return argv


def _template_values(
    merged: dict[str, Any], variables: dict[str, Any], base_dir: str | None
) -> dict[str, Any]:
    values = dict(variables)
    for key in ("model", "mode", "name"):
        if merged.get(key) is not None:
            values[key] = merged[key]
    if base_dir is not None:
        values["manifest_dir"] = base_dir
    return values


def _render(template: str, values: dict[str, Any], where: _Where, *, quote: bool) -> str:
    try:
        pieces = list(_FORMATTER.parse(template))
    except ValueError as exc:
        where.fail("command", f"bad template {_show(template)}: {exc}")
    out: list[str] = []
    for literal, field, spec, conversion in pieces:
        out.append(literal)
        if field is not None:
            out.append(_substitute(field, spec or "", conversion, values, where, quote=quote))
    return "".join(out)


def _substitute(
    field: str,
    spec: str,
    conversion: str | None,
    values: dict[str, Any],
    where: _Where,
    *,
    quote: bool,
) -> str:
    if field not in values:
        _unknown_variable(field, values, where)
    value = values[field]
    items = value if isinstance(value, list) else [value]
    texts = [_format_one(field, item, spec, conversion, where) for item in items]
    return " ".join(shlex.quote(text) if quote else text for text in texts)


def _unknown_variable(field: str, values: Mapping[str, Any], where: _Where) -> NoReturn:
    if field == "manifest_dir":
        where.fail("command", "{manifest_dir} needs the manifest's directory (pass base_dir)")
    close = difflib.get_close_matches(field, list(values), n=1)
    hint = f"did you mean {{{close[0]}}}?" if close else "known: " + ", ".join(sorted(values))
    where.fail("command", f"unknown template variable {{{field}}} ({hint})")


def _format_one(field: str, value: Any, spec: str, conversion: str | None, where: _Where) -> str:
    if _WIDE_SPEC.search(spec):
        where.fail("command", f"format spec {spec!r} of {{{field}}} is too wide")
    if conversion is not None and conversion not in _CONVERSIONS:
        where.fail("command", f"unknown conversion !{conversion} in {{{field}}}")
    if conversion is None and isinstance(value, bool) and not spec:
        return "true" if value else "false"  # as written in TOML
    if conversion is not None:
        value = _CONVERSIONS[conversion](value)
    try:
        return format(value, spec)
    except (ValueError, TypeError, OverflowError) as exc:
        where.fail("command", f"cannot format {{{field}}} with {spec!r}: {exc}")


def _split(line: str, where: _Where) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(line))
    except ValueError as exc:
        where.fail("command", f"cannot split {_show(line)} into arguments: {exc}")
    if not argv:
        where.fail("command", "is empty after templating")
    return argv
