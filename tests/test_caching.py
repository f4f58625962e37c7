"""harness.host_cache on disk: a value computed once is read back by the next process under
the same key (function, plain arguments, the project's source, library versions); an edit
to any of the project's .py files, other arguments, or the cache turned off compute again;
a torn file is recomputed, never trusted."""

import importlib.util
import sys
from dataclasses import replace

import pytest

from harness.core import settings as _settings
from harness.library import caching

MODULE = '''
import os
from harness import host_cache

CALLS = []


@host_cache(disk=True)
def table(n, label="t"):
    CALLS.append((n, label))
    return {"label": label, "values": list(range(n)), "pid": os.getpid()}


@host_cache(disk=True)
def of_set(s):
    CALLS.append(("set",))
    return sum(s)


@host_cache
def in_memory(n):
    CALLS.append(("memory", n))
    return n


def double(x):
    return 2 * x


def triple(x):
    return 3 * x


@host_cache(disk=True)
def applied(f, n):
    CALLS.append(("applied", n))
    return f(n)


@host_cache(disk="source")
def analysis(text):
    CALLS.append(("analysis", text))
    return len(text)
'''


def _load(project):
    spec = importlib.util.spec_from_file_location("hc_project_mod", project / "mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "mod.py").write_text(MODULE)
    monkeypatch.setenv(caching.HOST_CACHE_ENV, str(tmp_path / "host"))
    caching._project_fingerprint.cache_clear()
    yield root
    caching._project_fingerprint.cache_clear()
    sys.modules.pop("hc_project_mod", None)


def _new_process(project):
    """What a new process sees: the module imported afresh, nothing in memory."""
    caching._project_fingerprint.cache_clear()
    return _load(project)


def test_a_value_computed_once_is_read_back_by_the_next_process(project, tmp_path):
    first = _load(project)
    value = first.table(5, label="a")
    assert first.CALLS == [(5, "a")] and value["values"] == [0, 1, 2, 3, 4]
    assert len(list((tmp_path / "host").rglob("*.pkl"))) == 1
    again = _new_process(project)
    assert again.table(5, label="a") == value and again.CALLS == [], "read from disk, not computed"
    assert again.table(6, label="a")["values"] == list(range(6)) and again.CALLS == [(6, "a")]
    assert again.table.harness_host_cache is True  # still kept across mutants by a warm worker


def test_an_edit_to_any_project_source_file_is_a_miss(project):
    _load(project).table(3)
    (project / "helper.py").write_text("X = 1\n")  # any .py of the project, not only the module
    fresh = _new_process(project)
    fresh.table(3)
    assert fresh.CALLS == [(3, "t")], "a changed project must compute again"


def test_arguments_that_are_not_plain_values_are_not_kept_on_disk(project, tmp_path):
    mod = _load(project)
    assert mod.of_set(frozenset({1, 2, 3})) == 6  # hashable for the in-memory cache, but its repr is no key
    assert not list((tmp_path / "host").rglob("*.pkl"))


def test_a_plain_host_cache_stays_in_memory(project, tmp_path):
    mod = _load(project)
    assert mod.in_memory(3) == 3 and mod.in_memory(3) == 3 and mod.CALLS == [("memory", 3)]
    assert not (tmp_path / "host").exists() and mod.in_memory.harness_host_cache is True


def test_only_the_last_three_source_states_stay_on_disk(project, tmp_path):
    import os
    import time

    for i in range(5):
        (project / "helper.py").write_text(f"X = {i}\n")  # a new source state each time
        _new_process(project).table(2)
        gens = sorted((tmp_path / "host").iterdir(), key=lambda d: d.stat().st_mtime)
        os.utime(gens[-1], (time.time() + i, time.time() + i))  # mtimes apart on a coarse clock
    assert len(list((tmp_path / "host").iterdir())) == caching.KEEP_GENERATIONS


def test_the_disk_cache_can_be_turned_off(project, tmp_path, monkeypatch):
    monkeypatch.setenv(caching.HOST_CACHE_ENV, "off")
    _load(project).table(2)
    assert not (tmp_path / "host").exists()
    assert caching.folder() is None


def test_a_torn_file_is_computed_again_and_replaced(project, tmp_path):
    _load(project).table(4)
    (path,) = (tmp_path / "host").rglob("*.pkl")
    path.write_bytes(path.read_bytes()[:10])
    fresh = _new_process(project)
    assert fresh.table(4)["values"] == [0, 1, 2, 3] and fresh.CALLS == [(4, "t")]
    again = _new_process(project)
    again.table(4)
    assert again.CALLS == [], "the recomputed value replaced the torn file"


def test_a_module_level_function_argument_is_keyed_by_its_name(project, tmp_path):
    mod = _load(project)
    assert mod.applied(mod.double, 4) == 8 and mod.applied(mod.triple, 4) == 12
    assert len(list((tmp_path / "host").rglob("*.pkl"))) == 2, "one entry a function"
    again = _new_process(project)
    assert again.applied(again.double, 4) == 8 and again.applied(again.triple, 4) == 12
    assert again.CALLS == [], "both read back under their own names"
    assert again.applied(lambda x: x, 4) == 4  # a lambda has no name to key it by
    assert len(list((tmp_path / "host").rglob("*.pkl"))) == 2


def test_a_source_keyed_value_is_on_disk_unless_the_process_serves_generated_sources(project, tmp_path,
                                                                                      settings_in_effect):
    mod = _load(project)
    assert mod.analysis("the project's text") == 18
    assert len(list((tmp_path / "host").rglob("*.pkl"))) == 1
    assert _new_process(project).analysis("the project's text") == 18
    # a campaign's worker: every mutant a new text
    settings_in_effect(replace(_settings.in_effect(), generated_sources=True))
    worker = _new_process(project)
    assert worker.analysis("the project's text") == 18 and worker.CALLS == [], "still read back"
    assert worker.analysis("a mutant's text") == 15 and worker.analysis("a mutant's text") == 15
    assert worker.CALLS == [("analysis", "a mutant's text")], "kept in memory"
    assert len(list((tmp_path / "host").rglob("*.pkl"))) == 1, "a mutant's text is not kept on disk"


def test_a_disk_mode_that_is_not_one_of_the_three_is_refused():
    with pytest.raises(ValueError, match="disk is True, False or \"source\""):
        caching.host_cache(disk="yes")
