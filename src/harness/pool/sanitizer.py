"""`--sanitize TOOL`: GPU gates under NVIDIA compute-sanitizer, each finding turned into a
red verdict (route `sanitizer`) on the gate that launched the kernel.

Each worker runs under its own compute-sanitizer with its own log file. After a gate, the
worker synchronises the device and reads what the tool appended to its log since the gate
began: every finding block there belongs to that gate (gates run one at a time in a worker).
What hides findings, and how it is handled:

- CuPy's memory pools put many arrays in one allocation, so a write past one array lands
  in another's memory and memcheck sees nothing: workers switch both pools off.
- The default `--destroy-on-device-error context` would poison the rest of the worker:
  `kernel` is used, so the context lives on after a finding.
- A trap gate's `__trap()` is itself a finding: trap gates do not run under a sanitizer
  (they are skipped, saying so).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from harness.core.child import SANITIZER_LOG_CHANNEL, SANITIZER_TOOL_CHANNEL
from harness.core.errors import SetupError
from harness.core.records import Outcome, Route

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
ENV_BINARY = "HARNESS_SANITIZER"
INSTALL_HINT = ("install the CUDA toolkit (it ships compute-sanitizer), or `pip install nvidia-cuda-sanitizer-api`, "
                f"or set {ENV_BINARY}=/path/to/compute-sanitizer")


class SanitizerError(SetupError, RuntimeError):
    pass


def _wheel_binary() -> Path | None:
    try:
        import nvidia.cuda_sanitizer_api as pkg  # type: ignore
    except Exception:
        return None
    for base in getattr(pkg, "__path__", []):
        for cand in (Path(base) / "compute-sanitizer" / "compute-sanitizer", Path(base) / "bin" / "compute-sanitizer"):
            if cand.exists():
                return cand
    return None


def find_binary() -> Path:
    """The compute-sanitizer to run: $HARNESS_SANITIZER, PATH, the toolkit, the PyPI wheel."""
    env = os.environ.get(ENV_BINARY)
    if env:
        candidates = [(Path(env), f"${ENV_BINARY}")]
    else:
        candidates = []
        on_path = shutil.which("compute-sanitizer")
        if on_path:
            candidates.append((Path(on_path), "PATH"))
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidates.append((Path(cuda_home) / "bin" / "compute-sanitizer", "the CUDA toolkit"))
        wheel = _wheel_binary()
        if wheel:
            candidates.append((wheel, "the nvidia-cuda-sanitizer-api wheel"))
    for path, where in candidates:
        if not path.exists():
            if where.startswith("$"):
                raise SanitizerError(f"--sanitize: {ENV_BINARY}={path} does not exist: point it at compute-sanitizer, "
                                     f"or unset it to search PATH and the toolkit")
            continue
        if not path.is_file() or not os.access(path, os.X_OK):
            mode = stat.filemode(path.stat().st_mode)
            raise SanitizerError(f"--sanitize: {path} (found through {where}) is not an executable file ({mode}): "
                                 f"make it executable (chmod +x), or {INSTALL_HINT}")
        return path
    raise SanitizerError(f"--sanitize: compute-sanitizer was not found on PATH, in the CUDA toolkit or as a wheel: "
                         f"{INSTALL_HINT}")


def command(tool: str, binary: Path) -> list[str]:
    """The command prefix a worker process runs under (its log file is added per worker)."""
    if tool not in TOOLS:
        raise SanitizerError(f"--sanitize: unknown tool {tool!r}: use one of {', '.join(TOOLS)}")
    cmd = [str(binary), "--tool", tool, "--destroy-on-device-error", "kernel", "--print-limit", "1000",
           "--target-processes", "application-only"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "hazard"]
    return cmd


BANNER_PREFIXES = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application",
                   "Program hit", "Saved host backtrace", "Error: process didn't terminate successfully")
MARK = "========="


def findings(text: str) -> list[list[str]]:
    """The finding blocks in a slice of a compute-sanitizer log: each a list of lines, the
    first naming the kind of finding, the rest indented details (where, thread, address)."""
    blocks: list[list[str]] = []
    for raw in text.splitlines():
        if not raw.startswith(MARK):
            continue
        body = raw[len(MARK):]
        content = body.strip()
        if not content:
            continue
        indented = body.startswith("  ")
        if not indented:
            if content.startswith(BANNER_PREFIXES):
                continue
            blocks.append([content])
        elif blocks and not content.startswith(BANNER_PREFIXES):
            blocks[-1].append(content)
    return blocks


def first_line(tool: str, block: list[str]) -> str:
    """One line a person can act on: kind, kernel, thread, address."""
    detail = [line for line in block[1:] if line.startswith(("at ", "by thread", "Address", "and is", "in "))]
    return f"{tool}: " + "; ".join([block[0]] + detail[:3])


class LogWatch:
    """The worker's view of its own sanitizer log."""

    def __init__(self, path: Path, tool: str):
        self.path = path
        self.tool = tool
        self.offset = 0
        self.findings = 0

    @classmethod
    def from_environment(cls) -> "LogWatch | None":
        path = os.environ.get(SANITIZER_LOG_CHANNEL)
        if not path:
            return None
        return cls(Path(path), os.environ.get(SANITIZER_TOOL_CHANNEL, "compute-sanitizer"))

    def _new_text(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        # only whole lines: a block still being written is read next time
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        return data[:cut].decode(errors="replace")

    def attribute(self, reports: list, launches: int) -> None:
        """Turn the gate's passing call report red when the log grew findings during it."""
        try:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        except Exception:
            pass
        blocks = findings(self._new_text())
        if not blocks:
            return
        self.findings += len(blocks)
        line = first_line(self.tool, blocks[0])
        text = "\n".join([f"compute-sanitizer {self.tool} reported {len(blocks)} finding(s) while this gate ran "
                          f"({launches} kernel launches):"] + ["\n".join(b) for b in blocks[:5]])
        call = next((r for r in reports if r.when == "call"), None)
        if call is None:
            return
        if call.failed:
            # The finding is the cause (memcheck stops a kernel at its first bad access, so an
            # assertion often fails too): the route says sanitizer, the gate's own text follows.
            text = f"{text}\n\nThe gate's own failure:\n{call.longrepr}"
            call.user_properties[:] = [(k, v) for k, v in call.user_properties
                                       if k not in ("route", "first_failure_line")]
        call.outcome = Outcome.FAILED.value
        call.longrepr = text
        call.user_properties.extend([("route", Route.SANITIZER.value), ("first_failure_line", line)])
        call.harness_failure_message = text[:4000]
