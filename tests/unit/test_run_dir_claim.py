"""The default run dir is claimed once per launcher: concurrent claims of one name get NAME,
NAME-2, ... (os.mkdir decides), and nothing is claimed where the user or Hydra names the dir."""

from __future__ import annotations

import threading

import pytest

from pdtopo.launcher.run_dir_claim import claim_default_run_dir, claim_run_dir


def test_concurrent_claims_of_one_name_get_distinct_dirs(tmp_path):
    base = tmp_path / "outputs" / "2030-01-02" / "03-04-05"
    start, got = threading.Barrier(8), []

    def claim() -> None:
        start.wait()
        got.append(claim_run_dir(base))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in got) == sorted(
        ["03-04-05", *(f"03-04-05-{n}" for n in range(2, 9))])
    assert all(p.is_dir() and not any(p.iterdir()) for p in got)


@pytest.mark.parametrize("flags,overrides", [
    ([], ["hydra.run.dir=/tmp/mine"]),
    ([], ["++hydra.run.dir=/tmp/mine"]),
    ([], ["hydra.mode=MULTIRUN"]),
    (["-m"], []),
    (["--cfg", "job"], []),
    (["--help"], []),
])
def test_nothing_is_claimed_where_the_dir_is_named_or_no_job_runs(tmp_path, monkeypatch, flags,
                                                                  overrides):
    monkeypatch.chdir(tmp_path)
    assert claim_default_run_dir(flags, [*overrides, "model=tiny_llama"]) is None
    assert not (tmp_path / "outputs").exists()


def test_the_default_name_is_claimed_under_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = claim_default_run_dir([], ["model=tiny_llama"])
    assert first is not None and first.is_dir() and first.parts[0] == "outputs"
    second = claim_default_run_dir([], ["model=tiny_llama"])
    assert second != first and second.is_dir()
