"""Mutants from the syntax tree: device code only, deterministic, with stable ids.

Only the bodies of `__global__` and `__device__` functions are mutated (host code and
launch configuration belong to the Python launchers). Sources are parsed by
`harness.compiling.cuda_syntax`: before parsing, `#pragma` lines and `__align__(N)` are blanked with
spaces (same length, same lines), as the tree-sitter CUDA grammar does not parse them inside
statements. A function whose body still holds a parse error is skipped and named (file and
line) in the warnings; so is a file that does not parse at all.
"""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.campaigns.mutate.operators import OPERATORS
from harness.compiling.cuda_syntax import device_functions, first_error, function_name, parse
from harness.core.errors import UsageError

SOURCE_SUFFIXES = (".cu", ".cuh")


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the kernel root
    operator: str
    start_line: int  # 1-based
    start_col: int  # 1-based, characters
    end_line: int
    end_col: int  # exclusive
    start_byte: int
    end_byte: int
    original: str
    replacement: str
    description: str
    function: str  # the device function it sits in

    def apply(self, source: bytes) -> bytes:
        return source[: self.start_byte] + self.replacement.encode() + source[self.end_byte :]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Mutant":
        return cls(**data)


def mutant_id(file: str, start: tuple[int, int], end: tuple[int, int], original: str, replacement: str,
              operator: str) -> str:
    material = "\0".join([file, f"{start[0]}:{start[1]}-{end[0]}:{end[1]}", original, replacement, operator])
    return hashlib.sha256(material.encode()).hexdigest()[:12]


class ParseProblem(str):
    """A warning: `file:line: what`."""


def _position(source: bytes, line_starts: list[int], offset: int) -> tuple[int, int]:
    import bisect

    line = bisect.bisect_right(line_starts, offset) - 1
    col = len(source[line_starts[line] : offset].decode("utf-8", errors="replace")) + 1
    return line + 1, col


def mutants_of(rel: str, source: bytes, operators: tuple[str, ...]) -> tuple[list[Mutant], list[str]]:
    """Every mutant of one source (in file order) and the parse warnings."""
    tree = parse(source)
    warnings: list[str] = []
    line_starts = [0] + [m.end() for m in re.finditer(rb"\n", source)]
    functions = device_functions(tree)
    if tree.root_node.has_error and not functions:
        bad = first_error(tree.root_node)
        line = (bad.start_point[0] + 1) if bad is not None else 1
        warnings.append(f"{rel}:{line}: tree-sitter could not parse this source; it is skipped")
        return [], warnings
    seen: set[tuple] = set()  # (start, end, replacement): the same edit from two operators is made once
    out: list[Mutant] = []
    operators = tuple(name for name in OPERATORS if name in operators)  # registry order decides who keeps it
    for fn in functions:
        name = function_name(fn)
        body = fn.child_by_field_name("body")
        if body is None:
            continue
        bad = first_error(body)
        if bad is not None:
            warnings.append(f"{rel}:{bad.start_point[0] + 1}: tree-sitter could not parse device function "
                            f"{name}; its mutants are skipped")
            continue
        stack = [body]
        while stack:
            node = stack.pop()
            for op_name in operators:
                for start, end, replacement, what in OPERATORS[op_name].fn(node, source):
                    original = source[start:end].decode("utf-8", errors="replace")
                    if replacement == original:
                        continue
                    s, e = _position(source, line_starts, start), _position(source, line_starts, end)
                    if (start, end, replacement) in seen:
                        continue
                    seen.add((start, end, replacement))
                    mid = mutant_id(rel, s, e, original, replacement, op_name)
                    out.append(Mutant(mid, rel, op_name, s[0], s[1], e[0], e[1], start, end, original,
                                      replacement, f"{OPERATORS[op_name].name}: {what}", name))
            stack.extend(reversed(node.children))
    out.sort(key=lambda m: (m.start_byte, m.end_byte, m.operator, m.replacement))
    return out, warnings


# ---------------------------------------------------------------- which files


class PathError(UsageError):
    pass


def select_files(kernel_root: Path, paths: list[str]) -> list[str]:
    """Kernel-root-relative `.cu`/`.cuh` files named by `paths` (files or folders, absolute,
    relative to the current folder, or relative to the kernel root); all when empty."""
    root = Path(kernel_root).resolve()

    def under(folder: Path) -> list[str]:
        return sorted(p.resolve().relative_to(root).as_posix() for p in folder.rglob("*")
                      if p.is_file() and p.suffix in SOURCE_SUFFIXES)

    if not paths:
        return under(root)
    out: list[str] = []
    for raw in paths:
        candidates = [Path(raw), root / raw]
        found = next((c.resolve() for c in candidates if c.exists()), None)
        if found is None:
            raise PathError(f"{raw}: no such file or folder (looked in the current folder and in the kernel root "
                            f"{root}); name a .cu/.cuh file or a folder under the kernel root")
        if not found.is_relative_to(root):
            raise PathError(f"{raw}: {found} is outside the kernel root {root}; mutants are made only of the "
                            "kernels under test (pass --kernel-root to mutate another tree)")
        if found.is_dir():
            out += under(found)
        elif found.suffix in SOURCE_SUFFIXES:
            out.append(found.relative_to(root).as_posix())
        else:
            raise PathError(f"{raw}: not a .cu or .cuh file; name CUDA sources or a folder of them")
    return sorted(set(out))


class SinceError(UsageError):
    pass


def changed_lines(kernel_root: Path, ref: str) -> dict[str, set[int]]:
    """{kernel-root-relative file: lines changed since `ref`} from `git diff -U0`."""
    from harness.core.gitref import names_a_commit, repo_of

    root = Path(kernel_root).resolve()
    top = repo_of(root)
    if top is None:
        raise SinceError(f"--since needs a git checkout, and {root} is not in one; drop --since or run from "
                         "a clone")
    if not names_a_commit(root, ref):
        raise SinceError(f"--since {ref}: git knows no commit by that name; pass a branch, tag or commit "
                         "(e.g. --since origin/main)")
    diff = subprocess.run(["git", "diff", "-U0", "--no-color", "--no-ext-diff", ref, "--", str(root)], cwd=root,
                          capture_output=True, text=True, check=True).stdout
    out: dict[str, set[int]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[4:]
            current = None
            if path.startswith("b/"):
                full = (Path(top) / path[2:]).resolve()
                if full.is_relative_to(root):
                    current = full.relative_to(root).as_posix()
                    out.setdefault(current, set())
        elif line.startswith("@@") and current is not None:
            m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            if m:
                start, count = int(m.group(1)), int(m.group(2) or 1)
                out[current].update(range(start, start + count))
    return out


def sample(mutants: list[Mutant], seed: int, max_per_file: int | None) -> list[Mutant]:
    """At most `max_per_file` mutants of each file, drawn reproducibly from `seed`."""
    if max_per_file is None:
        return list(mutants)
    by_file: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_file.setdefault(m.file, []).append(m)
    out = []
    for file in sorted(by_file):
        group = sorted(by_file[file], key=lambda m: m.id)
        rng = random.Random(f"{seed}:{file}")
        out += group if len(group) <= max_per_file else rng.sample(group, max_per_file)
    return sorted(out, key=lambda m: (m.file, m.start_byte, m.end_byte, m.operator, m.replacement))


def generate(kernel_root: Path, files: list[str], operators: tuple[str, ...], *, since: dict | None = None,
             seed: int = 0, max_per_file: int | None = None) -> tuple[list[Mutant], list[str]]:
    root = Path(kernel_root).resolve()
    mutants: list[Mutant] = []
    warnings: list[str] = []
    for rel in files:
        found, problems = mutants_of(rel, (root / rel).read_bytes(), operators)
        warnings += problems
        if since is not None:
            lines = since.get(rel, set())
            found = [m for m in found if any(line in lines for line in range(m.start_line, m.end_line + 1))]
        mutants += found
    return sample(mutants, seed, max_per_file), warnings
