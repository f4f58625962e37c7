"""Comments carry rules, not measurements (STYLE.md): no comment or docstring of the harness,
the gates, the kernels' launchers and sources, or the oracles cites a docs/observed file or
pins a machine timing. The measurement lives in docs/observed/ and the commit that made it;
the code says why the rule exists.

Read from the sources: every comment (Python `#`, CUDA `//` and `/* */`) and every bare
string statement (docstrings, and strings standing alone as comments). Strings a program
prints or passes on are not read, so a `--help` text may still name docs/observed."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("src/harness", "gates", "kernels_cu", "oracles", "conftest.py")

# A figure of time: `0.34 s`, `3 ms`, `1-2 ms`, `14 seconds`, `2 minutes`.
TIME = r"\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*(?:s|ms|us|µs|ns|seconds?|minutes?)\b"
MACHINE = r"\b(?:[ABH]\d00|GH200|GB200)s?\b"  # a GPU model: H100, H200, A100, B200, ...

PATTERNS = {
    "cites a docs/observed file": re.compile(r"docs/observed"),
    "pins a CPU time": re.compile(r"\bCPU-s\b|\bCPU-seconds?\b|\bGPU-s\b"),
    "pins a time on a named machine": re.compile(rf"{TIME}[^.;:]{{0,60}}?{MACHINE}|{MACHINE}[^.;:]{{0,60}}?{TIME}"),
    "pins an approximate time": re.compile(rf"\b(?:about|roughly|around|~)\s*{TIME}"),
    "pins a time per item": re.compile(rf"{TIME},?\s+(?:a|per|each)\s+(?:call|run|gate|launch|trap|import|process)\b"
                                       rf"|{TIME}\s+(?:each|import|run|startup)\b"),
    "pins a time taken": re.compile(rf"\btook\s+(?:about\s+)?{TIME}|{TIME}\s+(?:against|vs\.?|versus)\s+{TIME}"
                                    rf"|\(\s*{TIME},"),
    "pins a throughput": re.compile(r"\d+(?:\.\d+)?\s*[KMGT]i?B/s\b"),
}



def python_texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each block of consecutive `#` comments and each bare string
    statement, whitespace folded so a figure split over two lines is one phrase."""
    texts, block, start, last = [], [], 0, -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if line != last + 1 and block:
            texts.append((start, " ".join(block)))
            block = []
        if not block:
            start = line
        block.append(tok.string.lstrip("#").strip())
        last = line
    if block:
        texts.append((start, " ".join(block)))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            texts.append((node.lineno, " ".join(node.value.value.split())))
    return texts


CUDA_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def cuda_texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each CUDA comment, consecutive `//` lines joined."""
    texts: list[tuple[int, str]] = []
    last_end = -2
    for m in CUDA_COMMENT.finditer(source):
        line = source.count("\n", 0, m.start()) + 1
        text = " ".join(m.group().lstrip("/").strip("*/ ").split())
        if m.group().startswith("//") and texts and line == last_end + 1:
            texts[-1] = (texts[-1][0], f"{texts[-1][1]} {text}")
        else:
            texts.append((line, text))
        last_end = source.count("\n", 0, m.end()) + 1
    return texts


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        if path.is_file():
            files.append(path)
        else:
            files += [p for p in sorted(path.rglob("*")) if p.suffix in (".py", ".cu", ".cuh", ".h")]
    return files


def findings(path: Path) -> list[str]:
    """One line per comment or docstring that breaks the rule, with what it pins."""
    source = path.read_text(encoding="utf-8")
    texts = python_texts(source) if path.suffix == ".py" else cuda_texts(source)
    rel = path.relative_to(REPO).as_posix()
    found = []
    for line, text in texts:
        hits = [f"{what} ({m.group()!r})" for what, pattern in PATTERNS.items() if (m := pattern.search(text))]
        if hits:
            found.append(f"{rel}:{line}: {'; '.join(hits)}")
    return found


def test_no_comment_or_docstring_cites_docs_observed_or_pins_a_machine_timing():
    found: dict[str, list[str]] = {}
    for path in scanned_files():
        if hits := findings(path):
            found[path.relative_to(REPO).as_posix()] = hits
    wrong = [hit for hits in found.values() for hit in hits]
    assert not wrong, (
        "comments carry rules, not measurements (STYLE.md): say why in words; the figure belongs in "
        "docs/observed/ and the commit message:\n" + "\n".join(wrong))



@pytest.mark.parametrize("text", [
    "The driver handles one trap at a time (about 0.34 s each alone on an H200).",
    "each spent about 0.35 CPU-s before its first gate",
    "its import costs about 0.1 CPU-s",
    "20 of the run's 294 CPU-seconds on two cores",
    "14 s each on an H100",
    "the prefill anchor took 1.0-1.4 s on the H200 host",
    "(3 ms a call on a kernel file)",
    "does not pay its 0.2 s import, about 0.2 s",
    "see docs/observed/gate-speed-h100-3.md",
    "reads at 900 MB/s",
    "each time (1-2 ms, thousands of times in an invariance gate)",
    "the analyses took 4 s of a 31 s run",
    "slower on the GPU host (2.9-4.0 s against 1.0-1.4 s, measured)",
])
def test_the_patterns_catch_a_measurement(text):
    assert any(p.search(text) for p in PATTERNS.values()), text


@pytest.mark.parametrize("text", [
    "up to 10 s for its goodbye: never under a lock",       # a timeout: a rule
    "counts as the median of those recorded (1 s when none is)",  # a default: a rule
    "exceeds the opt-in limit per block (227 KiB on compute capability 9.0)",  # the architecture
    "a race the GPU happens to order",
    "as many at once as the machine has cores, and four cores a re-check",
    "the 84 MB of weights do not fit the H200's 50 MB L2",   # a size of the part, not a timing
    "`1h02m`, `4m05s` or `12s`",
])
def test_the_patterns_leave_a_rule_alone(text):
    assert not any(p.search(text) for p in PATTERNS.values()), text


def test_the_scan_reads_comments_and_docstrings_not_printed_strings():
    source = ('"""About 0.3 s each."""\n'
              '# costs about\n# 0.15 CPU-s\n'
              'print("e.g. docs/observed")\n'
              'X = 1\n"""docs/observed/FILE"""\n')
    texts = [t for _, t in python_texts(source)]
    assert "costs about 0.15 CPU-s" in texts
    assert "About 0.3 s each." in texts and "docs/observed/FILE" in texts
    assert not any("e.g." in t for t in texts)
    cuda = cuda_texts("int a; // about 3 ms\n// on an H200\n/* docs/observed\n x */ int b;\n")
    assert cuda == [(1, "about 3 ms on an H200"), (3, "docs/observed x")]
