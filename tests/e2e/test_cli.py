"""`pdtopo render` / Hydra app integration: run dir contents, --cfg, multirun, usage errors."""

from __future__ import annotations

import datetime
import json
import stat
import subprocess
import sys

import hydra.core.utils
import yaml

from pdtopo.cli import main


def test_render_writes_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}", "topology=2p2d_cpu"]) == 0
    assert sorted(p.name for p in run.iterdir()) == [
        "config.yaml", "grafana-dashboard.json", "logs", "plan.json", "prometheus.yml",
        "supervisord.conf", "token"]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert "hydra" not in cfg and cfg["topology"]["name"] == "2p2d_cpu"
    assert cfg["engine"]["kv_dtype"] == "auto"  # resolved interpolation (auto: per platform at run time)
    plan = json.loads((run / "plan.json").read_text())
    names = [p["name"] for p in plan["processes"]]
    assert names == ["bootstrap", "prefill_0", "prefill_1", "decode_0", "decode_1", "proxy"]
    for proc in plan["processes"][:-1]:
        assert proc["command"][0] == sys.executable
        assert proc["command"][-4:] == ["--run-dir", str(run), "--process", proc["name"]]
    token = (run / "token").read_text().strip()
    assert len(token) == 32 and token not in (run / "plan.json").read_text()
    assert f'PDTOPO_DEPLOYMENT_TOKEN="{token}"' in (run / "supervisord.conf").read_text()
    for private in ("token", "supervisord.conf"):
        assert stat.S_IMODE((run / private).stat().st_mode) == 0o600
    # the runtime can load its context from the run dir
    from pdtopo.runtime.settings import load_process_context

    ctx = load_process_context(run, "decode_1")
    assert ctx.ports["http"] == plan["processes"][4]["ports"]["http"]
    # a second render into the same dir is refused
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}"]) == 2
    assert "already holds a deployment" in capsys.readouterr().err


def test_tokens_differ_between_runs(tmp_path):
    for name in ("a", "b"):
        assert main(["render", "model=tiny_llama", f"hydra.run.dir={tmp_path / name}"]) == 0
    assert (tmp_path / "a" / "token").read_text() != (tmp_path / "b" / "token").read_text()


def test_renders_in_one_second_get_their_own_default_run_dirs(tmp_path, capsys, monkeypatch):
    class Frozen(datetime.datetime):  # Hydra's `now` resolver reads this clock
        @classmethod
        def now(cls, tz=None):
            return cls(2030, 1, 2, 3, 4, 5)

    monkeypatch.setattr(hydra.core.utils, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    assert main(["render", "model=tiny_llama"]) == 0
    assert main(["render", "model=tiny_llama"]) == 0  # the same second: a name of its own
    day = tmp_path / "outputs" / "2030-01-02"
    runs = sorted(day.iterdir())
    assert [p.name for p in runs] == ["03-04-05", "03-04-05-2"]
    assert all((run / "plan.json").is_file() for run in runs)
    assert (runs[0] / "token").read_text() != (runs[1] / "token").read_text()
    assert str(runs[1]) in capsys.readouterr().out.replace("\n", "")  # rich wraps it
    # a directory the user names is not renamed: one that holds a deployment is refused
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={runs[0]}"]) == 2
    assert "already holds a deployment" in capsys.readouterr().err
    assert sorted(p.name for p in day.iterdir()) == ["03-04-05", "03-04-05-2"]


def test_multirun_renders_one_dir_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    assert main(["render", "model=tiny_llama", "-m", f"hydra.sweep.dir={sweep}",
                 "topology=1p1d_cpu,colocated_cpu"]) == 0
    plans = [json.loads((sweep / str(i) / "plan.json").read_text()) for i in (0, 1)]
    assert [p["topology"] for p in plans] == ["1p1d_cpu", "colocated_cpu"]


def test_cfg_job_and_help_via_console_script(tmp_path):
    out = subprocess.run(["pdtopo", "launch", "--cfg", "job", "topology=1p1d_v4"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["topology"]["accelerator"] == "v4-8"
    assert not (tmp_path / "outputs").exists()
    helped = subprocess.run(["pdtopo", "launch", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0
    assert "topology: " in helped.stdout and "1p1d_v6e8" in helped.stdout
    assert "proxy: gateway, mini_lb, rust" in helped.stdout


def test_usage_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["status"]) == 2  # no run dir under ./outputs
    assert "no pdtopo run directory" in capsys.readouterr().err
    assert main(["stop", str(tmp_path)]) == 2
