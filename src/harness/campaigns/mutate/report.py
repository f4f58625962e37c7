"""Reports: `mutation.json` (Stryker's mutation-testing-report-schema), `mutation.html` (a
self-contained page, offline), and the terminal table.

Our verdicts onto Stryker's statuses, ours kept in `statusReason`:

| verdict | status | statusReason |
| --- | --- | --- |
| killed | Killed | the killing gate and its first failure line |
| killed-by-trap | Killed | "killed by a trap only: ..." (or "killed by a fault in a memory-safety gate: ...") |
| timeout | Timeout | |
| survived | Survived | |
| no-coverage | NoCoverage | |
| compile-error | CompileError | NVRTC's first error line |
| equivalent | Ignored | "equivalent: identical cubin" |
| duplicate | the twin's status | "duplicate of ID" |
| pending (--static) | Pending | |
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from harness.campaigns.mutate.operators import OPERATORS
from harness.campaigns.mutate.verdicts import MutantResult, Verdict, scores, total_score

SCHEMA_VERSION = "2"
THRESHOLDS = {"high": 80, "low": 60}

class Status(str, Enum):
    """The statuses of Stryker's schema that `mutation.json` writes (its values, as written)."""

    KILLED = "Killed"
    SURVIVED = "Survived"
    NO_COVERAGE = "NoCoverage"
    COMPILE_ERROR = "CompileError"
    TIMEOUT = "Timeout"
    IGNORED = "Ignored"
    PENDING = "Pending"

    def __str__(self) -> str:
        return self.value


STATUS = {
    Verdict.KILLED: Status.KILLED,
    Verdict.KILLED_BY_TRAP: Status.KILLED,
    Verdict.TIMEOUT: Status.TIMEOUT,
    Verdict.SURVIVED: Status.SURVIVED,
    Verdict.NO_COVERAGE: Status.NO_COVERAGE,
    Verdict.COMPILE_ERROR: Status.COMPILE_ERROR,
    Verdict.EQUIVALENT: Status.IGNORED,
    Verdict.PENDING: Status.PENDING,
}


def stryker_status(r: MutantResult) -> tuple[Status, str]:
    """(status, statusReason) for one result."""
    if r.verdict is Verdict.DUPLICATE:
        twin = r.effective or Verdict.PENDING
        return STATUS.get(twin, Status.PENDING), f"duplicate of {r.duplicate_of}"
    if r.verdict is Verdict.EQUIVALENT:
        return Status.IGNORED, "equivalent: identical cubin"
    if r.verdict is Verdict.KILLED_BY_TRAP:
        prefix = "killed by a fault in a memory-safety gate" if r.memory_safety else "killed by a trap only"
        reason = r.reason if r.reason.startswith(prefix) else f"{prefix}: {r.reason}"
        return Status.KILLED, reason
    return STATUS[r.verdict], f"{r.verdict.value}: {r.reason}" if r.reason else r.verdict.value


def family(r: MutantResult, campaign) -> str:
    """A `.cu` with the gate files that load it; a header is a row of its own."""
    cov = campaign.coverage
    if cov is None:
        return r.mutant.file
    gate_files = sorted({g.file for n, g in cov.gates.items() if r.mutant.file in cov.modules_of(n)
                         or r.mutant.file in (g.sources or ())})
    return f"{r.mutant.file} ({', '.join(gate_files)})" if gate_files else r.mutant.file


def mutation_json(campaign) -> dict:
    results = campaign.ordered()
    files: dict[str, dict] = {}
    root = Path(campaign.kernel_root)
    for r in results:
        m = r.mutant
        entry = files.get(m.file)
        if entry is None:
            entry = files[m.file] = {"language": "cpp", "source": (root / m.file).read_text(encoding="utf-8"),
                                     "mutants": []}
        status, reason = stryker_status(r)
        mutant = {
            "id": m.id,
            "mutatorName": m.operator,
            "description": m.description,
            "replacement": m.replacement,
            "location": {"start": {"line": m.start_line, "column": m.start_col},
                         "end": {"line": m.end_line, "column": m.end_col}},
            "status": status,
            "statusReason": reason,
            "duration": round(r.seconds * 1000, 1),
        }
        if r.covered_by:
            mutant["coveredBy"] = list(r.covered_by)
        if r.killed_by:
            mutant["killedBy"] = list(r.killed_by)
        if r.gates_run:
            mutant["testsCompleted"] = len(r.gates_run)
        entry["mutants"].append(mutant)
    total = total_score(results)
    return {
        "schemaVersion": SCHEMA_VERSION,
        "thresholds": THRESHOLDS,
        "projectRoot": str(root),
        "framework": {"name": "harness mutate", "version": "1"},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(campaign.config).items()
                   if k != "rootdir"} | {"rootdir": str(campaign.config.rootdir)},
        "files": files,
        "harness": {
            "mode": campaign.mode,
            "arch": campaign.arch,
            "seconds": round(campaign.seconds, 2),
            "screen_seconds": round(campaign.screen_seconds, 2),
            "gpu_seconds": round(campaign.gpu_seconds, 2),
            "gate_stage": dict(campaign.stage),
            "warnings": campaign.warnings,
            "operators": {name: op.reason for name, op in OPERATORS.items()},
            "verdicts": {r.mutant.id: r.verdict.value for r in results},
            "reused": sorted(r.mutant.id for r in results if r.reused),  # from the verdict store (--since)
            # on a cluster (--ray): the node and GPU each verdict was made on
            **({"ran_on": {r.mutant.id: r.ran_on for r in results if r.ran_on}}
               if any(r.ran_on for r in results) else {}),
            "total": total.to_json(),
            "per_file": {k: v.to_json() for k, v in scores(results, lambda r: r.mutant.file).items()},
            "per_family": {k: v.to_json() for k, v in scores(results, lambda r: family(r, campaign)).items()},
            "per_operator": {k: v.to_json() for k, v in scores(results, lambda r: r.mutant.operator).items()},
        },
    }


# ---------------------------------------------------------------- the HTML page

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Mutation report</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; }
table.summary { border-collapse: collapse; } table.summary td, table.summary th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
table.summary td:first-child, table.summary th:first-child { text-align: left; }
#filters label { margin-right: 1em; white-space: nowrap; }
.src { font: 12px/1.35 ui-monospace, monospace; border: 1px solid #ddd; }
.line { display: flex; white-space: pre; } .line .no { color: #999; width: 4em; text-align: right; padding-right: 1em; flex: none; }
.line.hit { background: #fff8e0; }
.mutants { margin: 0 0 2px 5em; }
.mutant { font: 12px ui-monospace, monospace; padding: 1px 6px; margin: 1px 0; border-left: 4px solid #999; white-space: pre-wrap; }
.mutant[data-status="killed"] { border-color: #2a2; background: #efe; }
.mutant[data-status="killed-by-trap"] { border-color: #8a2; background: #f6fbe8; }
.mutant[data-status="timeout"] { border-color: #a82; background: #fff5e6; }
.mutant[data-status="survived"] { border-color: #d22; background: #fee; }
.mutant[data-status="no-coverage"] { border-color: #c6c; background: #fbeffb; }
.mutant[data-status="equivalent"], .mutant[data-status="duplicate"] { border-color: #888; background: #f4f4f4; }
.mutant[data-status="compile-error"] { border-color: #555; background: #eee; }
.mutant[data-status="pending"] { border-color: #48c; background: #eef5ff; }
.hidden { display: none; }
</style></head><body>
<h1>Mutation report</h1>
<p id="meta"></p>
<div id="summary"></div>
<p id="filters"></p>
<div id="files"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const el = (tag, attrs, text) => { const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text; return e; };
  document.getElementById("meta").textContent = data.meta;
  const verdicts = data.verdicts;
  const sum = el("table", {class: "summary"}); const head = el("tr");
  ["file", "mutants", ...verdicts, "score", "stryker score"].forEach(h => head.appendChild(el("th", {}, h)));
  sum.appendChild(head);
  for (const row of data.rows) { const tr = el("tr");
    tr.appendChild(el("td", {}, row.name)); tr.appendChild(el("td", {}, String(row.total)));
    verdicts.forEach(v => tr.appendChild(el("td", {}, String(row.counts[v] || 0))));
    tr.appendChild(el("td", {}, row.score)); tr.appendChild(el("td", {}, row.stryker)); sum.appendChild(tr); }
  document.getElementById("summary").appendChild(sum);
  const shown = new Set(verdicts);
  const filters = document.getElementById("filters");
  const apply = () => document.querySelectorAll(".mutant").forEach(m =>
    m.classList.toggle("hidden", !shown.has(m.dataset.status)));
  verdicts.forEach(v => { const box = el("input", {type: "checkbox", "data-verdict": v}); box.checked = true;
    box.addEventListener("change", () => { box.checked ? shown.add(v) : shown.delete(v); apply(); });
    const label = el("label"); label.appendChild(box); label.appendChild(document.createTextNode(" " + v));
    filters.appendChild(label); });
  const files = document.getElementById("files"); let count = 0;
  for (const f of data.files) {
    files.appendChild(el("h2", {}, f.name));
    const src = el("div", {class: "src"}); const byLine = {};
    f.mutants.forEach(m => (byLine[m.line] = byLine[m.line] || []).push(m));
    f.source.split("\\n").forEach((text, i) => { const no = i + 1;
      const line = el("div", {class: "line" + (byLine[no] ? " hit" : "")});
      line.appendChild(el("span", {class: "no"}, String(no))); line.appendChild(el("span", {}, text));
      src.appendChild(line);
      if (byLine[no]) { const box = el("div", {class: "mutants"});
        byLine[no].forEach(m => { count += 1;
          box.appendChild(el("div", {class: "mutant", "data-status": m.verdict, "data-id": m.id},
            `${m.verdict}  ${m.id}  col ${m.column}  ${m.operator}: ${m.original} \\u2192 ${m.replacement}` +
            (m.reason ? `  (${m.reason})` : ""))); });
        src.appendChild(box); } });
    files.appendChild(src); }
  const done = el("div", {id: "rendered", "data-mutants": String(count)}); done.hidden = true;
  document.body.appendChild(done);
})();
</script></body></html>
"""


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def mutation_html(campaign) -> str:
    results = campaign.ordered()
    root = Path(campaign.kernel_root)
    files: dict[str, dict] = {}
    for r in results:
        m = r.mutant
        f = files.setdefault(m.file, {"name": m.file, "source": (root / m.file).read_text(encoding="utf-8"),
                                      "mutants": []})
        reason = r.reason if r.verdict is not Verdict.DUPLICATE else \
            f"duplicate of {r.duplicate_of}" + (f", which is {r.effective.value}" if r.effective else "")
        f["mutants"].append({"id": m.id, "line": m.start_line, "column": m.start_col, "operator": m.operator,
                             "original": m.original, "replacement": m.replacement, "verdict": r.verdict.value,
                             "reason": reason})
    rows = [{"name": name, "total": s.total, "counts": s.counts, "score": _pct(s.score),
             "stryker": _pct(s.stryker_score)}
            for name, s in scores(results, lambda r: r.mutant.file).items()]
    t = total_score(results)
    rows.append({"name": "total", "total": t.total, "counts": t.counts, "score": _pct(t.score),
                 "stryker": _pct(t.stryker_score)})
    meta = (f"{campaign.mode}, {len(results)} mutants, kernel root {root}, arch {campaign.arch}, "
            f"{campaign.seconds:.1f} s. Score: killed by assertion (or by a fault in a gate written for that "
            f"memory-safety property) over valid mutants (not equivalent, duplicate, "
            f"compile error or pending); Stryker score: killed (assertion or trap) and timeouts over valid.")
    data = {"meta": meta, "verdicts": [v.value for v in Verdict], "rows": rows, "files": list(files.values())}
    # `</` inside the JSON must not close the script element
    return _PAGE.replace("__DATA__", json.dumps(data).replace("</", "<\\/"))


FILES = ("mutation.json", "mutation.html")


def remove(directory: Path) -> None:
    """An earlier run's reports, removed as a campaign starts: however this one ends (a red
    baseline, Ctrl-C), they never stand for it. mutants.jsonl stays: --resume reads it."""
    for name in FILES:
        (Path(directory) / name).unlink(missing_ok=True)


def write(directory: Path, campaign) -> tuple[Path, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    j, h = (directory / name for name in FILES)
    j.write_text(json.dumps(mutation_json(campaign), indent=1) + "\n", encoding="utf-8")
    h.write_text(mutation_html(campaign), encoding="utf-8")
    return j, h


# ---------------------------------------------------------------- terminal

_COLUMNS = ("killed", "killed-by-trap", "timeout", "survived", "no-coverage", "equivalent", "duplicate",
            "compile-error", "pending")


def table(campaign):
    from rich.markup import escape
    from rich.table import Table

    results = campaign.ordered()
    t = Table(title=f"mutation {campaign.mode}: score per file", title_justify="left")
    t.add_column("file")
    t.add_column("mutants", justify="right")
    for c in _COLUMNS:
        t.add_column(c, justify="right")
    t.add_column("score", justify="right")
    t.add_column("stryker", justify="right")
    rows = list(scores(results, lambda r: r.mutant.file).items()) + [("total", total_score(results))]
    for name, s in rows:
        survived = s.counts.get("survived", 0)
        cells = [str(s.counts.get(c, 0)) for c in _COLUMNS]
        if survived:
            cells[_COLUMNS.index("survived")] = f"[bold red]{survived}[/]"
        if s.safety:  # the score counts these: say how many, so the score can be read off the row
            cells[_COLUMNS.index("killed-by-trap")] += f" ({s.safety} ms)"
        t.add_row(escape(name), str(s.total), *cells, _pct(s.score), _pct(s.stryker_score))
    if any(s.safety for _, s in rows):
        t.caption = ("score: killed, plus killed-by-trap in a gate marked memory_safety (ms), over the mutants "
                     "that are not equivalent, duplicate, compile errors or pending")
        t.caption_justify = "left"
    return t
