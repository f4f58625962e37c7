"""Registers the harness plugin for runs from the repo root with nothing installed.
When `harness` is installed, its pytest11 entry point has loaded it already.
`pytester` serves the harness's own plugin tests in tests/."""

import sys

pytest_plugins = ["pytester"] + ([] if "harness.plugin" in sys.modules else ["harness.plugin"])
