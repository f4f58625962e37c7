"""Applying a control's edits: exactly once, or an error that says how to make it so."""

import pytest

from harness.campaigns.controls.edits import Edit, EditError, apply, locate

TEXT = "int a = x * 2;\nint b = x * 2;\nint c = y;\n"


def test_exact_text_is_replaced_at_its_one_match():
    out = apply((Edit("k.cu", "y;", "y + 1;"),), {"k.cu": TEXT})
    assert out["k.cu"] == "int a = x * 2;\nint b = x * 2;\nint c = y + 1;\n"


def test_input_texts_are_not_modified():
    texts = {"k.cu": TEXT}
    apply((Edit("k.cu", "y;", "z;"),), texts)
    assert texts == {"k.cu": TEXT}


def test_text_matching_twice_without_occurrence_names_the_lines_and_the_fix():
    with pytest.raises(EditError) as info:
        locate(Edit("k.cu", "x * 2", "x * 3"), TEXT)
    assert info.value.key == "find"
    assert str(info.value) == (
        "the text 'x * 2' occurs 2 times in k.cu (lines 1, 2); add occurrence = N (1..2) to pick one, "
        "or lengthen find until it is unique"
    )


def test_occurrence_picks_the_nth_match():
    out = apply((Edit("k.cu", "x * 2", "x * 3", occurrence=2),), {"k.cu": TEXT})
    assert out["k.cu"] == "int a = x * 2;\nint b = x * 3;\nint c = y;\n"


def test_occurrence_past_the_matches_names_the_range():
    with pytest.raises(EditError) as info:
        locate(Edit("k.cu", "x * 2", "x * 3", occurrence=3), TEXT)
    assert info.value.key == "occurrence"
    assert str(info.value) == "occurrence = 3 but the text 'x * 2' occurs 2 times in k.cu; use a value in 1..2"


def test_text_that_does_not_occur_says_to_copy_it_exactly():
    with pytest.raises(EditError) as info:
        locate(Edit("k.cu", "int  c", "int d"), TEXT)
    assert info.value.key == "find"
    assert str(info.value) == (
        "the text 'int  c' does not occur in k.cu; copy the exact text from the file (whitespace counts), "
        "or update the control if the kernel changed"
    )


def test_regex_replacement_expands_groups():
    out = apply((Edit("k.cu", r"int (c) = (\w+);", r"int \1 = \2 * 4;", regex=True),), {"k.cu": TEXT})
    assert out["k.cu"].endswith("int c = y * 4;\n")


def test_regex_matching_the_empty_string_is_refused():
    with pytest.raises(EditError, match="matches the empty string"):
        locate(Edit("k.cu", r"z*", "q", regex=True), TEXT)


def test_invalid_regex_is_an_error_on_find_saying_how_to_fix_it():
    with pytest.raises(EditError) as info:
        locate(Edit("k.cu", r"(x", "q", regex=True), TEXT)
    assert info.value.key == "find"
    assert "is not a valid regex" in str(info.value) and "drop regex = true" in str(info.value)


def test_edit_that_changes_nothing_is_refused():
    with pytest.raises(EditError) as info:
        apply((Edit("k.cu", r"int c = (y);", r"int c = \1;", regex=True),), {"k.cu": TEXT})
    assert info.value.key == "replace"
    assert "changes nothing; a control must perturb the source" in str(info.value)


def test_second_edit_sees_the_first_edits_result():
    edits = (Edit("k.cu", "int c = y;", "int c = w;"), Edit("k.cu", "int c = w;", "int c = v;"))
    assert apply(edits, {"k.cu": TEXT})["k.cu"].endswith("int c = v;\n")


def test_edit_error_carries_the_index_of_the_failing_edit():
    edits = (Edit("k.cu", "int c", "int d"), Edit("k.cu", "missing", "x"))
    with pytest.raises(EditError) as info:
        apply(edits, {"k.cu": TEXT})
    assert info.value.index == 1
