"""The README shows real gates and real output: every line of its example gate code is in
gates/, and the quoted H200 failure line is in the recorded campaign. docs/observed/ is a
record: every file has a row in its index, the whole stays small, and no page moved or
deleted under docs/ is still named anywhere."""

import re
from pathlib import Path

from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]


def readme_section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## A gate, and what it prints when it goes red", 1)[1].split("\n## ", 1)[0]


def fenced(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                blocks.append((info, "\n".join(body)))
                info = None
        elif info is not None:
            body.append(line)
    return blocks


def test_every_line_of_the_readme_example_gates_is_in_gates():
    blocks = [body for info, body in fenced(readme_section()) if info == "python"]
    assert len(blocks) >= 2
    gates = "\n".join(p.read_text() for p in (REPO / "gates").glob("*.py"))
    for block in blocks:
        for line in block.splitlines():
            if line.strip() in ("", "...") or line.startswith("# gates/"):
                continue
            assert line in gates, f"README example line not in gates/: {line!r}"


def test_the_quoted_outputs_are_recorded_or_produced_by_the_gate():
    section = readme_section()
    quoted = [body for info, body in fenced(section) if info == ""]
    observed = (REPO / "docs" / "observed" / "controls-h200.md").read_text()
    h200 = [q.strip() for q in quoted if "elements differ bitwise" in q]
    assert h200 and all(line in observed for line in h200)
    structural = [q for q in quoted if "AssertionError" in q]
    assert structural and "but the launcher uses" in structural[0]
    source = (REPO / "gates" / "test_gemv_structure.py").read_text()
    assert "change {relpath} and its launcher together: the launcher's grid must match" in source


def test_the_readme_cpu_control_example_runs_as_it_says(tmp_path):
    """The README's control command, run as written (its report in a temp folder instead of the
    repo): exit 0, the control proven by the structural gate that runs with no GPU, and the
    quoted failure lines in the run's log where the README says they are."""
    import shlex
    import subprocess
    import sys

    section = readme_section()
    command = re.search(r"`(python -m harness controls [^`]*--no-require-gpu)`", section).group(1)
    argv = shlex.split(command)
    name = argv[4]
    run = subprocess.run([sys.executable, *argv[1:], "--report", str(tmp_path / "report")], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(rf"{name}\s*│\s*proven\s*│\s*yes", run.stdout), run.stdout
    log = (tmp_path / "report" / "runs" / name / "pytest.log").read_text()
    quoted = [body for info, body in fenced(section) if info == "" and "AssertionError" in body][0]
    for line in quoted.splitlines():
        assert line.strip() in log, line


# ---------------------------------------------------------------- docs/observed: an indexed record


OBSERVED = REPO / "docs" / "observed"
OBSERVED_BUDGET = 1_500_000  # bytes: records and compact summaries; raw dumps stay out of git


def observed_index() -> str:
    """The "Kept" table of docs/observed/README.md."""
    text = (OBSERVED / "README.md").read_text()
    return text.split("## Kept", 1)[1].split("\n## ", 1)[0]


def test_every_observed_file_has_a_row_in_the_index_and_every_row_a_file():
    rows = [line for line in observed_index().splitlines() if line.startswith("| `")]
    indexed = [re.match(r"\| `([^`]+)`", line).group(1) for line in rows]
    files = sorted(p.name for p in OBSERVED.iterdir() if p.name != "README.md")
    assert sorted(indexed) == files, (
        f"docs/observed/README.md indexes {sorted(set(indexed) - set(files))} that are not there and misses "
        f"{sorted(set(files) - set(indexed))}: one row per file, saying what it measured, when, how, at which "
        "commit and on which machine")
    for line in rows:  # file | what | when | command | commit | machine
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) >= 6 and all(cells), f"a row with an empty cell: {line}"


def test_the_observed_record_stays_small():
    size = sum(p.stat().st_size for p in OBSERVED.rglob("*") if p.is_file())
    assert size < OBSERVED_BUDGET, (
        f"docs/observed holds {size:,} bytes (budget {OBSERVED_BUDGET:,}): keep summaries in git, leave raw "
        "dumps out (docs/observed/README.md, 'Left git', says how)")


def _text_files():
    yield REPO / "README.md"
    yield REPO / ".ci" / "run"
    yield from (REPO / "docs").rglob("*.md")
    for folder in ("src/harness", "gates", "oracles", "tests", "controls", "kernels_cu"):
        yield from (p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".toml", ".cu", ".cuh"))


def test_every_docs_path_named_in_the_repository_exists():
    """A page moved or deleted under docs/ leaves no reference behind (a final all-caps part,
    `docs/observed/FILE`, is a placeholder)."""
    missing = set()
    for path in _text_files():
        if not path.is_file():
            continue
        for named in re.findall(r"docs/[A-Za-z0-9_./-]*[A-Za-z0-9_/]", path.read_text(errors="replace")):
            if re.fullmatch(r"[A-Z]+", named.rstrip("/").rsplit("/", 1)[-1]):
                continue
            if not (REPO / named).exists():
                missing.add(f"{path.relative_to(REPO)}: {named}")
    assert not missing, sorted(missing)


def test_the_docs_count_of_this_repos_controls_is_the_number_of_control_files():
    """Where a page says how many controls `controls/` holds today, it is the number of files."""
    files = len(list((REPO / "controls").glob("*.toml")))
    said = {(page.name, int(n)) for page in (REPO / "docs").glob("*.md")
            for n in re.findall(r"`controls/` holds (\d+) controls", page.read_text())}
    assert said and {n for _, n in said} == {files}, f"controls/ holds {files} controls; the docs say {sorted(said)}"
