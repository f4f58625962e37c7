"""The torch-extension fixture of our own (tests/fixtures/torch_conv1d: c10 includes, CUB block
loads and stores, std::max over an initializer list, a BOOL_SWITCH host dispatch, uint32_t
from the set-aside c10 headers) compiles through NVRTC with no launcher setting beyond the
upstream build's own flags, and docs/your-kernels.md's walkthrough over it runs as written,
step by step, in a copy of the tree, with no GPU. Its GPU gates run on a GPU machine:
`PYTHONPATH=../../../src python3 -m pytest --require-gpu -rA` from the tree's folder."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from harness.compiling.modsettings import declared_settings
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "tests" / "fixtures" / "torch_conv1d"
DOC = REPO / "docs" / "your-kernels.md"
SECTION_TITLE = "## Walkthrough: a torch-extension tree, as upstream ships it"
STEP = re.compile(r"<!-- conv1d-(?P<kind>file|copy|run)(?:: (?P<arg>[^>]*?))? -->\s*```[a-z]*\n(?P<body>.*?)```",
                  re.S)
EXPECT = re.compile(r"<!-- conv1d-expect: (.*?) -->")
# The nvcc flags a torch extension's setup.py passes (causal-conv1d's, fast-hadamard-transform's).
UPSTREAM_FLAGS = {"-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
                  "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "--ptxas-options=-v",
                  "-lineinfo"}


def section() -> str:
    return DOC.read_text().split(SECTION_TITLE, 1)[1].split("\n## ", 1)[0]


def steps() -> list[tuple[str, str, str, list[str]]]:
    """(kind, argument, body, expected output lines) of each marked block, in order."""
    text = section()
    found = list(STEP.finditer(text))
    out = []
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        out.append((m.group("kind"), (m.group("arg") or "").strip(), m.group("body"),
                    EXPECT.findall(text[m.end():end])))
    return out


def env(cache: Path) -> dict:
    return child_env({"HARNESS_CACHE_DIR": str(cache), "HARNESS_KERNEL_ROOT": None})


def test_the_launcher_declares_nothing_beyond_the_upstream_builds_flags():
    ms = declared_settings(TREE / "kernels" / "tiny_conv1d_fwd.cu")
    assert ms.compiler == "auto" and ms.device_view and not ms.defines and not ms.include_dirs
    assert set(ms.extra_flags) <= UPSTREAM_FLAGS, set(ms.extra_flags) - UPSTREAM_FLAGS


def test_the_tree_keeps_what_makes_it_a_real_torch_extension():
    """The fixture stays the case it is here for: these go through the set-aside headers."""
    cu = (TREE / "kernels" / "tiny_conv1d_fwd.cu").read_text()
    header = (TREE / "kernels" / "tiny_conv1d.h").read_text()
    common = (TREE / "kernels" / "tiny_conv1d_common.h").read_text()
    assert cu.index("#include <c10/util/Half.h>") < cu.index('#include "tiny_conv1d.h"')
    assert "cub::BlockLoad<" in cu and "cub::BlockStore<" in cu and "BOOL_SWITCH(" in cu
    assert "template void tiny_conv1d_fwd_cuda<at::Half, float>" in cu
    assert "#include" not in header and "using index_t = uint32_t;" in header
    assert "std::max(sizes)" in common and "constexpr size_t largest_of(std::initializer_list<size_t>" in common


def test_the_walkthrough_quotes_the_fixture_as_it_is():
    doc_steps = steps()
    (toml,) = [body for kind, arg, body, _ in doc_steps if kind == "file" and arg == "pyproject.toml"]
    fixture = tomllib.loads((TREE / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert tomllib.loads(toml)["tool"]["pytest"]["ini_options"] == fixture
    launcher_lines = {line.strip() for line in (TREE / "kernels" / "tiny_conv1d_fwd.py").read_text().splitlines()}
    quoted = [line.strip() for kind, arg, body, _ in doc_steps if arg.startswith("kernels/tiny_conv1d_fwd.py")
              for line in body.splitlines() if line.strip()]
    assert len(quoted) >= 5 and not [line for line in quoted if line not in launcher_lines], quoted


class TestTheWalkthrough:
    """Every step of the walkthrough in one copy of the tree, in order: a class, so that under
    xdist it runs on one worker with its one cubin cache."""

    def test_every_step_runs_as_the_page_says_in_a_copy_of_the_tree(self, tmp_path):
        work = tmp_path / "tiny-conv1d"
        (work / "kernels").mkdir(parents=True)
        for p in (TREE / "kernels").iterdir():
            if p.suffix in (".cu", ".h"):  # the tree as upstream ships it: no launcher yet
                shutil.copy(p, work / "kernels" / p.name)
        shutil.copytree(TREE / "tiny_conv1d", work / "tiny_conv1d", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(TREE / "conftest.py", work / "conftest.py")
        e = env(tmp_path / "cache")
        kinds = []
        for kind, arg, body, expects in steps():
            kinds.append(kind)
            if kind == "file":
                (work / arg).write_text(body)
            elif kind == "copy":
                for name in arg.split():
                    src = TREE / name
                    if src.is_dir():
                        shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        shutil.copy(src, work / name)
            else:
                command = body.strip().replace("python ", f"{sys.executable} ", 1)
                proc = subprocess.run(command, shell=True, cwd=work, env=e, capture_output=True, text=True,
                                      timeout=600)
                out = " ".join((proc.stdout + proc.stderr).split())
                assert (proc.returncode != 0) == (arg == "fails"), f"{command} exited {proc.returncode}:\n{out}"
                assert "Traceback" not in out, out
                for line in expects:
                    assert line in out, f"{body.strip()}: {line!r} not in its output:\n{out}"
        assert kinds.count("run") >= 5 and kinds.count("file") == 2 and kinds.count("copy") == 1, kinds
        proc = subprocess.run([sys.executable, "-m", "harness", "controls", "--static", "--report",
                               str(tmp_path / "rep")], cwd=work, env=e, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "2 of 2 controls as expected" in proc.stdout, proc.stdout + proc.stderr

