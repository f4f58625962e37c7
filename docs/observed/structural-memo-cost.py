"""What the structural gates' memo saves a mutant, on the CPU: `gates/test_thread_roles.py` as
it was before the memo (read from git) against today's, on a random sample of one file's
mutants, in one process, the memo first warmed on the unmutated tree as the campaign's server
does (`HARNESS_SERVER_WARM=structural`). Each mutant's verdicts must agree, gate by gate.

    python3 docs/observed/structural-memo-cost.py moe_decode.cu 40
"""

import random
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEFORE = "6f1ae5c"  # the last commit before the memo
sys.path.insert(0, str(REPO))

from harness import _settings  # noqa: E402
from harness.mutate.generate import generate  # noqa: E402
from harness.mutate.operators import parse_operators  # noqa: E402

import gates.test_thread_roles as new  # noqa: E402

old = types.ModuleType("test_thread_roles_before")
exec(compile(subprocess.run(["git", "show", f"{BEFORE}:gates/test_thread_roles.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout, "before", "exec"), old.__dict__)
file, count = sys.argv[1], int(sys.argv[2])
root = REPO / "kernels_cu"
box = Path(tempfile.mkdtemp()) / "kernels_cu"
shutil.copytree(root, box)
_settings.configure(kernel_root=box)
cases = [("test_strided_loops_take_every_index_once", (f,)) for f in sorted(new.KERNELS)] + \
        [("test_each_address_has_one_writer_a_step", k) for k in sorted(new.ONE_WRITER)] + \
        [("test_lane_is_the_hardware_lane", k) for k in new.LANE_KERNELS]
cases = [(name, args) for name, args in cases if args[0] == file]


def verdicts(module) -> list[str]:
    out = []
    for name, args in cases:
        try:
            getattr(module, name)(box, *args)
            out.append("pass")
        except BaseException as exc:  # noqa: BLE001 - a red gate: its message is its verdict
            out.append(f"{type(exc).__name__}: {exc}")
    return out


start = time.perf_counter()
verdicts(new)  # the server's warm-up, on the unmutated tree
warm = time.perf_counter() - start
mutants, _ = generate(root, [file], parse_operators(None))  # every operator, as a campaign
random.seed(7)
original = (root / file).read_bytes()
spent = {"before": 0.0, "memo": 0.0}
differ = 0
for m in random.sample(mutants, count):
    (box / file).write_bytes(m.apply(original))
    a = time.perf_counter()
    before = verdicts(old)
    b = time.perf_counter()
    after = verdicts(new)
    spent["before"] += b - a
    spent["memo"] += time.perf_counter() - b
    differ += before != after
(box / file).write_bytes(original)
print(f"{file}: {len(cases)} gate cases, memo warmed in {warm:.1f} s; {count} random mutants: "
      f"before {spent['before'] / count:.3f} s a mutant, memo {spent['memo'] / count:.3f} s a mutant; "
      f"{differ} mutant(s) with a different verdict")
