"""The cubin cache stays under its bound: the least recently used entries go first, those
compiled in a sandbox before the real tree's; a hit counts as a use; `python -m harness
cache` says what it keeps and clears it."""

import os
import time

import pytest

from harness.compiling import cubin_cache
from harness.compiling.cubin_cache import entry_paths, prune, usage, write_entry

KB = 1 << 10


def put(cache, key: str, size: int, used: float, sandbox: bool = False) -> None:
    """An entry of about `size` bytes, last used at `used` (seconds since the epoch)."""
    cubin, meta = entry_paths(cache, key, sandbox)
    write_entry(cache, cubin, meta, b"\x7fELF" + b"x" * size, {}, {}, "")
    for path in (cubin, meta):
        os.utime(path, (used, used))


def keys(cache) -> set[str]:
    return {p.stem for p in cache.rglob("*.cubin")}


@pytest.fixture
def unbounded(monkeypatch):
    monkeypatch.setenv(cubin_cache.CACHE_MAX_ENV, "0")  # the fixture's writes prune nothing by themselves


def test_prune_removes_the_sandboxes_least_recently_used_first_then_the_trees(tmp_path, unbounded):
    now = time.time()
    for i in range(4):
        put(tmp_path, f"{i:02d}tree", 100 * KB, now - 100 + i)  # the real tree's: older than every sandbox entry
        put(tmp_path, f"{i:02d}mut", 100 * KB, now - 50 + i, sandbox=True)
    assert len(keys(tmp_path)) == 8
    done = prune(tmp_path, limit=500 * KB)  # holds ~800 KB: down to 90 % of 500 KB
    assert keys(tmp_path) == {"02tree", "03tree", "01tree", "00tree"}, "every sandbox entry went before any tree's"
    assert done.removed == 4 and done.kept <= 450 * KB
    prune(tmp_path, limit=250 * KB)
    assert keys(tmp_path) == {"03tree", "02tree"}, "then the tree's, least recently used first"


def test_under_the_bound_nothing_goes(tmp_path, unbounded):
    put(tmp_path, "aa", 10 * KB, time.time())
    assert prune(tmp_path, limit=1 << 20).removed == 0 and keys(tmp_path) == {"aa"}
    assert prune(tmp_path, limit=0).removed == 0  # 0: no bound


def test_a_hit_makes_an_entry_recently_used(tmp_path, unbounded):
    now = time.time()
    put(tmp_path, "00old", 100 * KB, now - 100)
    put(tmp_path, "01new", 100 * KB, now - 10)
    hit, _, _ = cubin_cache.lookup(tmp_path, "00old", sandbox=False)
    assert hit is not None
    prune(tmp_path, limit=150 * KB)
    assert keys(tmp_path) == {"00old"}


def test_a_sandbox_compile_finds_the_trees_entry_and_the_tree_a_sandboxes(tmp_path, unbounded):
    put(tmp_path, "aa", KB, time.time())
    put(tmp_path, "bb", KB, time.time(), sandbox=True)
    assert cubin_cache.lookup(tmp_path, "aa", sandbox=True)[0] is not None
    hit, cubin, _ = cubin_cache.lookup(tmp_path, "bb", sandbox=False)
    assert hit is not None and cubin.parent.parent.name == cubin_cache.SANDBOX_FOLDER
    assert cubin_cache.lookup(tmp_path, "cc", sandbox=False)[0] is None


def test_writing_past_an_eighth_of_the_bound_prunes(tmp_path, monkeypatch):
    monkeypatch.setenv(cubin_cache.CACHE_MAX_ENV, "40M")  # prunes after 5 MB written by this process
    monkeypatch.setattr(cubin_cache, "_written", {})
    now = time.time()
    for i in range(50):
        put(tmp_path, f"{i:03d}", 1 << 20, now - 1000 + i, sandbox=True)  # 50 MB of mutants' cubins
    assert usage(tmp_path).bounded <= (40 << 20) + (5 << 20) + (1 << 20), "never more than the bound and a slack"
    assert "049" in keys(tmp_path) and "000" not in keys(tmp_path)


def test_a_bound_that_is_not_a_size_is_refused_with_the_fix(monkeypatch):
    assert cubin_cache.parse_size("256M") == 256 << 20 and cubin_cache.parse_size("2g") == 2 << 30
    assert cubin_cache.parse_size("1.5GiB") == 3 << 29 and cubin_cache.parse_size("off") == 0
    monkeypatch.setenv(cubin_cache.CACHE_MAX_ENV, "lots")
    with pytest.raises(cubin_cache.CacheLimitError, match="HARNESS_CACHE_MAX='lots' is not a size: write e.g."):
        cubin_cache.limit_bytes()
    from harness.campaigns.mutate.cli import main

    assert main(["--static", "--rootdir", "/nonexistent-rootdir-for-this-test"]) == 2


def test_the_cache_command_says_what_it_keeps_and_clears_only_its_own(tmp_path, capsys, monkeypatch):
    from harness.__main__ import main

    put(tmp_path, "aa", 10 * KB, time.time())
    put(tmp_path, "bb", 20 * KB, time.time(), sandbox=True)
    (tmp_path / "host" / "gen").mkdir(parents=True)
    (tmp_path / "host" / "gen" / "x.pkl").write_bytes(b"0" * KB)
    (tmp_path / "nvrtc-options").mkdir()
    (tmp_path / "nvrtc-options" / "ab.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("someone else's")
    monkeypatch.delenv(cubin_cache.CACHE_MAX_ENV, raising=False)  # the default bound
    assert main(["cache", "info", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"cache: {tmp_path} (from --cache-dir)" in out and "bound on cubins and verdicts: 256.0 MB" in out
    assert "real tree's cubins:       1 entries" in out and "sandboxes' cubins:        1 entries" in out
    assert "python -m harness cache clear" in out
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert main(["--help"]) == 0 and "cache info|prune|clear" in capsys.readouterr().out
