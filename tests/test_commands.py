"""The commands as a new user meets them: help on stdout that names every command, the same
settings from any folder of the project (found as pytest finds it), reports in the rootdir,
and one clear line for bad input. No GPU needed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._machine import child_env, use_child_env

REPO = Path(__file__).resolve().parents[1]


def harness(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=child_env(env), capture_output=True,
                          text=True, timeout=600)


def test_help_goes_to_stdout_and_names_every_command():
    run = harness("--help")
    assert run.returncode == 0 and run.stderr == ""
    for command in ("compile", "controls", "mutate", "bench"):
        assert f"\n  {command} " in run.stdout, run.stdout
    bare = harness()
    assert bare.returncode == 2 and "commands:" in bare.stderr  # no command: usage on stderr, status 2
    unknown = harness("frobnicate")
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr


def test_bench_help_names_its_benchmarks_and_each_has_its_own():
    run = harness("bench", "--help")
    assert run.returncode == 0
    for name in ("gates", "mutate", "startup"):
        assert f"\n  {name} " in run.stdout, run.stdout
    gates = harness("bench", "gates", "--help")
    assert gates.returncode == 0 and gates.stdout.startswith("usage: python -m harness bench gates")
    assert "harness-report/bench" in gates.stdout and "docs/observed" not in gates.stdout.split("--out")[1][:80]
    startup = harness("bench", "startup", "--help")
    assert startup.returncode == 0 and "--repeat" in startup.stdout


def test_the_commands_find_the_project_from_a_subfolder(tmp_path, monkeypatch):
    """mutate and controls read the rootdir, kernel root, gates and report folder as pytest does,
    from any folder inside the project; the settings order is the same for each."""
    from harness.campaigns.controls.cli import build_parser as controls_parser, config_from as controls_config
    from harness.campaigns.mutate.cli import build_parser as mutate_parser, config_from as mutate_config

    project = tmp_path / "p"
    (project / "src" / "kern").mkdir(parents=True)
    (project / "checks").mkdir()
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\nkernel_root = "src/kern"\n'
                                            'harness_gates = ["checks"]\ncontrols_dir = "ctl"\n')
    for var in ("HARNESS_KERNEL_ROOT", "HARNESS_CACHE_DIR", "HARNESS_ARCH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(project / "checks")
    m = mutate_config(mutate_parser().parse_args([]))
    assert (m.rootdir, m.kernel_root, m.gates) == (project, project / "src" / "kern", ("checks",))
    assert m.report_dir == project / "harness-report" / "mutation"
    c = controls_config(controls_parser().parse_args([]))
    assert (c.rootdir, c.kernel_root, c.controls_dir) == (project, project / "src" / "kern", project / "ctl")
    assert c.report_dir == project / "harness-report"
    monkeypatch.setenv("HARNESS_KERNEL_ROOT", str(tmp_path / "env_k"))
    assert mutate_config(mutate_parser().parse_args([])).kernel_root == tmp_path / "env_k"  # as pytest's plugin
    assert controls_config(controls_parser().parse_args([])).kernel_root == tmp_path / "env_k"
    explicit = mutate_config(mutate_parser().parse_args(["--report", "here", "--kernel-root", "k"]))
    assert explicit.report_dir == project / "checks" / "here"  # options: relative to the working folder
    assert explicit.kernel_root == project / "checks" / "k"


def test_an_ini_kernel_root_that_is_not_a_folder_is_one_clear_error(pytester, monkeypatch):
    use_child_env(monkeypatch)
    monkeypatch.delenv("HARNESS_KERNEL_ROOT", raising=False)
    pytester.makeini("[pytest]\nkernel_root = nowhere\n")
    pytester.makepyfile(test_x="import pytest\n\n@pytest.mark.structural\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "harness.plugin")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "harness: kernel root " in err and "nowhere does not exist or is not a folder: set the ini key " \
                                              "kernel_root" in err, err
    assert "FileNotFoundError" not in err + result.stdout.str() and "Traceback" not in err


def test_bench_mutate_help_is_its_own_and_names_the_benchmarks_options():
    run = harness("bench", "mutate", "--help")
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m harness bench mutate")
    for option in ("--out", "--name", "--naive-jobs", "--naive-seconds", "--seed", "--gpu-jobs"):
        assert option in run.stdout, option
    bad = harness("bench", "mutate", "--naive-jobs", "abc")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: --naive-jobs 'abc' is not a whole number; pass e.g. --naive-jobs 16"


def subcommand_tables():
    """Each command with subcommands of its own: (its name, the names its dispatch knows)."""
    from harness.commands.bench import BENCHES
    from harness.commands.cache import ACTIONS
    from harness.commands.report import REPORTS

    return [("bench", BENCHES.names), ("report", REPORTS.names), ("cache", tuple(ACTIONS))]


@pytest.mark.parametrize("command, names", subcommand_tables(), ids=[c for c, _ in subcommand_tables()])
def test_help_names_every_subcommand_the_dispatch_knows(command, names, capsys):
    from harness.__main__ import commands, main

    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    listed = {line.split()[0] for line in top.splitlines() if line.startswith("  ") and line[2] != " "}
    assert {c.name for c in commands().table} == listed
    (line,) = [line for line in top.splitlines() if line.startswith(f"  {command} ")]
    for name in names:
        assert re.search(rf"`{command} (\S+\|)?{name}(\|\S+)?`", line), (name, line)
        # and the dispatch runs it: its own --help, status 0
        with pytest.raises(SystemExit) as done:
            main([command, name, "--help"]) if command != "cache" else main([command, "--help"])
        assert done.value.code == 0
    capsys.readouterr()


def test_report_help_describes_its_commands_on_stdout():
    run = harness("report", "--help")
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.startswith("usage: python -m harness report {merge}")
    assert "\n  merge  the gates.json of the N shards of one `pytest --shard K/N` run" in run.stdout
    assert "python -m harness report NAME --help describes" in run.stdout
    merge = harness("report", "merge", "--help")
    assert merge.returncode == 0 and "--out DIR" in merge.stdout
