"""Manifest parsing: what a user writes in a TOML plan and what gpufleet makes of it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.domain.ids import manifest_job_id
from gpufleet.domain.manifest import Plan, parse_manifest
from gpufleet.domain.models import DeclaredCapability, HyperStyle
from gpufleet.errors import ManifestError
from gpufleet.wire import HostModel, JobSpecModel

EXAMPLE = """\
schema_version = 1
name = "lab-plan"
[defaults]
command = "python train.py --model {model} --mode {mode}"
seed = 0
[hosts.office-pc]
priority = 0
allow_jobs = ["gbt", "mlp"]
deny_jobs = []
[[jobs]]
name = "mlp-realistic"
model = "mlp"
mode = "realistic"
priority = 90
require_cuda = false
min_ram_gib = 4
hyper.epochs = 60
hyper.batch_size = 1024
[[jobs]]
name = "gru-realistic"
model = "gru"
mode = "realistic"
require_cuda = true
min_vram_gib = 2
"""

HEAD = 'schema_version = 1\nname = "p"\n'


def parse(text: str, **kwargs: Any) -> Plan:
    return parse_manifest(text, "lab.toml", **kwargs)


def error(text: str, **kwargs: Any) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        parse(text, **kwargs)
    assert str(info.value).startswith("lab.toml: ")
    return info.value


def one_job(body: str, defaults: str = 'command = "run {name}"') -> str:
    return f'{HEAD}[defaults]\n{defaults}\n[[jobs]]\nname = "j"\n{body}\n'


# ---- the example ---------------------------------------------------------------------


def test_example_parses_into_jobs_with_argv_requirements_and_hyper() -> None:
    plan = parse(EXAMPLE)

    assert (plan.name, plan.path) == ("lab-plan", "lab.toml")
    mlp, gru = plan.jobs
    assert mlp.command == ("python", "train.py", "--model", "mlp", "--mode", "realistic")
    assert gru.command == ("python", "train.py", "--model", "gru", "--mode", "realistic")
    assert (mlp.name, mlp.model, mlp.mode, mlp.manifest) == (
        "mlp-realistic",
        "mlp",
        "realistic",
        "lab-plan",
    )
    assert (mlp.priority, gru.priority) == (90, 0)
    assert list(mlp.hyper.items()) == [("epochs", 60), ("batch_size", 1024)]
    assert gru.hyper == {}
    assert mlp.vars == {"seed": 0} == gru.vars
    assert not mlp.requirements.require_cuda and mlp.requirements.min_ram_gib == 4.0
    assert gru.requirements.require_cuda and gru.requirements.min_vram_gib == 2.0


def test_example_jobs_and_hosts_are_valid_on_the_wire() -> None:
    plan = parse(EXAMPLE)

    for job in plan.jobs:
        assert JobSpecModel.from_domain(job).to_domain() == job
    for host in plan.hosts:
        assert HostModel.from_domain(host).to_domain() == host


def test_a_job_overrides_a_default_variable() -> None:
    text = one_job("seed = 7", defaults='command = "run --seed {seed}"\nseed = 0')
    text += '[[jobs]]\nname = "k"\n'

    first, second = parse(text).jobs

    assert (first.vars, first.command) == ({"seed": 7}, ("run", "--seed", "7"))
    assert (second.vars, second.command) == ({"seed": 0}, ("run", "--seed", "0"))


# ---- errors name the file, the job and the field --------------------------------------


def test_misspelt_job_field_is_an_error_with_a_suggestion() -> None:
    exc = error(EXAMPLE.replace("require_cuda = true", "require_cude = true"))

    assert exc.message == (
        'lab.toml: job "gru-realistic" (jobs[1]): field "require_cude": '
        'unknown field (did you mean "require_cuda"?)'
    )
    assert exc.detail == {"file": "lab.toml", "job": "gru-realistic", "field": "require_cude"}


def test_misspelt_field_in_defaults_is_not_taken_for_a_variable() -> None:
    exc = error(EXAMPLE.replace("seed = 0", "require_cude = true"))

    assert '[defaults]: field "require_cude"' in exc.message
    assert 'did you mean "require_cuda"?' in exc.message


def test_a_job_key_not_declared_in_defaults_is_unknown() -> None:
    exc = error(one_job("split_recipe = 3"))

    assert 'field "split_recipe": unknown field' in exc.message
    assert "[defaults]" in exc.message


def test_job_without_a_name_is_named_by_index() -> None:
    exc = error(f'{HEAD}[[jobs]]\nmodel = "x"\ncommand = "run"\n')

    assert exc.message.startswith('lab.toml: jobs[0]: field "name": missing')
    assert exc.detail == {"file": "lab.toml", "job": None, "field": "name"}


def test_unknown_host_key_names_host_and_key() -> None:
    exc = error(EXAMPLE.replace("deny_jobs = []", "deny_job = []"))

    assert exc.message == (
        'lab.toml: host "office-pc": field "deny_job": unknown host key (did you mean "deny_jobs"?)'
    )
    assert exc.detail["field"] == "deny_job" and exc.detail["host"] == "office-pc"


def test_unknown_top_level_key() -> None:
    exc = error(HEAD + 'job = "x"\n')

    assert 'field "job": unknown top-level key (did you mean "jobs"?)' in exc.message


def test_negative_vram_is_refused() -> None:
    exc = error(EXAMPLE.replace("min_vram_gib = 2", "min_vram_gib = -1"))

    assert exc.message.endswith('field "min_vram_gib": must be >= 0, got -1')
    assert exc.detail["job"] == "gru-realistic"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('require_cuda = "true"', "require_cuda"),
        ("require_cuda = 1", "require_cuda"),
        ("priority = true", "priority"),
        ("priority = 1.5", "priority"),
        ("min_ram_gib = true", "min_ram_gib"),
        ('gpus = "2"', "gpus"),
        ("max_attempts = 0", "max_attempts"),
        ("timeout = 0", "timeout"),
        ("env.X = 1", "env.X"),
        ('allowed_hosts = "a"', "allowed_hosts"),
        ("hyper = 3", "hyper"),
    ],
)
def test_wrong_types_and_ranges_are_refused(line: str, field: str) -> None:
    exc = error(one_job(line))

    assert f'job "j" (jobs[0]): field "{field}": ' in exc.message
    assert exc.detail == {"file": "lab.toml", "job": "j", "field": field}


def test_a_string_boolean_says_what_was_expected() -> None:
    exc = error(one_job('require_cuda = "true"'))

    assert exc.message.endswith('expected a boolean (true or false), got a string "true"')


def test_missing_schema_version() -> None:
    exc = error('name = "p"\n')

    assert 'field "schema_version": missing' in exc.message


@pytest.mark.parametrize("value", ["2", '"1"', "true", "1.0"])
def test_unsupported_schema_version(value: str) -> None:
    exc = error(f'schema_version = {value}\nname = "p"\n')

    assert "unsupported schema_version" in exc.message
    assert "(this gpufleet reads 1)" in exc.message


def test_unsupported_schema_version_message() -> None:
    exc = error('schema_version = 2\nname = "p"\n')

    assert exc.message == (
        'lab.toml: field "schema_version": unsupported schema_version 2 (this gpufleet reads 1)'
    )


def test_toml_syntax_error_gives_line_and_column() -> None:
    exc = error(HEAD + "[[jobs]]\nname = \n")

    assert exc.message.startswith("lab.toml: invalid TOML: ")
    assert "line 4" in exc.message
    assert exc.detail == {"file": "lab.toml", "job": None, "field": None}


def test_duplicate_job_names_name_both_indexes() -> None:
    text = one_job("") + '[[jobs]]\nname = "k"\n[[jobs]]\nname = "j"\n'

    exc = error(text)

    assert 'job "j" (jobs[2]): field "name": duplicate job name "j" (also jobs[0])' in exc.message


def test_missing_command() -> None:
    exc = error(f'{HEAD}[[jobs]]\nname = "j"\n')

    assert 'job "j" (jobs[0]): field "command": missing' in exc.message


def test_unknown_template_variable_names_job_field_and_variable() -> None:
    exc = error(one_job("", defaults='command = "run {sede}"\nseed = 1'))

    assert 'job "j" (jobs[0]): field "command": unknown template variable {sede}' in exc.message
    assert "did you mean {seed}?" in exc.message
    assert exc.detail == {"file": "lab.toml", "job": "j", "field": "command"}


@pytest.mark.parametrize("template", ["run {", "run }", "run {0}", "run {name!x}", "run 'x"])
def test_broken_templates_are_manifest_errors(template: str) -> None:
    exc = error(one_job("", defaults=f"command = {json.dumps(template)}"))

    assert exc.detail["field"] == "command"


def test_manifest_dir_is_filled_from_base_dir() -> None:
    text = one_job("", defaults='command = "python {manifest_dir}/train.py"')

    (job,) = parse(text, base_dir="/lab plans").jobs

    assert job.command == ("python", "/lab plans/train.py")
    assert job.vars == {}


def test_manifest_dir_without_base_dir_is_an_error() -> None:
    exc = error(one_job("", defaults='command = "python {manifest_dir}/train.py"'))

    assert "{manifest_dir}" in exc.message and "base_dir" in exc.message


def test_values_with_spaces_and_quotes_stay_one_argument() -> None:
    text = one_job(
        'data = "my data/it\'s here; rm -rf /"',
        defaults='command = "train --data {data} --name {name}"\ndata = ""',
    )

    (job,) = parse(text).jobs

    assert job.command == ("train", "--data", "my data/it's here; rm -rf /", "--name", "j")


def test_list_variable_becomes_several_arguments() -> None:
    text = one_job("", defaults='command = "train --hosts {hosts}"\nhosts = ["a b", "c"]')

    (job,) = parse(text).jobs

    assert job.command == ("train", "--hosts", "a b", "c")


def test_list_command_is_argv_as_written() -> None:
    (job,) = parse(one_job('command = ["run", "--name={name} x", "{{literal}}"]')).jobs

    assert job.command == ("run", "--name=j x", "{literal}")


def test_shell_command_is_one_string_unquoted() -> None:
    (job,) = parse(one_job('shell = true\ncommand = "echo {name} && ls | wc -l"')).jobs

    assert job.command == ("echo j && ls | wc -l",)
    assert job.shell


def test_gpus_is_an_alias_for_gpu_count_but_not_both() -> None:
    (job,) = parse(one_job("gpus = 2")).jobs
    assert job.requirements.gpu_count == 2

    exc = error(one_job("gpus = 2\ngpu_count = 1"))
    assert "set only one" in exc.message


def test_hosts_allow_deny_and_absent() -> None:
    text = (
        HEAD
        + "[hosts.office-pc]\nallow_jobs = ['gbt']\ndeny_jobs = ['gru']\npriority = 5\n"
        + "cuda = true\ngpus = 1\nvram_gib = 8\n"
        + "[hosts.laptop]\ndescription = 'old one'\n"
    )

    office, laptop = parse(text).hosts

    assert (office.name, office.allow_jobs, office.deny_jobs, office.priority) == (
        "office-pc",
        ("gbt",),
        ("gru",),
        5,
    )
    assert office.declared == DeclaredCapability(cuda=True, gpus=1, vram_gib=8.0)
    assert (laptop.allow_jobs, laptop.deny_jobs, laptop.description) == (None, (), "old one")
    assert laptop.declared == DeclaredCapability()


def test_hyper_env_and_labels_merge_with_defaults() -> None:
    defaults = (
        'command = "run"\nhyper = {lr = 0.1, epochs = 5}\nenv = {A = "1", B = "2"}\n'
        'labels = {site = "lab"}\npriority = 3'
    )
    body = 'hyper.epochs = 9\nhyper.dropout = 0.5\nenv.B = "3"\nlabels.zone = "x"'

    (job,) = parse(one_job(body, defaults=defaults)).jobs

    assert list(job.hyper.items()) == [("lr", 0.1), ("epochs", 9), ("dropout", 0.5)]
    assert job.env == {"A": "1", "B": "3"}
    assert job.requirements.labels == {"site": "lab", "zone": "x"}
    assert job.priority == 3


def test_manifest_job_id_is_stable_and_follows_hyper() -> None:
    first = [manifest_job_id(job) for job in parse(EXAMPLE).jobs]
    again = [manifest_job_id(job) for job in parse(EXAMPLE).jobs]
    changed = [manifest_job_id(job) for job in parse(EXAMPLE.replace("= 60", "= 61")).jobs]

    assert first == again
    assert len(set(first)) == 2
    assert changed[0] != first[0] and changed[1] == first[1]


# ---- properties ----------------------------------------------------------------------


def toml_str(text: str) -> str:
    """A TOML basic string (escapes quotes, backslashes and control characters)."""
    out = []
    for char in text:
        if char in '"\\' or ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_str(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return "{" + ", ".join(f"{toml_str(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def render(data: dict[str, Any]) -> str:
    return "".join(f"{toml_str(key)} = {toml_value(value)}\n" for key, value in data.items())


text_chars = st.characters(codec="utf-8")
names = st.text(text_chars, min_size=1, max_size=30).filter(lambda s: bool(s.strip()))
hyper_values = st.integers(-(2**63), 2**63 - 1) | st.text(text_chars, max_size=20)
hypers = st.dictionaries(st.text(text_chars, max_size=10), hyper_values, max_size=5)
quick = settings(max_examples=60, deadline=None, database=None)


@quick
@given(st.lists(st.tuples(names, hypers), max_size=4, unique_by=lambda job: job[0]))
def test_rendered_manifest_roundtrips_names_hyper_and_argv(
    jobs: list[tuple[str, dict[str, Any]]],
) -> None:
    data = {
        "schema_version": 1,
        "name": "prop",
        "defaults": {"command": "run --name {name}"},
        "jobs": [{"name": name, "hyper": hyper} for name, hyper in jobs],
    }

    plan = parse(render(data))

    assert [job.name for job in plan.jobs] == [name for name, _ in jobs]
    assert [list(job.hyper.items()) for job in plan.jobs] == [list(h.items()) for _, h in jobs]
    assert [job.command for job in plan.jobs] == [("run", "--name", name) for name, _ in jobs]


def plan_or_manifest_error(text: str) -> None:
    try:
        plan = parse(text)
    except ManifestError as exc:
        assert exc.message.startswith("lab.toml: ")
        assert exc.detail["file"] == "lab.toml"
    else:
        assert isinstance(plan, Plan)


@quick
@given(st.text(max_size=300))
def test_arbitrary_text_gives_a_plan_or_a_manifest_error(text: str) -> None:
    plan_or_manifest_error(text)


@quick
@given(st.text(max_size=40), st.integers(0, len(EXAMPLE)), st.integers(0, 20))
def test_damaged_example_gives_a_plan_or_a_manifest_error(text: str, at: int, cut: int) -> None:
    plan_or_manifest_error(EXAMPLE[:at] + text + EXAMPLE[at + cut :])


KEYS = [
    "schema_version",
    "name",
    "defaults",
    "hosts",
    "jobs",
    "command",
    "model",
    "mode",
    "priority",
    "require_cuda",
    "gpus",
    "gpu_count",
    "min_vram_gib",
    "timeout",
    "max_attempts",
    "hyper",
    "env",
    "labels",
    "allowed_hosts",
    "shell",
    "pool",
    "seed",
    "allow_jobs",
    "cuda",
    "vram_gib",
    "office",
]
STRINGS = ["", " ", "run {name}", "{", "}", "{0}", "{seed:03d}", "{x.y}", "'", '"', "{model!r}"]
scalars = (
    st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(STRINGS)
    | st.text(max_size=5)
)
keys = st.sampled_from(KEYS) | st.text(text_chars, max_size=5)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)


@quick
@given(
    st.dictionaries(keys, values, max_size=5),
    st.lists(st.dictionaries(keys, values, max_size=6), max_size=3),
    st.dictionaries(keys, values, max_size=4),
)
def test_structured_noise_gives_a_wire_valid_plan_or_a_manifest_error(
    defaults: dict[str, Any], jobs: list[dict[str, Any]], hosts: dict[str, Any]
) -> None:
    data = {"schema_version": 1, "name": "noise", "defaults": defaults, "jobs": jobs}
    data["hosts"] = hosts
    try:
        plan = parse(render(data), base_dir="/d")
    except ManifestError:
        return
    for job in plan.jobs:
        JobSpecModel.from_domain(job)
    for host in plan.hosts:
        HostModel.from_domain(host)


def test_a_default_that_reads_like_a_gpu_requirement_must_be_a_real_field() -> None:
    text = (
        'schema_version = 1\nname = "p"\n[defaults]\ncommand = "python t.py"\nrequire_gpu = true\n'
    )
    with pytest.raises(ManifestError) as err:
        parse_manifest(text, "plan.toml")
    assert '"require_gpu"' in err.value.message and '"require_cuda"' in err.value.message
    used = (
        'schema_version = 1\nname = "p"\n[defaults]\n'
        'command = "python t.py --gpus {gpu_list}"\ngpu_list = "0,1"\n[[jobs]]\nname = "a"\n'
    )
    assert parse_manifest(used, "plan.toml").jobs[0].command[-1] == "0,1"


def test_hyper_style_is_dash_unless_the_plan_or_the_job_says_verbatim() -> None:
    assert parse(one_job("hyper.batch_size = 1")).jobs[0].hyper_style == HyperStyle.DASH
    plan = parse(
        f'{HEAD}hyper_style = "verbatim"\n[defaults]\ncommand = "run"\n'
        '[[jobs]]\nname = "a"\n[[jobs]]\nname = "b"\nhyper_style = "dash"\n'
    )
    assert [j.hyper_style for j in plan.jobs] == [HyperStyle.VERBATIM, HyperStyle.DASH]
    in_defaults = parse(one_job("", 'command = "run"\nhyper_style = "verbatim"'))
    assert in_defaults.jobs[0].hyper_style == HyperStyle.VERBATIM
    bad = error(one_job('hyper_style = "snake"'))
    assert bad.detail["field"] == "hyper_style" and "'dash', 'verbatim'" in str(bad)


def test_the_hyper_style_is_part_of_a_jobs_identity_only_when_it_is_not_the_default() -> None:
    dash = parse(one_job("hyper.lr = 0.1")).jobs[0]
    said = parse(one_job('hyper.lr = 0.1\nhyper_style = "dash"')).jobs[0]
    verbatim = parse(one_job('hyper.lr = 0.1\nhyper_style = "verbatim"')).jobs[0]
    assert manifest_job_id(dash) == manifest_job_id(said) != manifest_job_id(verbatim)


def test_cpu_only_with_a_gpu_requirement_names_the_job_and_the_field() -> None:
    err = error(one_job('cpu_only = true\ngpu_name = "a100*"'))
    assert err.detail == {"file": "lab.toml", "job": "j", "field": "cpu_only"}
    assert "gpu_name asks for a GPU" in str(err)
    assert parse(one_job('cpu_only = true\nworker = "gpu-box"')).jobs[0].requirements.cpu_only


# ---- exit codes a job is (not) retried after ---------------------------------------------


def test_exit_codes_not_retried_are_set_in_defaults_and_per_job() -> None:
    plan = parse(
        f'{HEAD}[defaults]\ncommand = "run"\nno_retry_on = [4, 5]\n'
        '[[jobs]]\nname = "a"\n[[jobs]]\nname = "b"\nno_retry_on = [3]\nretry_on = [2]\n'
    )
    a, b = plan.jobs
    assert (a.no_retry_on, a.retry_on) == ((4, 5), ())
    assert (b.no_retry_on, b.retry_on) == ((3,), (2,))
    wired = JobSpecModel.from_domain(b)
    assert (wired.no_retry_on, wired.retry_on) == ([3], [2])
    assert wired.to_domain() == b


@pytest.mark.parametrize(
    ("line", "field", "said"),
    [
        ("no_retry_on = 4", "no_retry_on", "expected an array of exit codes"),
        ('retry_on = ["4"]', "retry_on[0]", "expected an integer exit code"),
        ("no_retry_on = [0]", "no_retry_on", "0 is not a failing exit code"),
        ("retry_on = [256]", "retry_on", "256 is not a failing exit code"),
        ("retry_on = [4]\nno_retry_on = [4]", "no_retry_on", "in both retry_on and no_retry_on"),
    ],
)
def test_wrong_exit_codes_are_refused_naming_the_field(line: str, field: str, said: str) -> None:
    exc = error(one_job(line))

    assert f'field "{field}": ' in exc.message and said in exc.message
    assert exc.detail["job"] == "j"
