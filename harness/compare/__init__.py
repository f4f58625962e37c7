"""`--compare-to REF`: did this change move any bits against REF, on every input the gates use?

REF is a git revision of the repository holding the kernel root, or a folder holding a kernel
tree. Its kernel tree is materialised in a temporary folder (the working tree and the index
are only read) and removed on every way out. Every selected gate then runs over REF's tree and
over today's, through the run layer's executor (warm workers where a device is, a fresh
pytest otherwise), with its arm outputs (`harness.arms`) written per side; each arm of the two
sides is compared bit for bit. The report says per gate and arm: `same bits`, or `differs`
with the count, the first difference and the distances in ULPs, or `only in REF` / `only
today` / `not comparable`; and each side's verdict of the gate. Red when an arm differs,
unless `--compare-allow-differ`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from harness.gitref import is_shallow, names_a_commit, repo_of
from harness.kinds import kinds_of, owned
from harness.ref_launchers import LAUNCHERS_OF_ENV
from harness.timing import DEFAULT_REPEAT, DEFAULT_WARMUP, TIMING_ENV
from harness.usage import UsageError


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness")
    group.addoption("--compare-to", default=None, metavar="REF",
                    help="run every selected gate over REF's kernel tree (a git revision, or a folder) and over "
                         "today's, and compare every arm output bit for bit (docs/regression.md)")
    group.addoption("--compare-allow-differ", action="store_true", default=False,
                    help="with --compare-to: report arms that differ without failing the run (a study run)")
    group.addoption("--compare-timing", action="store_true", default=False,
                    help="with --compare-to: time each kernel launch of the gates on both sides with CUDA events "
                         "(warm-up, then the median and spread of --compare-repeat launches)")
    group.addoption("--compare-repeat", type=int, default=None, metavar="N",
                    help=f"with --compare-timing: timed launches of each kernel launch (default {DEFAULT_REPEAT})")


# ---------------------------------------------------------------- REF's kernel tree


@contextlib.contextmanager
def kernel_tree_at(ref: str, kernel_root: Path):
    """Yield REF's kernel tree: the folder REF itself, or the kernel root as of git revision
    REF, written into a temporary folder removed on every way out. Raises UsageError."""
    kernel_root = Path(kernel_root).resolve()
    folder = Path(ref).expanduser()
    if folder.is_dir():
        if not any(folder.rglob("*.cu")):
            raise UsageError(f"--compare-to {ref}: the folder holds no .cu file; pass a kernel tree or a git revision")
        yield folder.resolve()
        return
    repo = repo_of(kernel_root)
    if repo is None:
        raise UsageError(f"--compare-to {ref}: not a folder, and the kernel root {kernel_root} is not in a git "
                         "repository; pass a folder holding the old kernel tree")
    if not names_a_commit(repo, ref):
        hint = (" (this clone is shallow: fetch the history, e.g. git fetch --unshallow, or git fetch origin "
                f"{ref})" if is_shallow(repo) else "; name a branch, tag or commit of this repository")
        raise UsageError(f"--compare-to {ref}: no such revision in {repo}{hint}")
    rel = kernel_root.relative_to(repo).as_posix()
    tmp = Path(tempfile.mkdtemp(prefix="harness-compare-"))
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", ref, "--", rel],
                                 capture_output=True, timeout=300)
        if archive.returncode != 0:
            raise UsageError(f"--compare-to {ref}: {ref} has no {rel}/ (git archive: "
                             f"{archive.stderr.decode().strip()}); compare with a revision that has the kernel root")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield tmp / rel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_launchers(ref: str, today: Path, ref_root: Path, rootdir: Path) -> None:
    """REF's launchers (those in its kernel root) import here, or one UsageError line: executed
    once in this process, today's put back at once, before any gate runs."""
    from harness import ref_launchers

    try:
        ref_launchers.swap(today, ref_root, rootdir)
    except ref_launchers.LauncherImportError as exc:
        raise UsageError(f"--compare-to {ref}: {exc}; fix the launcher at REF, or compare with a REF whose "
                         "launchers import") from None
    finally:
        ref_launchers.restore()


def pytest_collection_finish(session: pytest.Session) -> None:
    """A side of a comparison run as a fresh pytest over another kernel tree: its launchers are
    that tree's (`harness.ref_launchers`)."""
    if os.environ.get(LAUNCHERS_OF_ENV):
        from harness import _settings, ref_launchers

        try:
            ref_launchers.use(_settings.current().kernel_root, session.config.rootpath)
        except ref_launchers.LauncherImportError as exc:
            raise pytest.UsageError(str(exc)) from None


# ---------------------------------------------------------------- comparing arms


def ordered(bits, kind: str):
    """Bits as integers ordered as the values they encode (floats: sign-magnitude folded), so
    that the distance between two is their distance in ULPs."""
    import numpy as np

    x = bits.astype(np.int64)
    if kind != "f":
        return x
    width = bits.dtype.itemsize * 8
    sign = np.int64(1) << (width - 1)
    return np.where(x & sign, -(x & (sign - 1)), x)


@dataclass
class ArmComparison:
    arm: str
    status: str  # same bits | differs | only in REF | only today | not comparable
    elements: int = 0
    differing: int = 0
    first: dict | None = None  # index, both values, both bit patterns
    ulps: dict | None = None  # max, median, histogram {"1": n, "2-3": n, ...}
    note: str | None = None


def compare_arm(name: str, ref, now) -> ArmComparison:
    import numpy as np

    from harness.bits import _hex, _index, _value_text
    from harness.dtypes import bits_of

    if ref.shape != now.shape or ref.dtype != now.dtype:
        return ArmComparison(name, "not comparable", note=f"REF {ref.dtype}{ref.shape}, today {now.dtype}{now.shape}")
    a, b = bits_of(ref).reshape(-1), bits_of(now).reshape(-1)
    bad = np.flatnonzero(a != b)
    if not bad.size:
        return ArmComparison(name, "same bits", elements=a.size)
    i = int(bad[0])
    size = ref.dtype.itemsize
    first = {"index": _index(i, ref.shape), "ref": _value_text(a[i], ref.dtype), "today": _value_text(b[i], ref.dtype),
             "ref_bits": _hex(a[i], size), "today_bits": _hex(b[i], size)}
    kind = "f" if ref.dtype.kind == "f" or "float" in str(ref.dtype) else "i"
    dist = np.abs(ordered(a[bad], kind) - ordered(b[bad], kind))
    edges = [1, 2, 4, 16, 256, 65536]
    hist, lo = {}, 1
    for hi in edges[1:] + [None]:
        n = int(((dist >= lo) & (dist < hi)).sum()) if hi else int((dist >= lo).sum())
        if n:
            hist[f"{lo}" if hi == lo + 1 else (f"{lo}-{hi - 1}" if hi else f">={lo}")] = n
        lo = hi
    ulps = {"max": int(dist.max()), "median": float(np.median(dist)), "histogram": hist}
    return ArmComparison(name, "differs", elements=a.size, differing=int(bad.size), first=first, ulps=ulps)


@dataclass
class GateComparison:
    nodeid: str
    ref_outcome: str
    today_outcome: str
    arms: list[ArmComparison] = field(default_factory=list)
    launches: dict = field(default_factory=dict)  # {"ref": {kernel: count}, "today": {...}}
    timing: list[KernelTiming] = field(default_factory=list)
    timing_notes: list[str] = field(default_factory=list)
    kind: str = ""  # the gate's kind marker

    @property
    def differs(self) -> bool:
        """An arm's bits, shape or dtype moved (an arm only one side recorded is reported, not
        red: a gate new today has no REF arm, and a gate red today is red by its own verdict)."""
        return any(a.status in ("differs", "not comparable") for a in self.arms)

    @property
    def bits(self) -> str:
        return "bits differ" if self.differs else "same bits"


@dataclass
class KernelTiming:
    """One kernel's launches in one gate, timed on both sides: sums over its launches paired by
    order (`kernel#i`) of each launch's median, lower and upper quartile, in microseconds."""

    kernel: str
    launches: int
    repeat: int
    ref_us: float
    today_us: float
    ref_quartiles: tuple[float, float]
    today_quartiles: tuple[float, float]
    speed: str  # faster | slower | same speed (their middle halves overlap)

    @property
    def ratio(self) -> float:
        return self.ref_us / self.today_us if self.today_us else float("inf")


def compare_timing(ref: dict, today: dict) -> tuple[list[KernelTiming], list[str]]:
    """Each kernel's timed launches of one gate ({"kernel#i": {"ms": [...]}, ...} a side),
    REF's against today's; and a note for launches timed on one side only."""
    import numpy as np

    kernels: dict[str, list[str]] = {}
    for key in ref:
        if key in today:
            kernels.setdefault(key.rpartition("#")[0], []).append(key)
    notes = [f"{k}: timed {'in REF only' if k in ref else 'today only'}" for k in sorted(ref.keys() ^ today.keys())]
    out = []
    for kernel, keys in kernels.items():
        sums = {}
        for side, data in (("ref", ref), ("today", today)):
            q = np.array([np.percentile(np.asarray(data[k]["ms"]) * 1000.0, (25, 50, 75)) for k in keys]).sum(axis=0)
            sums[side] = q
        r, t = sums["ref"], sums["today"]
        speed = "faster" if t[2] < r[0] else "slower" if t[0] > r[2] else "same speed"
        out.append(KernelTiming(kernel, len(keys), min(len(ref[k]["ms"]) for k in keys), round(float(r[1]), 3),
                                round(float(t[1]), 3), (round(float(r[0]), 3), round(float(r[2]), 3)),
                                (round(float(t[0]), 3), round(float(t[2]), 3)), speed))
    return out, notes


def compare_sides(nodeid: str, ref: dict, today: dict, ref_outcome: str, today_outcome: str) -> GateComparison:
    """Every arm of one gate, REF's against today's ({name: array} each)."""
    gate = GateComparison(nodeid, ref_outcome, today_outcome)
    for name in ref:
        gate.arms.append(compare_arm(name, ref[name], today[name]) if name in today
                         else ArmComparison(name, "only in REF"))
    gate.arms += [ArmComparison(name, "only today") for name in today if name not in ref]
    return gate


# ---------------------------------------------------------------- the run


def read_side(folder: Path, nodeid: str) -> dict:
    """{arm: array} a gate wrote in a side folder (empty when it wrote none)."""
    from harness.dtypes import from_bits
    from harness.snapshots import dump_name, read

    path = folder / dump_name(nodeid)
    if not path.is_file():
        return {}
    out = {}
    for name, (meta, bits) in read(path).items():
        out[name] = from_bits(bits, _dtype(meta["dtype"])).reshape(meta["shape"])
    return out


def read_launches(folder: Path, nodeid: str) -> dict:
    """A gate's launch counts and timings in a side folder (`harness.timing.end`)."""
    from harness.snapshots import launches_name

    path = folder / launches_name(nodeid)
    return json.loads(path.read_text()) if path.is_file() else {"launches": {}, "timed": {}, "notes": []}


def compare_gate(nodeid: str, kind: str, folders: dict, runs: dict) -> GateComparison:
    """One gate's arms, launches and timings, REF's side against today's."""
    gate = compare_sides(nodeid, read_side(folders["ref"], nodeid), read_side(folders["today"], nodeid),
                         _outcome(runs["ref"], nodeid), _outcome(runs["today"], nodeid))
    gate.kind = kind
    sides = {side: read_launches(folders[side], nodeid) for side in ("ref", "today")}
    gate.launches = {side: sides[side]["launches"] for side in sides}
    gate.timing, gate.timing_notes = compare_timing(sides["ref"]["timed"], sides["today"]["timed"])
    gate.timing_notes += [f"{side}: {n}" for side in sides for n in sides[side]["notes"]]
    return gate


def _dtype(name: str):
    """numpy's dtype of that name, or ml_dtypes' (bfloat16, float8_e4m3fn, ...)."""
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _executors(st, config, gates: list[str], kernel_root: Path):
    from harness.runs.fresh import FreshExecutors
    from harness.runs.warm import WarmExecutors

    files = sorted({g.split("::", 1)[0] for g in gates})
    if st.pool is not None:
        return WarmExecutors(config.rootpath, tuple(files), kernel_root, 1, stop_on_kill=False)
    return FreshExecutors(config.rootpath, require_gpu=st.require_gpu)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("compare_to", None):
        return
    for flag, given in (("--compare-allow-differ", config.getoption("compare_allow_differ", False)),
                        ("--compare-timing", config.getoption("compare_timing", False)),
                        ("--compare-repeat", config.getoption("compare_repeat", None) is not None)):
        if given:
            raise pytest.UsageError(f"{flag} belongs to a comparison: add --compare-to REF (a git revision, "
                                    "or a folder holding the old kernel tree)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    config = session.config
    ref = config.getoption("compare_to", None)
    if not ref or config.option.collectonly:
        return None
    from harness import _settings
    from harness.plugin import state_key
    from harness.snapshots import ARMS_OUT_ENV, side_folder

    st = config.stash[state_key]
    if st.serving:
        return None
    kinds = {item.nodeid: kinds_of(item) for item in session.items if owned(item)}
    gates = list(kinds)
    today = _settings.current().kernel_root
    report_dir = Path(st.report_dir or _settings.report_root(config.rootpath))
    timed = f"{timing_repeat(config)},{DEFAULT_WARMUP}" if config.getoption("compare_timing") else None
    out = Path(tempfile.mkdtemp(prefix="harness-arms-"))
    previous = {k: os.environ.get(k) for k in (ARMS_OUT_ENV, LAUNCHERS_OF_ENV, TIMING_ENV)}
    os.environ[ARMS_OUT_ENV] = str(out)
    os.environ[LAUNCHERS_OF_ENV] = str(today)
    os.environ.pop(TIMING_ENV, None)
    if timed:
        os.environ[TIMING_ENV] = timed
    try:
        with kernel_tree_at(ref, today) as ref_root:
            check_launchers(ref, today, ref_root, config.rootpath)
            # one executor for both sides: the warm one runs each side's gates on the same workers
            executor = _executors(st, config, gates, today)(report_dir / "compare", _settings.current().cache_dir,
                                                            st.arch)
            runs = {}
            try:
                for side, root in (("ref", ref_root), ("today", today)):
                    runs[side] = (root, executor.run(root, gates, max(60.0, st.deadline * len(gates))))
            finally:
                executor.close()
            folders = {side: side_folder(out, root) for side, (root, _) in runs.items()}
            result = [compare_gate(g, (kinds[g] or [""])[0], folders, {side: run for side, (_, run) in runs.items()})
                      for g in gates]
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(out, ignore_errors=True)
    write_reports(report_dir, ref, result)
    tr = config.pluginmanager.get_plugin("terminalreporter")
    unrun = not_compared(gates, {side: run for side, (_, run) in runs.items()})
    for line in table(ref, result) + not_compared_lines(unrun):
        (tr.write_line(line) if tr is not None else print(line))
    _report_today(session, runs["today"][1], {g.nodeid: g for g in result}, unrun)
    differ = [g for g in result if g.differs]
    if not config.getoption("compare_allow_differ"):
        session.testsfailed += len(differ)
    return True


def timing_repeat(config) -> int:
    """--compare-repeat, checked: one UsageError line when it is not a positive count."""
    repeat = config.getoption("compare_repeat")
    if repeat is None:
        return DEFAULT_REPEAT
    if repeat < 1:
        raise pytest.UsageError(f"--compare-repeat {repeat}: give a count of timed launches of at least 1 "
                                f"(default {DEFAULT_REPEAT})")
    return repeat


def not_compared(gates: list[str], runs: dict) -> dict[str, str]:
    """{gate: why} for each gate that a side gave no verdict (its process died, its deadline,
    an executor that lost it): nothing was compared for it, so it is red, never left out."""
    out = {}
    for g in gates:
        missing = [f"{'REF' if side == 'ref' else side} gave no verdict: {_outcome(run, g)}"
                   for side, run in runs.items() if g not in run.records]
        if missing:
            out[g] = "not compared: " + "; ".join(missing)
    return out


def not_compared_lines(unrun: dict[str, str]) -> list[str]:
    if not unrun:
        return []
    return [f"{len(unrun)} gate(s) not compared, each red: a side gave no verdict for it"] + \
        [f"  {g}: {why}" for g, why in unrun.items()]


def _report_today(session: pytest.Session, runs, compared: dict, unrun: dict[str, str]) -> None:
    """Each gate's report is today's verdict, with what the comparison found as properties
    (`compare <arm>`: JUnit, gates.json): the summary, pytest's counts and the require-gpu rule
    read them as those of any run. A gate a side gave no verdict for (`unrun`) is red."""
    from harness.gate_verdicts import synthetic
    from harness.records import Outcome

    for item in session.items:
        rec = runs.records.get(item.nodeid)
        if rec is None and item.nodeid not in unrun:
            continue
        gate = compared.get(item.nodeid)
        props = [(f"compare {a.arm}", _arm_text(a)) for a in (gate.arms if gate else [])]
        if item.nodeid in unrun:
            why = unrun[item.nodeid]
            if rec is not None and rec.red:  # REF gave none; today's own failure is kept beside it
                why += f"; today {_outcome(runs, item.nodeid)}: {rec.first_failure_line or 'red'}"
            props += [("route", "error"), ("first_failure_line", why)]
            outcome, longrepr, message = Outcome.FAILED.value, why, why
        else:
            if rec.red:
                props += [("route", str(rec.route or "error")), ("first_failure_line", rec.first_failure_line or "")]
                longrepr = rec.failure_message or rec.first_failure_line or "red"
            elif rec.outcome == Outcome.SKIPPED:
                longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {rec.skip_reason or 'skipped today'}")
            else:
                longrepr = None
            outcome, message = (Outcome.FAILED.value if rec.red else str(rec.outcome)), rec.failure_message
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in synthetic(item, outcome, longrepr, props, duration=rec.duration if rec is not None else 0.0,
                                message=message):
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _outcome(runs, nodeid: str) -> str:
    rec = runs.records.get(nodeid)
    if rec is None:
        return "not run" + (f" ({runs.note()})" if runs.note() else "")
    return rec.outcome + (f" by {rec.route}" if rec.red else "")


def table(ref: str, gates: list[GateComparison]) -> list[str]:
    arms = [a for g in gates for a in g.arms]
    lines = [f"compare to {ref}: {len(gates)} gate(s), {len(arms)} arm(s): "
             f"{sum(a.status == 'same bits' for a in arms)} same bits, {sum(a.status == 'differs' for a in arms)} "
             f"differ, {sum(a.status not in ('same bits', 'differs') for a in arms)} do not pair up"]
    timings = [t for g in gates for t in g.timing]
    if timings:
        lines.append(f"timing: {len(timings)} kernel(s) in {sum(bool(g.timing) for g in gates)} gate(s): "
                     + ", ".join(f"{sum(t.speed == w for t in timings)} {w}" for w in ("faster", "slower", "same speed")))
    for g in gates:
        if not g.arms and not g.timing:
            continue
        lines.append(f"{g.nodeid} (REF: {g.ref_outcome}; today: {g.today_outcome})")
        for a in g.arms:
            lines.append(f"  {a.arm}: {_arm_text(a)}")
        for t in g.timing:
            lines.append(f"  time {t.kernel}: {_timing_text(t)}, {g.bits}")
        lines += [f"  time {n}" for n in g.timing_notes]
    for what, nodeids in idle_gates([g for g in gates if not g.timing]).items():  # a timed gate has its block
        shown = ", ".join(nodeids[:3]) + (f", ... ({len(nodeids)} in all)" if len(nodeids) > 3 else "")
        lines.append(f"{len(nodeids)} gate(s) with {what}: {shown}")
    return lines


def idle_gates(gates: list[GateComparison]) -> dict[str, list[str]]:
    """{what to do: the node ids} of the gates with no arm output on either side."""
    idle: dict[str, list[str]] = {}
    for g in gates:
        if not g.arms:
            idle.setdefault(nothing_compared(g), []).append(g.nodeid)
    return idle


def nothing_compared(g: GateComparison) -> str:
    """What to do about a gate with no arm output on either side (one line, the same for every
    such gate of one cause)."""
    if g.ref_outcome.startswith("not run") or g.today_outcome.startswith("not run"):
        return "no arm output: a side gave no verdict (not compared, so red: named below)"
    if g.ref_outcome.startswith("skipped") and g.today_outcome.startswith("skipped"):
        return "no arm output: skipped on both sides"
    if g.kind in ("trap", "refusal"):
        return f"no arm output: {g.kind} gates give their verdict by a fault or a refusal, not by a value"
    if not sum(g.launches.get("today", {}).values()) + sum(g.launches.get("ref", {}).values()):
        return ("no arm output, and no kernel launched on either side: nothing to compare (host-only gates; "
                "select the GPU gates, e.g. -m gpu)")
    return ("no arm output on either side, though kernels were launched: check a value with assert_bits_eq / "
            "assert_close, or record one with harness.record(label, array)")


def _timing_text(t: KernelTiming) -> str:
    return (f"REF {t.ref_us:.2f} us, today {t.today_us:.2f} us (median of {t.repeat}, summed over "
            f"{t.launches} launch(es); quartiles REF {t.ref_quartiles[0]:.2f}-{t.ref_quartiles[1]:.2f}, today "
            f"{t.today_quartiles[0]:.2f}-{t.today_quartiles[1]:.2f}): {t.ratio:.2f}x, {t.speed}")


def _arm_text(a: ArmComparison) -> str:
    if a.status == "differs":
        f = a.first
        return (f"differs: {a.differing} of {a.elements} elements; first at {f['index']}: REF {f['ref']} "
                f"({f['ref_bits']}), today {f['today']} ({f['today_bits']}); ULPs max {a.ulps['max']}, median "
                f"{a.ulps['median']:g}, {a.ulps['histogram']}")
    return a.status + (f" ({a.note})" if a.note else "")


def write_reports(report_dir: Path, ref: str, gates: list[GateComparison]) -> tuple[Path, Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    data = {"ref": ref, "gates": [{**asdict(g), "differs": g.differs,
                                   "timing": [{**asdict(t), "ratio": round(t.ratio, 4)} for t in g.timing]}
                                  for g in gates]}
    json_path = report_dir / "compare.json"
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md = [f"# Compared with {ref}", "", "| gate | arm | REF | today | bits |", "| --- | --- | --- | --- | --- |"]
    for g in gates:
        for a in g.arms:
            md.append(f"| `{g.nodeid}` | {a.arm} | {g.ref_outcome} | {g.today_outcome} | "
                      f"{_arm_text(a).replace('|', '/')} |")
    idle = idle_gates(gates)
    if idle:
        md += [""] + [f"- {len(nodeids)} gate(s) with {what}" for what, nodeids in idle.items()]
    timed = [(g, t) for g in gates for t in g.timing]
    if timed:
        md += ["", "| gate | kernel | launches | REF us | today us | REF / today | verdict |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        md += [f"| `{g.nodeid}` | `{t.kernel}` | {t.launches} | {t.ref_us:.2f} ({t.ref_quartiles[0]:.2f}-"
               f"{t.ref_quartiles[1]:.2f}) | {t.today_us:.2f} ({t.today_quartiles[0]:.2f}-{t.today_quartiles[1]:.2f}) | "
               f"{t.ratio:.2f}x | {t.speed}, {g.bits} |" for g, t in timed]
        md += ["", f"Median of {timed[0][1].repeat} timed launches after {DEFAULT_WARMUP} warm-up ones, CUDA events, "
                   "summed over the kernel's launches in the gate; quartiles in brackets. Faster or slower: the "
                   "middle halves of the two sides do not overlap."]
    md_path = report_dir / "compare.md"
    md_path.write_text("\n".join(md) + "\n")
    return json_path, md_path
