"""Mutation campaigns: `python -m harness mutate` (docs/mutation.md).

    generate.py   mutants of device code from the tree-sitter CUDA grammar (operators.py)
    screen.py     the CPU screen in a process pool: compile-error, equivalent, duplicate (elf.py)
    select.py     which gates load a module or read a source (harness.coverage, recorder.py)
    execute.py    the Executor seam and today's fresh-process executor; verdict rules
    campaign.py   the steps in order, the results file, --resume
    verdicts.py   Verdict, MutantResult, scores (this package's own types until the shared
                  records module replaces them)
    report.py     mutation.json (Stryker's schema, vendored in schema/), mutation.html, the table
"""
