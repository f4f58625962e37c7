"""Bit snapshots: each gate's arm outputs (`harness.library.arms`) stored beside the gates and held to
their bits on later runs, the regression record between commits.

`--snapshot-update` (syrupy's flag) stores them; a run where a gate's module has a
`__snapshots__` folder checks them. A gate's snapshot lives at
`<gate module's folder>/__snapshots__/<module stem>/<toolchain>/<test name>.npz`: the
toolchain folder is keyed by what may legitimately change bits (the NVRTC version and the
options of every module the gate loaded, the arch among them), and `key.json` in it says so.
Small arrays are kept whole (their raw bits), large ones as a digest of their bits. A moved
bit fails the gate by assertion, naming the arm (and, for a kept array, the first differing
element); a toolchain with no snapshot yet is one line in the summary, not a failure.

Syrupy and pytest-regressions were weighed: both hang a snapshot on a fixture the test
asserts against, and compare by value (pytest-regressions with tolerances); arm outputs are
recorded without a fixture, inside pool workers, and compared bit for bit with the first
difference named, so the store is this module's and only syrupy's conventions are kept.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from harness.core.child import ARMS_OUT_CHANNEL, COMPARE_TIMING_CHANNEL
from harness.core.errors import CheckFailed, HarnessError, as_pytest_usage
from harness.core.kinds import owned

SNAPSHOT_DIR = "__snapshots__"
KEEP_WHOLE = 4096  # elements: an arm this small is stored whole, a larger one as a digest of its bits
PROPERTY = "snapshot"  # the user property (JUnit, gates.json) that says what the check did
# Set by a comparison run (`harness.plugin.compare`) for the runs it starts: each gate's arm outputs
# are written under it, in a folder of the kernel root the gate ran over (`side_folder`).


STORED = re.compile(r"stored (\d+) arm\(s\) in (.+)")  # the property's text when --snapshot-update stored one


class SnapshotMoved(CheckFailed):
    """An arm output's bits differ from its snapshot's."""


class SnapshotNotStored(HarnessError, RuntimeError):
    """--snapshot-update could not write a gate's snapshot."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("harness").addoption(
        "--snapshot-update", action="store_true", default=False,
        help="store each gate's arm outputs as its bit snapshot (beside the gate module, under __snapshots__)")


def folder_of(item: pytest.Item) -> Path:
    return Path(item.path).parent / SNAPSHOT_DIR / Path(item.path).stem


def place_problem(folder: Path) -> str | None:
    """Why `folder` (a gate module's snapshot folder) cannot be made and written, or None."""
    from harness.core.usage import writable_problem

    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"{blocker} is a file: move it, or run without --snapshot-update"
    unwritable = writable_problem(folder)
    return f"{unwritable}: make it writable, or run without --snapshot-update" if unwritable else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--snapshot-update: every gate module's snapshot folder can be written, or one line before any gate runs."""
    if not config.getoption("snapshot_update", False) or config.getoption("harness_serve", False):
        return
    seen = set()
    for item in items:
        folder = folder_of(item)
        if folder in seen or not owned(item):
            continue
        seen.add(folder)
        problem = place_problem(folder)
        if problem:
            raise as_pytest_usage(f"--snapshot-update cannot store the bit snapshots of "
                                    f"{shown_path(Path(item.path), config.rootpath)} in {shown_path(folder, config.rootpath)}: "
                                    f"{problem}")


def shown_path(path: Path, rootdir: Path) -> str:
    try:
        return Path(path).relative_to(rootdir).as_posix()
    except ValueError:
        return str(path)


def side_folder(out: Path, kernel_root: Path) -> Path:
    """Where a comparison run's gates over `kernel_root` write their arm outputs."""
    return Path(out) / hashlib.sha256(str(Path(kernel_root).resolve()).encode()).hexdigest()[:16]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    import os

    update = bool(item.config.getoption("snapshot_update", False))
    out = os.environ.get(ARMS_OUT_CHANNEL)
    if not owned(item) or not (update or out or folder_of(item).is_dir()):
        return (yield)
    from harness.library import arms, timing

    arms.begin(item.nodeid)
    if out:  # a comparison counts the gate's launches, and times them for --compare-timing
        timing.begin(*timing.from_environment(os.environ.get(COMPARE_TIMING_CHANNEL)))
    try:
        result = yield
    finally:
        outputs = arms.end()
        if out:  # a comparison keeps a red gate's arms too: its own assertion may be the difference
            from harness.library.kernels import kernel_root

            folder = side_folder(Path(out), kernel_root())
            write(folder, folder / dump_name(item.nodeid), outputs, whole=True)
            (folder / launches_name(item.nodeid)).write_text(json.dumps(timing.end()) + "\n")
    if outputs and not out:
        item.user_properties.append((PROPERTY, settle(item, outputs, update)))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    rep = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, (SnapshotMoved, SnapshotNotStored)):
        # the message alone, as assert_bits_eq's: the hook that raised it is no part of the gate
        rep.longrepr = str(call.excinfo.value)
    return rep


def toolchain_key(modules: dict[str, list[str]]) -> tuple[str, dict]:
    """(folder name, what it stands for) of the modules a gate loaded ({module: options})."""
    if not modules:
        return "host", {"modules": {}}
    from harness.compiling.toolchain import nvrtc_version

    what = {"nvrtc": nvrtc_version(), "modules": {m: modules[m] for m in sorted(modules)}}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return f"nvrtc{what['nvrtc']}-{digest}", what


def dump_name(nodeid: str) -> str:
    """A gate's file in a comparison run's side folder (node ids of every module share it)."""
    return hashlib.sha256(nodeid.encode()).hexdigest()[:20] + ".npz"


def launches_name(nodeid: str) -> str:
    """A gate's launch counts and timings in a comparison run's side folder."""
    return dump_name(nodeid)[:-4] + ".launches.json"


def file_name(nodeid: str) -> str:
    """A gate's snapshot file name, from its node id."""
    name = nodeid.split("::", 1)[-1]
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.npz"


def settle(item: pytest.Item, outputs: dict, update: bool) -> str:
    """Store (update) or check the gate's arm outputs; the line that says what was done.
    Raises SnapshotMoved when a checked arm's bits moved."""
    from harness.library.kernels import used

    key, what = toolchain_key(used())
    folder = folder_of(item) / key
    path = folder / file_name(item.nodeid)
    if update:
        try:
            write(folder, path, outputs, key=what)
        except OSError as exc:
            raise SnapshotNotStored(f"bit snapshot {path}: not stored: {exc.strerror or exc}; make {folder} "
                                    "writable, or run without --snapshot-update") from None
        return f"stored {len(outputs)} arm(s) in {path}"
    if not path.is_file():
        others = sorted(p.name for p in folder_of(item).iterdir() if p.is_dir() and p.name != key)
        held = f" (snapshots held: {', '.join(others)})" if others else ""
        return f"no snapshot for this toolchain yet ({key}){held}: run with --snapshot-update to record one"
    lines = compare(read(path), outputs)
    if lines:
        raise SnapshotMoved("\n".join([f"bit snapshot {path}: the bits moved", *lines,
                                       "accept the new bits with --snapshot-update"]))
    return f"{len(outputs)} arm(s) the same bits as {path}"


def _entry(name: str, array, whole: bool = False) -> tuple[dict, object]:
    from harness.library.dtypes import bits_of

    bits = bits_of(array)
    meta = {"name": name, "dtype": str(array.dtype), "shape": list(array.shape),
            "sha256": hashlib.sha256(bits.tobytes()).hexdigest(), "whole": whole or bits.size <= KEEP_WHOLE}
    return meta, (bits if meta["whole"] else None)


def write(folder: Path, path: Path, outputs: dict, key: dict | None = None, whole: bool = False) -> None:
    """The arm outputs at `path` in `folder`, and what the folder's toolchain key stands for
    in its `key.json` (a snapshot's; a comparison's dump has none). A snapshot keeps arms over
    KEEP_WHOLE elements as a digest; `whole` (a comparison's dump) keeps every arm whole."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    if key is not None:
        (folder / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    metas, arrays = [], {}
    for i, (name, array) in enumerate(outputs.items()):
        meta, bits = _entry(name, array, whole)
        metas.append(meta)
        if bits is not None:
            arrays[f"arm{i}"] = bits
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(metas)), **arrays)
    tmp.replace(path)


def read(path: Path) -> dict[str, tuple[dict, object]]:
    """{arm name: (meta, its bits or None)} of a stored snapshot."""
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        metas = json.loads(str(data["meta"]))
        return {m["name"]: (m, data[f"arm{i}"] if m["whole"] else None) for i, m in enumerate(metas)}


def compare(stored: dict, outputs: dict) -> list[str]:
    """What moved, one or more lines an arm; empty when every arm has its stored bits."""
    from harness.library.bits import bits_mismatch_lines
    from harness.library.dtypes import from_bits

    lines = []
    for name in sorted(stored.keys() - outputs.keys()):
        lines.append(f"{name}: in the snapshot, not recorded by this run")
    for name, array in outputs.items():
        if name not in stored:
            lines.append(f"{name}: recorded by this run, not in the snapshot")
            continue
        meta, bits = stored[name]
        now, _ = _entry(name, array)
        if (meta["dtype"], meta["shape"]) != (now["dtype"], now["shape"]):
            lines.append(f"{name}: not comparable: stored {meta['dtype']}{tuple(meta['shape'])}, "
                         f"now {now['dtype']}{tuple(now['shape'])}")
        elif meta["sha256"] != now["sha256"]:
            if bits is None:
                lines.append(f"{name}: the bits moved ({array.size} elements, kept as a digest: no element named)")
            else:
                lines += bits_mismatch_lines(name, array, from_bits(bits, array.dtype).reshape(array.shape)) or []
    return lines

