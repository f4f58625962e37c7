"""Negative controls: perturb a sandbox copy of the kernel sources and prove that each
named gate goes red by its own assertion.

The façade a user of the library needs; the rest stays in its modules.
"""

from harness.campaigns.controls.classify import GateCheck
from harness.campaigns.controls.edits import Edit, EditError
from harness.campaigns.controls.results import CampaignResult, ControlResult
from harness.campaigns.controls.runner import CampaignConfig, run_campaign, validate
from harness.campaigns.controls.spec import Control, ControlSpecError, Expect, Problem, Route, load_controls
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
