"""The README shows real gates and real output: every line of its example gate code is in
gates/, and the quoted H200 failure line is in the recorded campaign."""

import re
from pathlib import Path

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
