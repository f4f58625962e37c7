"""Verdicts from gate records: which red counts as proof, and which does not."""

import pytest

from harness.core.records import GateRecord
from harness.campaigns.controls.classify import GateCheck, check_gate, decide
from harness.runs.verdict import Verdict
from harness.campaigns.controls.spec import Expect, Route

GATE = "gates/test_x.py::test_claim"
OTHER = "gates/test_x.py::test_other"


def red(route, line="x", nodeid=GATE, message=None, outcome="failed"):
    return GateRecord(nodeid, outcome, route, line, message)


def verdict_of(*pairs):
    return decide(tuple(check_gate(expect, record) for expect, record in pairs))


def test_red_by_assertion_with_the_expected_message_is_proven():
    check = check_gate(Expect(GATE, Route.ASSERTION, "pool["), red("assertion", "pool[3, 1]: 2 of 64 differ"))
    assert check.met and check.reason == "red by assertion as expected"
    assert decide((check,)) == (Verdict.KILLED, True)


def test_red_by_trap_where_an_assertion_was_expected_is_guard_only_and_not_as_expected():
    check = check_gate(Expect(GATE, Route.ASSERTION), red("trap", "CUDARuntimeError: cudaErrorIllegalAddress"))
    assert not check.met and check.reason == "red by trap, not by assertion"
    assert decide((check,)) == (Verdict.KILLED_BY_TRAP, False)


def test_a_control_that_expects_a_trap_and_gets_one_is_guard_only_and_as_expected():
    assert verdict_of((Expect(GATE, Route.TRAP), red("trap"))) == (Verdict.KILLED_BY_TRAP, True)


def test_a_control_that_expects_a_trap_but_gets_an_assertion_is_not_as_expected():
    assert verdict_of((Expect(GATE, Route.TRAP), red("assertion"))) == (Verdict.KILLED_BY_TRAP, False)


def test_red_by_refusal_where_refusal_was_expected_is_proven():
    assert verdict_of((Expect(GATE, Route.REFUSAL, "allocate"), red("refusal", "ValueError: allocate at least n"))) == (
        Verdict.KILLED, True)


def test_red_by_refusal_or_error_where_an_assertion_was_expected_is_guard_only():
    assert verdict_of((Expect(GATE, Route.ASSERTION), red("refusal"))) == (Verdict.KILLED_BY_TRAP, False)
    assert verdict_of((Expect(GATE, Route.ASSERTION), red("error", outcome="error"))) == (Verdict.KILLED_BY_TRAP, False)


def test_one_green_expected_gate_makes_the_control_survived_though_another_is_proven():
    pairs = ((Expect(GATE, Route.ASSERTION), red("assertion")),
             (Expect(OTHER, Route.ASSERTION), GateRecord(OTHER, "passed")))
    assert verdict_of(*pairs) == (Verdict.SURVIVED, False)


@pytest.mark.parametrize("record", [GateRecord(GATE, "skipped"), None], ids=["skipped", "missing-from-report"])
def test_a_gate_that_did_not_go_red_for_any_reason_counts_as_survived(record):
    check = check_gate(Expect(GATE, Route.ASSERTION), record)
    assert not check.met
    assert decide((check,)) == (Verdict.SURVIVED, False)


def test_red_by_assertion_with_another_message_is_not_the_proof_asked_for():
    check = check_gate(Expect(GATE, Route.ASSERTION, "pool["), red("assertion", "out[0]: 1 of 8 differ"))
    assert check.reason == "red by assertion, but the failure message lacks 'pool['"
    assert decide((check,)) == (Verdict.KILLED_BY_TRAP, False)


def test_the_message_is_searched_in_the_whole_failure_message_when_the_report_has_it():
    record = red("assertion", "out: 1 of 8 differ", message="out: 1 of 8 differ\nfirst at pool[3, 1]")
    assert check_gate(Expect(GATE, Route.ASSERTION, "pool["), record).met


def test_a_compile_failure_inside_the_run_makes_the_control_invalid():
    assert verdict_of((Expect(GATE, Route.ASSERTION), red("compile"))) == (Verdict.COMPILE_ERROR, False)


def test_a_gate_timeout_inside_the_run_makes_the_control_timeout():
    assert verdict_of((Expect(GATE, Route.ASSERTION), red("timeout"))) == (Verdict.TIMEOUT, False)


def test_controls_and_mutants_share_one_verdict_and_the_controls_report_says_it_in_its_words():
    from harness.campaigns.controls.report import word
    from harness.campaigns.mutate.verdicts import Verdict as MutantVerdict

    assert Verdict is MutantVerdict
    words = [word(v) for v in (Verdict.KILLED, Verdict.KILLED_BY_TRAP, Verdict.SURVIVED, Verdict.COMPILE_ERROR,
                               Verdict.TIMEOUT, Verdict.SKIPPED)]
    assert words == ["proven", "guard-only", "survived", "invalid", "timeout", "skipped"]
    assert Verdict("killed-by-trap") is Verdict.KILLED_BY_TRAP and str(Verdict.KILLED) == "killed"


def test_with_no_device_a_control_is_decided_by_the_expected_gates_that_ran():
    from harness.campaigns.controls.classify import NOT_JUDGED, judged_without_device

    ran = GateCheck("g::structural", Route.ASSERTION, None, "failed", "assertion", "x", True, "red by assertion")
    gpu = GateCheck("g::anchor", Route.ASSERTION, None, "skipped", None, None, False, "skipped")
    assert decide((ran, gpu)) == (Verdict.SURVIVED, False)  # on a device run, a skipped gate caught nothing
    assert decide((ran, gpu), device=False) == (Verdict.KILLED, True)
    assert decide((gpu,), device=False) == (Verdict.SKIPPED, False)  # nothing judged: never "as expected"
    green = GateCheck("g::structural", Route.ASSERTION, None, "passed", None, None, False, "passed")
    assert decide((green, gpu), device=False) == (Verdict.SURVIVED, False)  # what ran must still go red
    assert [c.reason for c in judged_without_device((ran, gpu))] == ["red by assertion", NOT_JUDGED]


@pytest.mark.parametrize("verdict", [*Verdict, None], ids=[*(v.value for v in Verdict), "static"])
def test_every_verdict_has_one_word_and_renders_in_the_table_the_markdown_and_the_json(verdict):
    import io
    import json
    from pathlib import Path

    from rich.console import Console

    from harness.campaigns.controls import report
    from harness.campaigns.controls.results import CampaignResult, ControlResult

    # a name and a reason with markup-like brackets must print as they are
    check = GateCheck(GATE, Route.ASSERTION, None, "passed", None, None, False, "why [/] not")
    result = ControlResult("ctl[/]", "d", "w", (), verdict, verdict is None, (check,), (), 1.0)
    campaign = CampaignResult(mode="campaign", kernel_root=Path("k"), arch="sm_90", baseline=None,
                              controls=(result,), seconds=1.0)
    text = io.StringIO()
    Console(file=text, width=200).print(report.table(campaign))
    word = report.verdict_text(result)
    assert f"│ ctl[/]  │ {word} " in text.getvalue() and "why [/] not" in text.getvalue()
    assert f"| ctl[/] | {word} |" in report.campaign_markdown(campaign)
    assert json.loads(json.dumps(report.campaign_json(campaign)))["controls"][0]["verdict"] == (
        None if verdict is None else word)
