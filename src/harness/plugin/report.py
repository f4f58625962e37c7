"""Per-gate records, failure routes, and the JSON / Markdown reports."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import UsageError
# The gate vocabulary: every gate carries exactly one of these markers. `compile` is the kind of
# the items harness.plugin.cufiles collects, one per `.cu` under the kernel root.
from harness.core.records import MESSAGE_LIMIT, RECORD_VERSION, GateRecord, Outcome, Route  # noqa: F401  (re-exported)


def classify_route(exc: BaseException) -> Route:
    from harness.compiling.compile import CompileError
    from harness.core.device import is_cuda_error
    from harness.library.launch import Refusal

    if isinstance(exc, CompileError):
        return Route.COMPILE
    name = type(exc).__name__
    # A gate that catches a device fault and fails on purpose (a guard that must NOT fire on
    # valid input) fails by its own assertion; any other exception with a fault in its chain
    # is the fault's.
    explicit = isinstance(exc, AssertionError) or name == "Failed"
    if is_cuda_error(exc) and not explicit:
        return Route.TRAP
    if name == "Failed" and "Timeout" in str(exc):
        return Route.TIMEOUT
    if isinstance(exc, AssertionError) or name == "Failed":
        return Route.ASSERTION
    if isinstance(exc, Refusal):  # a deliberate refusal; any other ValueError (numpy's) is an error
        return Route.REFUSAL
    return Route.ERROR


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if isinstance(exc, AssertionError) and line:
        return line
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__




def failure_message(exc: BaseException) -> str:
    """The exception's whole message (bounded), type first unless it is an assertion."""
    text = str(exc).strip()
    if not isinstance(exc, AssertionError):
        text = f"{type(exc).__name__}: {text}"
    return text[:MESSAGE_LIMIT]


@dataclass
class RunFacts:
    device: str | None
    arch: str | None
    kernel_root: str
    compile_options: list[str]
    require_gpu: bool
    poisoned_by: str | None = None
    devices: list[dict] = field(default_factory=list)  # every GPU a gate ran on: ordinal, uuid, name
    sanitizer: str | None = None
    shard: str | None = None  # "K/N" of a --shard run; "merged: 1/N, ..., N/N" of their merged report


def summarize(records: list[GateRecord]) -> dict:
    out = {Outcome.PASSED.value: 0, Outcome.FAILED.value: 0, Outcome.SKIPPED.value: 0, Outcome.ERROR.value: 0,
           "gpu_executed": 0, "gpu_skipped": 0}
    for r in records:
        out[r.outcome] += 1
        if r.gpu and r.outcome in (Outcome.PASSED, Outcome.FAILED):
            out["gpu_executed"] += 1
        if r.gpu and r.outcome == Outcome.SKIPPED:
            out["gpu_skipped"] += 1
    return out


def gates_json(records: list[GateRecord], facts: RunFacts) -> dict:
    return {
        "version": RECORD_VERSION,
        "device": facts.device,
        "arch": facts.arch,
        "kernel_root": facts.kernel_root,
        "compile_options": facts.compile_options,
        "require_gpu": facts.require_gpu,
        "poisoned_by": facts.poisoned_by,
        "devices": facts.devices,
        "sanitizer": facts.sanitizer,
        **({"shard": facts.shard} if facts.shard else {}),
        "summary": summarize(records),
        "gates": [r.to_json() for r in records],
    }


def _md_cell(text) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def summary_markdown(records: list[GateRecord], facts: RunFacts) -> str:
    s = summarize(records)
    lines = ["# Gate run", ""]
    lines.append(
        f"**{s['passed']} passed, {s['failed']} failed, {s['error']} errors, {s['skipped']} skipped**; "
        f"GPU gates executed: {s['gpu_executed']}, skipped: {s['gpu_skipped']}."
    )
    lines.append("")
    lines.append(f"- device: {facts.device or 'none'}")
    for d in facts.devices:
        lines.append(f"  - GPU {d['ordinal']}: {d['name']} ({d['uuid']})")
    if facts.sanitizer:
        lines.append(f"- sanitizer: compute-sanitizer {facts.sanitizer}")
    if facts.shard:
        lines.append(f"- shard {facts.shard}")
    lines.append(f"- arch: {facts.arch or 'n/a'}")
    lines.append(f"- kernel root: `{facts.kernel_root}`")
    lines.append(f"- compile options: `{' '.join(facts.compile_options)}`")
    if facts.poisoned_by:
        lines.append(f"- `{facts.poisoned_by}` poisoned the CUDA context; later GPU gates ran in fresh processes")
    if s["gpu_skipped"] and not s["gpu_executed"]:
        lines += ["", f"> **{s['gpu_skipped']} GPU gates were skipped: this run proves nothing about the kernels.**"]
    red = [r for r in records if r.red]
    if red:
        lines += ["", "## Red gates", "", "| gate | kind | route | first failure line |", "| --- | --- | --- | --- |"]
        for r in red:
            lines.append(f"| `{_md_cell(r.nodeid)}` | {_md_cell(r.kind)} | {_md_cell(r.route)} | {_md_cell(r.first_failure_line)} |")
    with_oracle = [r for r in records if r.oracle]
    if with_oracle:
        lines += ["", "## Oracles", "", "Gates whose expected values came from a reference function (`harness.library.reference`).",
                  "", "| gate | kind | oracle | compared | outcome |", "| --- | --- | --- | --- | --- |"]
        for r in with_oracle:
            lines.append(f"| `{_md_cell(r.nodeid)}` | {_md_cell(r.kind)} | {_md_cell(r.oracle)} | "
                         f"{_md_cell('; '.join(r.compared))} | {r.outcome} |")
    lines += ["", "## All gates", "", "| gate | kind | outcome | seconds |", "| --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| `{_md_cell(r.nodeid)}` | {_md_cell(r.kind)} | {r.outcome} | {r.duration:.3f} |")
    return "\n".join(lines) + "\n"


def write_reports(directory: Path, records: list[GateRecord], facts: RunFacts) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    j = directory / "gates.json"
    m = directory / "summary.md"
    j.write_text(json.dumps(gates_json(records, facts), indent=2) + "\n")
    m.write_text(summary_markdown(records, facts))
    return j, m


class MergeError(UsageError):
    """Reports that cannot be one: the message is one line naming the fix."""


GATES_JSON_HOLDS = ('a gates.json is what `pytest --harness-report DIR` writes: {"version": 1, "gates": [{"nodeid": '
                    '..., "outcome": ...}, ...]}; pass that folder')
SHARD = re.compile(r"([1-9][0-9]*)/([1-9][0-9]*)")


def _read_gates_json(folder: Path) -> dict:
    """The gates.json in `folder`, checked to be one a gate run wrote. Raises MergeError naming
    the file and what it must hold."""
    path = folder / "gates.json"
    if not path.is_file():
        raise MergeError(f"{folder} holds no gates.json: pass the --harness-report DIR of each shard")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise MergeError(f"{path} is not JSON ({exc.msg}: line {exc.lineno} column {exc.colno}): "
                         f"{GATES_JSON_HOLDS}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MergeError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc}): "
                         f"{GATES_JSON_HOLDS}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gates"), list):
        raise MergeError(f"{path} holds no gates list: {GATES_JSON_HOLDS}")
    outcomes = [o.value for o in Outcome]
    for i, gate in enumerate(data["gates"]):
        if not isinstance(gate, dict) or not isinstance(gate.get("nodeid"), str) or not gate["nodeid"]:
            raise MergeError(f"{path}: gates[{i}] has no nodeid: {GATES_JSON_HOLDS}")
        if gate.get("outcome", Outcome.PASSED.value) not in outcomes:
            raise MergeError(f"{path}: gates[{i}] has outcome {gate.get('outcome')!r}, not one of "
                             f"{', '.join(outcomes)}: {GATES_JSON_HOLDS}")
        if not isinstance(gate.get("duration", 0.0), (int, float)) or isinstance(gate.get("duration"), bool):
            raise MergeError(f"{path}: gates[{i}] has duration {gate.get('duration')!r}, not a number of seconds: "
                             f"{GATES_JSON_HOLDS}")
    shard = data.get("shard")
    match = SHARD.fullmatch(shard) if isinstance(shard, str) else None
    if shard is not None and (match is None or int(match[1]) > int(match[2])):
        raise MergeError(f"{path}: shard {shard!r} is not K/N with 1 <= K <= N, as `pytest --shard K/N` writes "
                         f"it: {GATES_JSON_HOLDS}")
    return data


def merge(directories: list[Path]) -> tuple[list[GateRecord], RunFacts]:
    """The gates.json of the N shards of one gate run (`--shard K/N` on N hosts) as one run:
    every gate once, in the shards' order; the devices of all. Refuses a missing gates.json,
    a gate in two reports, a shard missing or named twice, and runs for different archs."""
    reports = [(Path(d), _read_gates_json(Path(d))) for d in directories]
    shards = [data.get("shard") for _, data in reports]
    if any(shards):
        counts = {s.split("/")[1] for s in shards if s}
        want = {f"{k}/{n}" for n in counts for k in range(1, int(n) + 1)}
        if None in shards or len(counts) > 1 or sorted(shards) != sorted(want):
            raise MergeError(f"the reports hold shards {', '.join(str(s) for s in shards)}, not each of "
                             f"{', '.join(sorted(want))} once: pass the report folder of every shard of one run")
    if not any(data["gates"] for _, data in reports):
        raise MergeError("the reports hold no gate: nothing to merge; pass the --harness-report DIR of each shard of "
                         "a run that ran its gates")
    archs = sorted({data.get("arch") for _, data in reports if data.get("arch")})
    if len(archs) > 1:
        raise MergeError(f"the reports ran for different archs ({', '.join(archs)}): merge only the shards of one "
                         "gate run on one kind of GPU")
    records: dict[str, tuple[GateRecord, Path]] = {}
    for d, data in reports:
        for gate in data.get("gates", []):
            rec = GateRecord.from_json(gate)
            if rec.nodeid in records:
                raise MergeError(f"{rec.nodeid} is in both {records[rec.nodeid][1]} and {d}: merge the shards of one "
                                 "split, each gate in one of them")
            records[rec.nodeid] = (rec, d)
    first = reports[0][1] if reports else {}
    devices = [dev for _, data in reports for dev in data.get("devices", [])]
    names = sorted({data["device"] for _, data in reports if data.get("device")})
    facts = RunFacts(device=", ".join(names) or None, arch=archs[0] if archs else None,
                     kernel_root=first.get("kernel_root", ""), compile_options=first.get("compile_options", []),
                     require_gpu=all(data.get("require_gpu") for _, data in reports),
                     poisoned_by=next((data["poisoned_by"] for _, data in reports if data.get("poisoned_by")), None),
                     devices=devices, sanitizer=first.get("sanitizer"),
                     shard=f"merged: {', '.join(sorted(shards))}" if any(shards) else None)
    return [rec for rec, _ in records.values()], facts
