"""The machine's ledger of lanes: each harness run that runs GPU gates writes down what it holds
(lanes, and the worker processes beside them, on which GPU), so runs that share a machine
share its budget (`harness.pool.share`) instead of each taking what it would take alone.

One folder for the machine (`ledger_root`: `harness-ledger` in the temp dir, open to every
user as the temp dir is), one file a claim, written under an exclusive lock on the folder's
`lock` file: a claim reads every other holding and writes its own in one step, so two runs
that start at once never both take the last lanes. A holding is its process's: a process that
is gone (or a zombie), or a pid that now names a process started at another time (a recycled
pid), holds nothing, and the next claim sweeps its file. So a run killed by SIGKILL releases
what it held with its process; a run that ends releases it at once (`Claim.release`).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

LEDGER_FOLDER = "harness-ledger"
LOCK_FILE = "lock"
OPEN_TO_ALL = 0o1777  # as the temp dir: every user writes, only a file's owner removes it


def ledger_root() -> Path:
    """The machine's ledger folder: one for every harness process that shares the temp dir."""
    return Path(tempfile.gettempdir()) / LEDGER_FOLDER


def process_start(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field): with the
    pid, it names one process, not a later one given the same pid; "" where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rpartition(")")[2].split()  # past the command's name, which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class Holding:
    """What one process holds: `lanes` on the GPU `gpu` (its UUID), and `workers` CUDA contexts
    there at most (its lanes' workers and those beside them). `fixed` says what fixed its count
    whatever the budget (`--harness-lanes`, ...), "" where the budget chose it."""

    pid: int
    started: str
    gpu: str
    lanes: int
    workers: int
    fixed: str = ""

    @classmethod
    def of_this_process(cls, gpu: str, lanes: int, workers: int, fixed: str = "") -> "Holding":
        pid = os.getpid()
        return cls(pid=pid, started=process_start(pid), gpu=gpu, lanes=lanes, workers=workers, fixed=fixed)

    @classmethod
    def from_json(cls, raw: dict) -> "Holding":
        return cls(pid=int(raw["pid"]), started=str(raw.get("started") or ""), gpu=str(raw["gpu"]),
                   lanes=int(raw["lanes"]), workers=int(raw["workers"]), fixed=str(raw.get("fixed") or ""))

    def alive(self) -> bool:
        """Its process still runs: the pid exists, is no zombie, and started when it did."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        if _zombie(self.pid):
            return False
        now = process_start(self.pid)
        return not (self.started and now and now != self.started)


@dataclass
class Claim:
    """This process's entry in the ledger, and the other holdings it was weighed against."""

    path: Path
    holding: Holding
    others: list[Holding] = field(default_factory=list)

    def release(self) -> None:
        """Take the entry out (again: nothing)."""
        try:
            self.path.unlink()
        except OSError:
            pass


class Ledger:
    """The ledger folder at `root` (`ledger_root()` by default)."""

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else ledger_root()

    @contextmanager
    def _locked(self):
        import fcntl

        self._make_folder()
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # flock: a descriptor opened for reading takes it too
            yield
        finally:
            os.close(fd)  # and the lock with it

    def _open_lock(self) -> int:
        """The lock file, opened for reading (made where it is missing). An existing one is
        opened without O_CREAT: in a folder open to all, the kernel refuses an O_CREAT open of
        another user's file (fs.protected_regular)."""
        path = self.root / LOCK_FILE
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # made by another claim meanwhile
            return os.open(path, os.O_RDONLY)

    def _make_folder(self) -> None:
        try:
            self.root.mkdir(parents=True)
        except FileExistsError:
            return
        os.chmod(self.root, OPEN_TO_ALL)  # past the umask: every user's runs write here

    def _read(self, sweep: bool) -> list[Holding]:
        """The holdings of live processes; with `sweep`, the files of the others go (where this
        user may remove them: a file nobody can read or remove is only not counted)."""
        found = []
        for path in sorted(self.root.glob("*.json")):
            try:
                holding = Holding.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a holding (each is written whole, then renamed into place)
            if holding.alive():
                found.append(holding)
            elif sweep:
                try:
                    path.unlink()
                except OSError:
                    pass
        return found

    def holdings(self) -> list[Holding]:
        """Every live holding now."""
        with self._locked():
            return self._read(sweep=False)

    def claim(self, decide: Callable[[list[Holding]], Holding]) -> Claim:
        """Under the lock: sweep the dead, hand the live holdings to `decide`, write down what it
        returns. Raises OSError where the folder cannot be written (the caller goes on without)."""
        with self._locked():
            others = self._read(sweep=True)
            mine = decide(others)
            # A process may hold several claims (a pytest run inside another): each its own file.
            path = self.root / f"{mine.pid}-{mine.started or 0}-{uuid.uuid4().hex[:8]}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(mine), sort_keys=True) + "\n")
            os.chmod(tmp, 0o644)  # past the umask: every user's runs read it
            os.replace(tmp, path)
        return Claim(path, mine, others)
