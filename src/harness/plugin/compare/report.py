"""What a comparison says: the terminal's table, `compare.json` and `compare.md`, and what to do
about a gate with nothing to compare."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from harness.library.timing import DEFAULT_WARMUP
from harness.plugin.compare.arms import ArmComparison, ArmStatus, GateComparison, KernelTiming, Speed


def table(ref: str, gates: list[GateComparison]) -> list[str]:
    arms = [a for g in gates for a in g.arms]
    lines = [f"compare to {ref}: {len(gates)} gate(s), {len(arms)} arm(s): "
             f"{sum(a.status == ArmStatus.SAME_BITS for a in arms)} same bits, "
             f"{sum(a.status == ArmStatus.DIFFERS for a in arms)} differ, "
             f"{sum(a.status not in (ArmStatus.SAME_BITS, ArmStatus.DIFFERS) for a in arms)} do not pair up"]
    timings = [t for g in gates for t in g.timing]
    if timings:
        lines.append(f"timing: {len(timings)} kernel(s) in {sum(bool(g.timing) for g in gates)} gate(s): "
                     + ", ".join(f"{sum(t.speed == w for t in timings)} {w}" for w in Speed))
    for g in gates:
        if not g.arms and not g.timing:
            continue
        lines.append(f"{g.nodeid} (REF: {g.ref_outcome}; today: {g.today_outcome})")
        for a in g.arms:
            lines.append(f"  {a.arm}: {arm_text(a)}")
        for t in g.timing:
            lines.append(f"  time {t.kernel}: {timing_text(t)}, {g.bits}")
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
    if g.kind == "compile":
        return "no arm output: compile gates give their verdict by compiling, not by a value"
    if not sum(g.launches.get("today", {}).values()) + sum(g.launches.get("ref", {}).values()):
        return ("no arm output, and no kernel launched on either side: nothing to compare (host-only gates; "
                "select the GPU gates, e.g. -m gpu)")
    return ("no arm output on either side, though kernels were launched: check a value with assert_bits_eq / "
            "assert_close, or record one with harness.record(label, array)")


def timing_text(t: KernelTiming) -> str:
    return (f"REF {t.ref_us:.2f} us, today {t.today_us:.2f} us (median of {t.repeat}, summed over "
            f"{t.launches} launch(es); quartiles REF {t.ref_quartiles[0]:.2f}-{t.ref_quartiles[1]:.2f}, today "
            f"{t.today_quartiles[0]:.2f}-{t.today_quartiles[1]:.2f}): {t.ratio:.2f}x, {t.speed}")


def arm_text(a: ArmComparison) -> str:
    if a.status == ArmStatus.DIFFERS:
        f = a.first
        return (f"differs: {a.differing} of {a.elements} elements; first at {f['index']}: REF {f['ref']} "
                f"({f['ref_bits']}), today {f['today']} ({f['today_bits']}); ULPs max {a.ulps['max']}, median "
                f"{a.ulps['median']:g}, {a.ulps['histogram']}")
    return f"{a.status}" + (f" ({a.note})" if a.note else "")


def write_reports(report_dir: Path, ref: str, gates: list[GateComparison],
                  run: dict | None = None) -> tuple[Path, Path]:
    """compare.json (every gate's arms and timings; `run`: how the sides ran, where given) and compare.md."""
    report_dir.mkdir(parents=True, exist_ok=True)
    data = {"ref": ref, "gates": [{**asdict(g), "differs": g.differs,
                                   "timing": [{**asdict(t), "ratio": round(t.ratio, 4)} for t in g.timing]}
                                  for g in gates]}
    if run is not None:
        data["run"] = run
    json_path = report_dir / "compare.json"
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md = [f"# Compared with {ref}", "", "| gate | arm | REF | today | bits |", "| --- | --- | --- | --- | --- |"]
    for g in gates:
        for a in g.arms:
            md.append(f"| `{g.nodeid}` | {a.arm} | {g.ref_outcome} | {g.today_outcome} | "
                      f"{arm_text(a).replace('|', '/')} |")
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
