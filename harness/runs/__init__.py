"""The run layer every engine stands on: what runs a perturbed tree's gates and what it
returns.

- `result`: the one run result (`GateRuns` of `GateRecord`s) and the `Executor` protocol;
- `fresh`: a fresh pytest process over some gates, with a deadline (`run_gates`), and the
  executor made of it;
- `warm`: the executor on the warm pool's workers (forked from a server that collected the
  gates, contexts made ahead, reset between trees).

The controls engine and the mutation engine differ only in where their perturbed trees come
from and how they report.
"""
