"""A mutation campaign on a Ray cluster with no GPU: a local cluster of simulated nodes (Ray's
own `cluster_utils.Cluster`), each node offering a fake GPU resource, and the fake device of
the warm executor's tests (tests/test_mutate_warm.py) behind every actor's pool. The same
seeded sample runs locally and on the cluster; the cluster's run is cut (the head's driver
lost), resumed, and one node is removed while a mutant is on its way to it: every verdict
equals the local run's, each made once and recording its node and GPU. A control then runs
on the node left. One cluster for all of it: its start is most of the test's time."""

import json
from pathlib import Path

import pytest

from tests._machine import RAY

ray = RAY.module("ray")

from harness.campaigns.mutate import cli  # noqa: E402
from harness.runs import cluster as cluster_mod  # noqa: E402
from harness.runs.ray_executor import RayExecutor  # noqa: E402
from test_mutate_warm import CONFTEST, make_suite  # noqa: E402

SAMPLE = ["--no-require-gpu", "--seed", "1", "--max-per-file", "5", "--deadline", "30", "--jobs", "1",
          "--recheck", "0"]
# the fake device's gates read the kernel's text: a mutant of the guarded store is killed by
# assertion, one of the index only by a fault
KERNEL = ("__global__ void k(float* y, const float* x, int n) {\n"
          "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
          "    if (i < n) y[i] = x[i] + 1;\n"
          "    int unused = n * 3;\n}\n")
MINUS = """
description = "subtracts one"
file = "k.cu"
find = "x[i] + 1"
replace = "x[i] - 1"
why = "the anchor reads the store"

[[expect]]
gate = "gates/test_k.py::test_adds_one"
route = "assertion"
message = "out is not x + 1 where i < n"
"""
GATES = """
import pytest
from harness.library import coverage

class CUDARuntimeError(RuntimeError):
    pass

def text(kernel_root):
    coverage.note_module("k.cu")
    return (kernel_root / "k.cu").read_text()

@pytest.mark.gpu
@pytest.mark.anchor
def test_adds_one(kernel_root):
    assert "if (i < n) y[i] = x[i] + 1;" in text(kernel_root), "out is not x + 1 where i < n"

@pytest.mark.gpu
@pytest.mark.anchor
def test_index(kernel_root):
    if "blockIdx.x * blockDim.x + threadIdx.x" not in text(kernel_root):
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
"""


def _results(report: Path) -> list[dict]:
    return [json.loads(line) for line in (report / "mutants.jsonl").read_text().splitlines()]


def test_a_campaign_on_a_ray_cluster_gives_the_local_verdicts_through_a_lost_head_and_a_lost_node(
        tmp_path, monkeypatch, capsys):
    from ray.cluster_utils import Cluster

    root, ex = make_suite(tmp_path, monkeypatch, GATES, KERNEL)
    ex.close()
    assert "harness.core.device" in CONFTEST  # the fake device every actor's pool probes
    common = ["--rootdir", str(root), *SAMPLE, "--cache-dir", str(tmp_path / "cache")]
    local = tmp_path / "local"
    assert cli.main([*common, "--report", str(local)]) in (0, 1), capsys.readouterr()
    expected = {r["mutant"]["id"]: (r["verdict"], r["killed_by"]) for r in _results(local)}
    assert {"killed", "killed-by-trap"} <= {v for v, _ in expected.values()}, expected

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "node-cache"))  # each node's own cache
    # Ray refuses to start a node offering a GPU where CUDA_VISIBLE_DEVICES hides every device;
    # it sets each actor's to the simulated GPU it hands out, and the fake device stands in
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    try:
        report = tmp_path / "ray"
        on_ray = [*common, "--report", str(report), "--ray", cluster.address]
        # the head's driver is lost after two verdicts: what it recorded stays
        real_finished, left = cli._Progress.finished, [2]

        def finished_then_lose_the_driver(progress, result):
            real_finished(progress, result)
            left[0] -= 1
            if left[0] == 0:
                raise KeyboardInterrupt

        monkeypatch.setattr(cli._Progress, "finished", finished_then_lose_the_driver)
        assert cli.main(on_ray) == 130
        assert len(_results(report)) == 2
        monkeypatch.setattr(cli._Progress, "finished", real_finished)

        # resumed; the first mutant sent to a GPU finds its node gone
        import threading

        real_take, removed, once = RayExecutor._take, [], threading.Lock()

        def take_then_lose_its_node(self):
            slot = real_take(self)
            if once.acquire(blocking=False):  # the first slot's call only, whichever thread
                removed.append(slot.name)
                cluster.remove_node(next(n for n in nodes if n.node_id.startswith(slot.name.split("(")[1][:8])))
            return slot

        monkeypatch.setattr(RayExecutor, "_take", take_then_lose_its_node)
        status = cli.main([*on_ray, "--resume"])
        got = capsys.readouterr()
        printed = " ".join(got.out.split())
        assert status in (0, 1), got.err

        # a control on the node left: proven there, and it says where
        from harness.campaigns.controls import cli as controls_cli

        (root / "controls").mkdir()
        (root / "controls" / "minus.toml").write_text(MINUS)
        assert controls_cli.main(["--rootdir", str(root), "--no-require-gpu", "--cache-dir", str(tmp_path / "cache"),
                                  "--report", str(tmp_path / "controls"), "--ray", cluster.address]) == 0, \
            capsys.readouterr()
        control, = json.loads((tmp_path / "controls" / "controls.json").read_text())["controls"]
        assert (control["verdict"], control["matches_expectation"]) == ("proven", True), control
        assert control["ran_on"]["node_id"] != removed[0].split("(")[1][:8]
    finally:
        cluster.shutdown()
    rows = _results(report)
    ids = [r["mutant"]["id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(expected), "each mutant recorded exactly once"
    assert {r["mutant"]["id"]: (r["verdict"], r["killed_by"]) for r in rows} == expected
    gpu_run = [r for r in rows if r["gate_seconds"]]
    assert gpu_run and all(r["ran_on"]["node_id"] and r["ran_on"]["gpu"] for r in gpu_run), gpu_run
    assert removed and f"ray: 1 GPU actor(s) lost ({removed[0]}" in printed and "1 run(s) made again" in printed
    # the screen compiled on the nodes, into their own cache, and shipped its cubins back
    assert "screening 3 mutants on the cluster's CPUs" in got.err
    assert list((tmp_path / "node-cache").rglob("*.cubin")) and list((tmp_path / "cache").rglob("*.cubin"))
    # after the loss, the surviving node made every verdict of the resumed run
    report_json = json.loads((report / "mutation.json").read_text())
    assert set(report_json["harness"]["verdicts"]) == set(expected)
    assert report_json["harness"]["ran_on"] and (report / "mutation.html").is_file()


# ---------------------------------------------------------------- one clear line, no cluster


def test_ray_missing_or_too_old_is_one_line_naming_the_fix(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(cluster_mod.ClusterError, match=r"pip install -e '\.\[ray\]'"):
        cluster_mod.import_ray()
    monkeypatch.setitem(sys.modules, "ray", type(sys)("ray"))
    sys.modules["ray"].__version__ = "2.3.1"
    with pytest.raises(cluster_mod.ClusterError, match=r"Ray 2\.3\.1 is too old for --ray \(it needs 2\.10 or newer\)"):
        cluster_mod.import_ray()


def test_a_cluster_with_no_gpu_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(ray, "init", lambda **k: calls.append(k))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    (tmp_path / "kernels").mkdir()
    with pytest.raises(cluster_mod.ClusterError) as info:
        cluster_mod.connect("10.0.0.1:6379", tmp_path, tmp_path / "kernels")
    assert str(info.value).startswith("the Ray cluster at 10.0.0.1:6379 has no GPU: start each GPU node")
    assert "\n" not in str(info.value) and calls[-1] == "shutdown"
    assert calls[0]["runtime_env"]["working_dir"] == str(tmp_path.resolve())


def test_a_kernel_root_outside_the_shipped_rootdir_is_refused(tmp_path):
    with pytest.raises(cluster_mod.ClusterError, match="is outside the rootdir .* which is all --ray ships"):
        cluster_mod.shipped_tree(tmp_path / "project", tmp_path / "elsewhere")


def test_a_sandbox_ships_only_the_files_it_changed(tmp_path):
    from harness.runs.sandbox import sandbox, write

    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "a.cu").write_text("a")
    (tmp_path / "k" / "b.cuh").write_text("b")
    with sandbox(tmp_path / "k", "t") as copy:
        assert cluster_mod.changed_files(tmp_path / "k", copy) == {}
        write(copy, "b.cuh", "B")
        assert cluster_mod.changed_files(tmp_path / "k", copy) == {"b.cuh": "B"}


def test_cache_entries_travel_and_land_only_inside_the_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "abcd.cubin").write_bytes(b"\x7fELF")
    (cache / "ab" / "abcd.json").write_text("{}")
    entries = cluster_mod.read_entries(cache, ["abcd", "ffff"])
    assert entries == {"ab/abcd.cubin": b"\x7fELF", "ab/abcd.json": b"{}"}
    cluster_mod.write_entries(tmp_path / "node", entries)
    assert (tmp_path / "node" / "ab" / "abcd.cubin").read_bytes() == b"\x7fELF"
    with pytest.raises(ValueError, match="outside the cache"):
        cluster_mod.write_entries(tmp_path / "node", {"../evil": b""})
