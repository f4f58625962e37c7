"""Mutation campaigns: `python -m harness mutate` (docs/mutation.md). They stand on the run
layer (`harness.runs`: the sandbox, the executors, the verdict vocabulary, the slots).

    cli.py        the command's options, into a campaign
    generate.py   mutants of device code from the tree-sitter CUDA grammar (operators.py)
    screen.py     the CPU screen in a process pool: compile-error, equivalent, duplicate (elf.py)
    select.py     which gates load a module or read a source (harness.library.coverage, recorder.py)
    callgraph.py  which kernels can run a device function (--trap-gates reached)
    execute.py    a mutant's selected gates on an executor, their records judged into a verdict
    static.py     --static's gate stage: the gates that need no device, on the CPU
    campaign.py   the steps in order, the results file, --resume
    store.py      the verdict store: a final verdict reused under a digest of what it rests on
    recheck.py    verdict integrity: mutants run again through other executors
    verdicts.py   MutantResult, the results file, scores (Verdict is harness.runs.verdict's)
    report.py     mutation.json (Stryker's schema, vendored in schema/), mutation.html, the table
    bench.py      `python -m harness bench mutate`: the warm campaign against the naive way
"""
