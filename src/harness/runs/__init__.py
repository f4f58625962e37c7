"""The run layer both campaigns stand on: a perturbed tree, what runs its gates, and what it
returns. `controls/` and `mutate/` sit on it side by side and differ only in where their
perturbations come from and how they report them.

- `config`: what every campaign is told (`RunConfig`);
- `sandbox`: a fresh copy of the kernel root, the only place a perturbation is written;
- `compilecheck`: compiling a perturbed tree's modules once, into the cache its gates read;
- `result`: the one run result (`GateRuns`), the `Baseline`, `CampaignRun`, and the
  `Executor` / `ExecutorFactory` protocols;
- `verdict`: the one verdict vocabulary;
- `slots`: the one slot scheduler (`run_in_slots`);
- `fresh`: a fresh pytest over some gates with a deadline, and its executor;
- `forkserver` (and `harness/core/forkserver_main.py`, its process): each fresh pytest a fork of a server that
  imported pytest once, where that is what a spawn would be; `fresh_bench` times both ways;
- `warm`: the executor on the warm pool's workers, one per GPU;
- `cpu` (and `cpu_serve`, the plugin of its child): the executor for the gates that need no
  device, mutant after mutant, in one pytest that collected them once;
- `cluster`: a Ray cluster as the place the gates run (the connection, what is shipped);
  `ray_executor`: the executor on its GPU actors, a warm executor each.
"""
