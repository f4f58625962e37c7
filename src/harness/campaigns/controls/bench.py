"""Time the campaign against the naive way, in one run, on the same controls.

    python -m harness.campaigns.controls.bench [NAME ...] [the options of `python -m harness controls`]

1. the campaign as `python -m harness controls` runs it, starting from a cold compile
   cache of its own (so it pays for every compile once, honestly): one baseline over
   the modules involved, one compile per perturbed module, one pytest over each
   control's gate modules;
2. the naive way: per control a fresh pytest over the whole gates folder, each with a
   cold compile cache (`--naive`).

Prints both wall times and their ratio, checks the two agree on every verdict, and
writes bench.json beside each mode's controls.json / controls.md. The naive way costs
roughly (controls x a full gate run): select a few controls by NAME on a shared device.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

from harness.campaigns.controls import report
from harness.campaigns.controls.cli import ExitStatus, build_parser, config_from
from harness.campaigns.controls.runner import run_campaign
from harness.campaigns.controls.spec import ControlSpecError
from harness.core.usage import UsageError


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    parser = build_parser()
    parser.prog = "python -m harness.campaigns.controls.bench"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.static or args.naive:
        parser.error("bench runs both modes itself; drop --static / --naive")
    out = Console(highlight=False, soft_wrap=True)
    try:
        base = config_from(args)
    except UsageError as exc:
        parser.error(str(exc))
    report_dir = base.path(base.report_dir)
    cold = Path(tempfile.mkdtemp(prefix="harness-bench-cache-"))
    results = {}
    try:
        for mode, config in (
            ("campaign", dataclasses.replace(base, cache_dir=cold, report_dir=report_dir / "bench-campaign")),
            ("naive", dataclasses.replace(base, naive=True, report_dir=report_dir / "bench-naive")),
        ):
            out.print(f"[bold]{mode}[/] ...")
            campaign = run_campaign(config)
            report.write(config.report_dir, campaign)
            results[mode] = campaign
            out.print(f"{mode}: {campaign.seconds:.1f} s, {len(campaign.controls)} controls")
            if campaign.baseline_red:
                out.print(f"[bold red]baseline red in {mode} mode[/]: {escape(str(campaign.baseline.log))}")
                return ExitStatus.BASELINE_RED
    except ControlSpecError as exc:
        out.print(escape(str(exc)))
        return ExitStatus.USAGE
    finally:
        shutil.rmtree(cold, ignore_errors=True)
    fast, naive = results["campaign"], results["naive"]
    verdicts = {mode: {r.name: (report.word(r.verdict) if r.verdict else None) for r in c.controls} for mode, c in results.items()}
    disagree = sorted(n for n in verdicts["campaign"] if verdicts["campaign"][n] != verdicts["naive"].get(n))
    ratio = naive.seconds / fast.seconds if fast.seconds else float("inf")
    data = {
        "controls": sorted(verdicts["campaign"]),
        "campaign_seconds": round(fast.seconds, 2),
        "naive_seconds": round(naive.seconds, 2),
        "speedup": round(ratio, 2),
        "jobs": base.jobs,
        "verdicts": verdicts,
        "disagree": disagree,
    }
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "bench.json").write_text(json.dumps(data, indent=2) + "\n")
    out.print(f"campaign {fast.seconds:.1f} s, naive {naive.seconds:.1f} s: {ratio:.1f}x faster "
              f"over {len(fast.controls)} controls; verdicts {'agree' if not disagree else 'DISAGREE: ' + ', '.join(disagree)}")
    return ExitStatus.OK if not disagree else ExitStatus.CONTROLS_DIFFER


if __name__ == "__main__":
    sys.exit(main())
