#!/usr/bin/env bash
# On one H200 (run from the repo root, the Ray wheels carried in .whl-ray/): the seeded sample
# locally, then on a one-node Ray cluster (`ray start --head --num-gpus=1`), the verdicts
# compared mutant by mutant and Ray's cost a mutant printed. Everything goes under $OUT;
# about 5 minutes.
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_VISIBLE_DEVICES=0 HARNESS_CACHE_DIR="$OUT/cache" RAY_USAGE_STATS_ENABLED=0
SAMPLE=(--seed 1 --max-per-file 20 --gpu-jobs 12 --jobs 16 --recheck 0)

python3 -m pip install --no-index --find-links .whl-ray ray >"$OUT/pip.log" 2>&1 \
    || { echo "the Ray wheels did not install: see pip.log"; tail -3 "$OUT/pip.log"; exit 1; }
python3 -c 'import ray; print("ray", ray.__version__)' | tee "$OUT/versions.txt"

# 1. local: the reference (it also fills the cubin cache both runs read)
SECONDS=0
timeout -s INT 200 python3 -m harness mutate "${SAMPLE[@]}" --report "$OUT/local" >"$OUT/local.txt" 2>&1
echo "local: exit $? in ${SECONDS} s" | tee -a "$OUT/summary.txt"

# 2. Ray, one node: the head started here with this GPU, the campaign connects to it
python3 -m ray.scripts.scripts start --head --num-gpus=1 --num-cpus=16 --include-dashboard=false \
    >"$OUT/ray-start.log" 2>&1 || { echo "ray start failed: see ray-start.log"; exit 1; }
SECONDS=0
timeout -s INT 240 python3 -m harness mutate "${SAMPLE[@]}" --report "$OUT/ray" --ray auto >"$OUT/ray.txt" 2>&1
echo "ray: exit $? in ${SECONDS} s" | tee -a "$OUT/summary.txt"
python3 -m ray.scripts.scripts stop --force >>"$OUT/ray-start.log" 2>&1
cp -r /tmp/ray/session_latest/logs "$OUT/ray-logs" 2>/dev/null; tar czf "$OUT/ray-logs.tgz" -C "$OUT" ray-logs 2>/dev/null \
    && rm -rf "$OUT/ray-logs"

# 3. mutant by mutant, and what Ray costs a mutant
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(name):
    return {json.loads(l)["mutant"]["id"]: json.loads(l) for l in (out / name / "mutants.jsonl").read_text().splitlines()}
def facts(name):
    return json.loads((out / name / "mutation.json").read_text())["harness"]
local, ray = rows("local"), rows("ray")
same = [i for i in local if i in ray and local[i]["verdict"] == ray[i]["verdict"]]
differ = {i: (local[i]["verdict"], ray[i]["verdict"], ray[i]["reason"][:120]) for i in local if i in ray and i not in same}
gpu = [i for i in same if local[i]["gate_seconds"] and ray[i]["gate_seconds"]]
per = [ray[i]["gate_seconds"] - local[i]["gate_seconds"] for i in gpu]
lf, rf = facts("local"), facts("ray")
result = {
    "mutants": len(local), "in_both": len(set(local) & set(ray)), "same_verdict": len(same), "differ": differ,
    "ran_on": sorted({json.dumps(r.get("ran_on")) for r in ray.values() if r.get("ran_on")}),
    "local": {k: lf[k] for k in ("seconds", "screen_seconds", "gpu_seconds")},
    "ray": {k: rf[k] for k in ("seconds", "screen_seconds", "gpu_seconds")},
    "reached_gpu": len(gpu),
    # a mutant's own gate stage on Ray minus locally: the round trip, the diff, the cubins shipped
    "ray_overhead_ms_median": round(1000 * statistics.median(per), 1) if per else None,
    "ray_overhead_ms_mean": round(1000 * statistics.mean(per), 1) if per else None,
    # the gate stage's wall time a mutant that reached the GPU, Ray minus local (12 at once)
    "ray_gate_stage_ms_a_mutant": round(1000 * (rf["gpu_seconds"] - lf["gpu_seconds"]) / max(1, len(gpu)), 1),
    # what Ray adds before the first mutant: connecting, shipping the rootdir, the actor's start
    "ray_start_s": round((rf["seconds"] - rf["gpu_seconds"]) - (lf["seconds"] - lf["gpu_seconds"]), 1),
}
(out / "ray-h200.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"{result['same_verdict']} of {result['in_both']} verdicts the same ({len(differ)} differ: {differ})")
print(f"Ray's cost a mutant: median {result['ray_overhead_ms_median']} ms, mean {result['ray_overhead_ms_mean']} ms "
      f"of its own gate stage; the gate stage {result['ray_gate_stage_ms_a_mutant']} ms a mutant longer; "
      f"{result['ray_start_s']} s more before the first mutant; ran on {result['ran_on']}")
PY
tail -4 "$OUT/ray.txt"
