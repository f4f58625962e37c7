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
- `forkserver` (and `harness/_forkserver.py`, its process): each fresh pytest a fork of a server that
  imported pytest once, where that is what a spawn would be; `fresh_bench` times both ways;
- `warm`: the executor on the warm pool's workers, one per GPU.
"""
