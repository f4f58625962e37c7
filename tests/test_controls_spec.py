"""The control file format: every problem in every file named at once, each with its fix."""

import shutil
import textwrap
from pathlib import Path

import pytest

from harness.core.settings import ini_value
from harness.campaigns.controls.collect import collect_gates
from harness.campaigns.controls.spec import (
                                             Control,
                                             ControlSpecError,
                                             Expect,
                                             Route,
                                             check_gates,
                                             load_controls,
                                             parse_control,
                                             )

from tests._machine import use_child_env

SUITE = Path(__file__).parent / "fixtures" / "controls_suite"

VALID = """
description = "VALUE 3 becomes 4"
file = "value.cu"
find = "#define VALUE 3"
replace = "#define VALUE 4"
why = "the structural gate must catch it"

[[expect]]
gate = "gates/test_v.py::test_value"
route = "assertion"
message = "VALUE"
"""


@pytest.fixture
def tree(tmp_path):
    """A kernel root with one .cu, one header and one Python launcher, and a controls folder."""
    root = tmp_path / "kernels"
    root.mkdir()
    (root / "value.cu").write_text('#include "common.cuh"\n#define VALUE 3\n#define VALUE_TOO 3\n')
    (root / "common.cuh").write_text("#define SCALE 2\n")
    (root / "launcher.py").write_text("SCALE = 2\n")
    (tmp_path / "controls").mkdir()
    return tmp_path


def write(tree, name, text):
    path = tree / "controls" / f"{name}.toml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(tree, **kw):
    with pytest.raises(ControlSpecError) as info:
        load_controls(tree / "controls", tree / "kernels", rootdir=tree, **kw)
    return [f"{p.path.name}: {p.key}: {p.message}" if p.key else f"{p.path.name}: {p.message}" for p in info.value.problems]


def test_valid_control_parses_into_edits_and_expects(tree):
    path = write(tree, "value_changed", VALID)
    control, found = parse_control(path)
    assert found == []
    assert control.name == "value_changed"
    assert [(e.file, e.find, e.replace, e.occurrence, e.regex) for e in control.edits] == [
        ("value.cu", "#define VALUE 3", "#define VALUE 4", None, False)
    ]
    assert control.expects == (Expect("gates/test_v.py::test_value", Route.ASSERTION, "VALUE"),)
    assert control.modules == ("gates/test_v.py",)


def test_unknown_key_names_the_closest_valid_key(tree):
    write(tree, "c", VALID.replace("find =", "fnd ="))
    found = problems(tree)
    assert "c.toml: fnd: unknown key; did you mean 'find'?" in found


def test_unknown_key_in_an_expect_table_is_named_with_its_table(tree):
    write(tree, "c", VALID.replace("message =", "mesage ="))
    assert problems(tree) == ["c.toml: expect[1].mesage: unknown key; did you mean 'message'?"]


def test_missing_keys_each_name_the_fix(tree):
    write(tree, "c", 'file = "value.cu"\nfind = "#define VALUE 3"\nreplace = "x"\n')
    assert problems(tree) == [
        'c.toml: description: missing; add description = "..."',
        'c.toml: why: missing; add why = "..."',
        "c.toml: expect: missing; add an [[expect]] table with gate and route naming the gate that must go red",
    ]


def test_a_control_without_any_edit_says_how_to_add_one(tree):
    write(tree, "c", VALID.split("file =")[0] + 'why = "w"\n[[expect]]\ngate = "gates/test_v.py::test_value"\nroute = "assertion"\n')
    assert "c.toml: find: missing; add file, find and replace (or one [[edit]] table per edit)" in problems(tree)


def test_top_level_edit_and_edit_tables_together_are_refused(tree):
    write(tree, "c", VALID + '\n[[edit]]\nfile = "value.cu"\nfind = "VALUE_TOO 3"\nreplace = "VALUE_TOO 4"\n')
    assert problems(tree)[0] == (
        "c.toml: file: give either top-level file/find/replace or [[edit]] tables, not both; move it into an [[edit]] table"
    )


def test_bad_route_lists_the_routes_and_suggests_the_closest(tree):
    write(tree, "c", VALID.replace('route = "assertion"', 'route = "asertion"'))
    assert problems(tree) == [
        "c.toml: expect[1].route: 'asertion' is not a route; use one of assertion, trap, refusal; did you mean 'assertion'?"
    ]


def test_occurrence_must_be_a_positive_integer(tree):
    write(tree, "c", VALID.replace('replace =', 'occurrence = 0\nreplace ='))
    assert problems(tree) == [
        "c.toml: occurrence: must be an integer >= 1 (which match, counting from 1), not 0"
    ]


def test_a_file_that_is_not_toml_names_the_file_and_the_fix(tree):
    write(tree, "c", "description = unquoted\n")
    (found,) = problems(tree)
    assert found.startswith("c.toml: is not valid TOML: Invalid value (at line 1, column 15); fix the syntax")


@pytest.mark.parametrize("outside", ["../value.cu", "/etc/hostname"])
def test_a_file_outside_the_kernel_root_is_refused(tree, outside):
    write(tree, "c", VALID.replace('file = "value.cu"', f'file = "{outside}"'))
    (found,) = problems(tree)
    assert found.startswith(f"c.toml: file: {outside} is outside the kernel root")
    assert found.endswith("name the file by its path inside the kernel root")


def test_a_missing_file_suggests_the_nearest_kernel_source(tree):
    write(tree, "c", VALID.replace('file = "value.cu"', 'file = "valeu.cu"'))
    (found,) = problems(tree)
    assert found.startswith("c.toml: file: valeu.cu does not exist under the kernel root")
    assert found.endswith("did you mean 'value.cu'?")


def test_editing_a_python_launcher_is_refused_because_the_sandbox_would_not_reach_it(tree):
    write(tree, "c", VALID.replace('file = "value.cu"', 'file = "launcher.py"').replace("#define VALUE 3", "SCALE = 2").replace("#define VALUE 4", "SCALE = 3"))
    (found,) = problems(tree)
    assert found.startswith("c.toml: file: launcher.py is not a kernel source")
    assert "gates import Python from the repo, not from the sandbox" in found


def test_find_matching_twice_asks_for_occurrence(tree):
    write(tree, "c", VALID.replace('find = "#define VALUE 3"', 'find = "3\\n"').replace('replace = "#define VALUE 4"', 'replace = "4\\n"'))
    assert problems(tree) == [
        "c.toml: find: the text '3\\n' occurs 2 times in value.cu (lines 2, 3); add occurrence = N (1..2) "
        "to pick one, or lengthen find until it is unique"
    ]


def test_problems_in_edit_tables_are_named_by_table(tree):
    write(tree, "c", """
        description = "d"
        why = "w"
        [[edit]]
        file = "value.cu"
        find = "#define VALUE 3"
        replace = "#define VALUE 4"
        [[edit]]
        file = "common.cuh"
        find = "SCALE 9"
        replace = "SCALE 1"
        [[expect]]
        gate = "gates/test_v.py::test_value"
        route = "assertion"
    """)
    (found,) = problems(tree)
    assert found.startswith("c.toml: edit[2].find: the text 'SCALE 9' does not occur in common.cuh")


def test_every_problem_in_every_file_is_reported_at_once(tree):
    write(tree, "a", VALID.replace("find =", "fnd ="))
    write(tree, "b", VALID.replace('file = "value.cu"', 'file = "../x.cu"'))
    write(tree, "ok", VALID)
    with pytest.raises(ControlSpecError) as info:
        load_controls(tree / "controls", tree / "kernels", rootdir=tree)
    lines = str(info.value).splitlines()
    assert lines[0] == "3 problems in the controls; nothing was run:"
    assert [line.split(":")[0].strip().rsplit("/", 1)[-1] for line in lines[1:]] == ["a.toml", "a.toml", "b.toml"]


def test_an_empty_controls_folder_says_how_to_write_one(tree):
    assert problems(tree) == [
        "controls: holds no control (*.toml); write one TOML file per control (see docs/controls.md)"
    ]


def test_an_unknown_control_name_suggests_the_closest(tree):
    write(tree, "value_changed", VALID)
    assert problems(tree, names=["value_chnged"]) == ["controls: no control named 'value_chnged'; did you mean 'value_changed'?"]


def test_names_select_controls_but_every_control_is_validated(tree):
    write(tree, "value_changed", VALID)
    write(tree, "stale", VALID.replace("#define VALUE 3", "#define VALUE 9"))
    assert problems(tree, names=["value_changed"])[0].startswith("stale.toml: find: the text '#define VALUE 9' does not occur")
    (tree / "controls" / "stale.toml").unlink()
    (control,) = load_controls(tree / "controls", tree / "kernels", rootdir=tree, names=["value_changed"])
    assert control.name == "value_changed"


# ---------------------------------------------------------------- gates that must exist


def control_expecting(path: Path, *gates: str) -> Control:
    return Control("c", path, "d", "w", (), tuple(Expect(g, Route.ASSERTION) for g in gates))


def test_an_expected_gate_pytest_does_not_collect_suggests_the_near_one(tmp_path):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "test_v.py").write_text("")
    known = {"gates/test_v.py::test_value_is_three", "gates/test_v.py::test_other"}
    (found,) = check_gates([control_expecting(tmp_path / "c.toml", "gates/test_v.py::test_value_is_thre")], known, tmp_path)
    assert found.key == "expect[1].gate"
    assert found.message == (
        "no gate gates/test_v.py::test_value_is_thre is collected; did you mean 'gates/test_v.py::test_value_is_three'?"
    )


def test_a_parametrized_gate_without_its_case_asks_for_one_case(tmp_path):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "test_v.py").write_text("")
    known = {"gates/test_v.py::test_hd[256]", "gates/test_v.py::test_hd[512]"}
    (found,) = check_gates([control_expecting(tmp_path / "c.toml", "gates/test_v.py::test_hd")], known, tmp_path)
    assert found.message == (
        "no gate gates/test_v.py::test_hd is collected; it is parametrized; name one case, e.g. 'gates/test_v.py::test_hd[256]'"
    )


def test_an_expected_gate_in_a_missing_module_says_node_ids_start_at_the_rootdir(tmp_path):
    (found,) = check_gates([control_expecting(tmp_path / "c.toml", "gates/test_nope.py::test_x")], set(), tmp_path)
    assert found.message.startswith("gates/test_nope.py does not exist (node ids are relative to the rootdir")


@pytest.fixture
def suite(tmp_path, monkeypatch):
    use_child_env(monkeypatch)
    copy = tmp_path / "suite"
    shutil.copytree(SUITE, copy)
    return copy


def test_collected_gates_are_read_from_pytest_itself(suite):
    found, error = collect_gates(["gates/gate_scale.py"], rootdir=suite, kernel_root=suite / "kernels")
    assert error is None
    assert found == {"gates/gate_scale.py::test_scale_is_accepted"}


def test_a_gate_module_that_fails_to_import_is_reported_with_pytest_s_error(suite):
    (suite / "gates" / "gate_broken.py").write_text("import no_such_module_here\n")
    found, error = collect_gates(["gates/gate_broken.py"], rootdir=suite, kernel_root=suite / "kernels")
    assert found == set()
    assert "no_such_module_here" in error


def test_the_suite_s_controls_validate_against_its_collected_gates(suite):
    controls = load_controls(
        suite / "controls", suite / "kernels", rootdir=suite,
        collect=lambda modules: collect_gates(modules, rootdir=suite, kernel_root=suite / "kernels"),
    )
    assert len(controls) == 10


def test_a_control_naming_a_gate_the_suite_lacks_is_refused_before_anything_runs(suite):
    text = (suite / "controls" / "value_changed.toml").read_text()
    (suite / "controls" / "value_changed.toml").write_text(text.replace("test_value_define_is_three", "test_value_is_3"))
    with pytest.raises(ControlSpecError) as info:
        load_controls(
            suite / "controls", suite / "kernels", rootdir=suite,
            collect=lambda modules: collect_gates(modules, rootdir=suite, kernel_root=suite / "kernels"),
        )
    (problem,) = info.value.problems
    assert problem.key == "expect[1].gate"
    assert problem.message.startswith("no gate gates/gate_value.py::test_value_is_3 is collected; gates/gate_value.py has: ")


# ---------------------------------------------------------------- ini keys


def test_ini_keys_are_read_from_the_rootdir_s_pytest_configuration(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ncontrols_dir = "my_controls"\n')
    assert ini_value(tmp_path, "controls_dir") == "my_controls"
    assert ini_value(tmp_path, "kernel_root") is None
    (tmp_path / "pytest.ini").write_text("[pytest]\nkernel_root = src/kernels\n")
    assert ini_value(tmp_path, "kernel_root") == "src/kernels"
    assert ini_value(tmp_path, "controls_dir") is None  # pytest.ini wins, as in pytest


def test_a_campaigns_collector_collects_each_module_once_and_keeps_nothing_it_cannot_place(monkeypatch):
    from harness.campaigns.controls import collect as collect_module

    calls, answers = [], {}

    def fake(modules, *, rootdir, kernel_root):
        calls.append(list(modules))
        return set().union(*(answers[m] for m in modules)), None

    monkeypatch.setattr(collect_module, "collect_gates", fake)
    answers.update({"gates/a.py": {"gates/a.py::t1", "gates/a.py::t2"}, "gates/b.py": {"gates/b.py::t"},
                    "gates/empty.py": set()})
    collect = collect_module.Collector(rootdir=Path("/r"), kernel_root=Path("/r/k"))
    assert collect(["gates/a.py", "gates/empty.py"]) == ({"gates/a.py::t1", "gates/a.py::t2"}, None)
    assert collect(["gates/a.py"]) == ({"gates/a.py::t1", "gates/a.py::t2"}, None)
    assert collect(["gates/a.py", "gates/b.py"]) == ({"gates/a.py::t1", "gates/a.py::t2", "gates/b.py::t"}, None)
    assert calls == [["gates/a.py", "gates/empty.py"], ["gates/b.py"]]
    # node ids that name their module another way: answered, never kept
    answers["./gates/c.py"] = {"gates/c.py::t"}
    assert collect(["./gates/c.py"]) == ({"gates/c.py::t"}, None)
    assert collect(["./gates/c.py"]) == ({"gates/c.py::t"}, None)
    assert calls[2:] == [["./gates/c.py"], ["./gates/c.py"]]
    # an error is the answer, and nothing of it is kept
    monkeypatch.setattr(collect_module, "collect_gates", lambda modules, **kw: (set(), "boom"))
    assert collect(["gates/d.py"]) == (set(), "boom")
    assert "gates/d.py" not in collect.known
