"""Negative controls: perturb a sandbox copy of the kernel sources and prove that each
named gate goes red by its own assertion.

The façade a user of the library needs; the rest stays in its modules.
"""

from harness.controls.classify import GateCheck
from harness.controls.edits import Edit, EditError
from harness.controls.results import CampaignResult, ControlResult
from harness.controls.runner import CampaignConfig, run_campaign, validate
from harness.controls.spec import Control, ControlSpecError, Expect, Problem, Route, load_controls
from harness.runs.result import Baseline
from harness.runs.verdict import Verdict

__all__ = [
    "Baseline",
    "CampaignConfig",
    "CampaignResult",
    "Control",
    "ControlResult",
    "ControlSpecError",
    "Edit",
    "EditError",
    "Expect",
    "GateCheck",
    "Problem",
    "Route",
    "Verdict",
    "load_controls",
    "run_campaign",
    "validate",
]
