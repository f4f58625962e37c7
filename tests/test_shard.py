"""`--shard K/N` and `python -m harness report merge`: N groups balanced by the durations a
gates.json recorded, trap gates dealt evenly, every item in exactly one group; the N reports
merge into one, and a merge of reports that are not one run's shards is refused in a line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.plugin.shard import parse_shard, split
from tests._machine import child_env



def test_groups_balance_the_recorded_time_and_deal_trap_gates_evenly():
    durations = {"a": 9.0, "b": 5.0, "c": 4.0, "d": 3.0, "e": 3.0, "t1": 1.0, "t2": 1.0, "t3": 1.0, "t4": 8.0}
    items = [(n, n.startswith("t")) for n in durations]
    groups = split(items, durations, 2)
    time = [sum(durations[n] for (n, _), g in zip(items, groups) if g == k) for k in range(2)]
    traps = [sum(1 for (n, trap), g in zip(items, groups) if trap and g == k) for k in range(2)]
    assert traps == [2, 2] and abs(time[0] - time[1]) <= 1.0, (groups, time)
    # the same inputs in another order: the same groups (every host computes one split)
    again = dict(zip((n for n, _ in reversed(items)), split(list(reversed(items)), durations, 2)))
    assert again == dict(zip((n for n, _ in items), groups))


def test_an_item_with_no_recorded_duration_counts_as_the_median():
    groups = split([("old1", False), ("old2", False), ("new", False)], {"old1": 10.0, "old2": 2.0}, 2)
    assert groups == [0, 1, 1]  # new counts 6 s: beside old2, not old1


@pytest.mark.parametrize("bad, fix", [("3", "is not K/N"), ("0/2", "K must be between 1 and N"),
                                      ("3/2", "K must be between 1 and N")])
def test_a_bad_shard_is_refused_with_the_fix(bad, fix):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=fix):
        parse_shard(bad)


SUITE = """
import pytest

@pytest.mark.structural
@pytest.mark.parametrize("i", range(6))
def test_shape(i):
    pass

@pytest.mark.gpu
@pytest.mark.trap
@pytest.mark.parametrize("i", range(3))
def test_guard(i):
    pass
"""


def _run(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=path, env=child_env(inherit=False), capture_output=True, text=True,
                          timeout=300)


def test_two_shards_run_every_gate_once_and_their_reports_merge_into_one(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nkernel_root = .\n")
    (tmp_path / "conftest.py").write_text('import sys\npytest_plugins = [] if "harness.plugin" in sys.modules '
                                          'else ["harness.plugin"]\n')
    (tmp_path / "test_g.py").write_text(SUITE)
    full = _run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--harness-report", "full")
    assert full.returncode == 0, full.stdout
    everything = {g["nodeid"] for g in json.loads((tmp_path / "full" / "gates.json").read_text())["gates"]}
    assert len(everything) == 9
    for k in (1, 2):
        run = _run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--shard={k}/2",
                   "--shard-durations=full/gates.json", "--harness-report", f"s{k}")
        assert run.returncode == 0, run.stdout
        assert f"harness: shard {k}/2: " in run.stdout and "durations from " in run.stdout, run.stdout
    shards = [json.loads((tmp_path / f"s{k}" / "gates.json").read_text()) for k in (1, 2)]
    ran = [{g["nodeid"] for g in s["gates"]} for s in shards]
    assert ran[0] | ran[1] == everything and not ran[0] & ran[1]
    assert [sum("test_guard" in n for n in r) for r in ran] in ([2, 1], [1, 2])  # the trap gates dealt out
    assert [s["shard"] for s in shards] == ["1/2", "2/2"]

    merged = _run(tmp_path, "-m", "harness", "report", "merge", "s1", "s2", "--out", "merged")
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.startswith("9 gates from 2 report(s): ")
    report = json.loads((tmp_path / "merged" / "gates.json").read_text())
    assert {g["nodeid"] for g in report["gates"]} == everything and report["summary"]["passed"] == 6
    assert "- shard merged: 1/2, 2/2" in (tmp_path / "merged" / "summary.md").read_text()

    alone = _run(tmp_path, "-m", "harness", "report", "merge", "s1", "--out", "merged")
    assert alone.returncode == 2 and alone.stderr.startswith("error: the reports hold shards 1/2, not each of 1/2, 2/2")
    twice = _run(tmp_path, "-m", "harness", "report", "merge", "full", "full", "--out", "merged")
    assert twice.returncode == 2 and "is in both full and full" in twice.stderr
    missing = _run(tmp_path, "-m", "harness", "report", "merge", "nowhere")
    assert missing.returncode == 2 and "nowhere holds no gates.json: pass the --harness-report DIR" in missing.stderr
