"""`python -m harness bench gates`: bad input is refused before anything runs."""

from harness.commands.bench import main


def test_a_before_tree_without_gates_is_refused(tmp_path, capsys):
    assert main(["gates", "--before", str(tmp_path)]) == 2
    assert "has no gates/ folder" in capsys.readouterr().err


def test_a_negative_job_count_is_refused_and_zero_is_the_serial_only_run(tmp_path, capsys):
    (tmp_path / "gates").mkdir()
    assert main(["gates", "--before", str(tmp_path), "--jobs", "-1"]) == 2
    assert "or 0 for no parallel figure" in capsys.readouterr().err


def test_a_repeat_below_one_is_refused(tmp_path, capsys):
    (tmp_path / "gates").mkdir()
    assert main(["gates", "--before", str(tmp_path), "--repeat", "0"]) == 2
    assert "--repeat 0: pass 1 or more" in capsys.readouterr().err
