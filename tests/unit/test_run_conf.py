"""What pdtopo reads back from a run dir's supervisord.conf: the working directory and the
proxy's API key (kept out of config.yaml and plan.json), exactly as supervisord will see them."""

from __future__ import annotations

from pdtopo.config.compose import compose_config
from pdtopo.config.run_conf import program_environment, proxy_api_key, workdir
from pdtopo.config.schema import typed_proxy
from pdtopo.launcher.operate.prepare import prepare
from pdtopo.launcher.render.run_dir import write_run_dir


def test_api_key_and_workdir_round_trip(tmp_path):
    key = 'k3y-with "quotes" and 100%'
    cfg = compose_config(["model=tiny_llama", "topology=1p1d_cpu", "proxy=rust",
                          f"proxy.api_key='{key}'"])
    run = tmp_path / "run"
    prepared = prepare(cfg, run, workdir=tmp_path / "work dir", python="py", cpus=[0])
    write_run_dir(run, cfg, prepared.plan, prepared.conf_text, prepared.token)
    assert key not in (run / "config.yaml").read_text()
    assert proxy_api_key(run, typed_proxy(cfg)) == key
    assert workdir(run) == tmp_path / "work dir"
    env = program_environment(run, "decode_0")
    assert env["PYTHONUNBUFFERED"] == "1" and "PDTOPO_PROXY_API_KEY" not in env
    plain = compose_config(["model=tiny_llama", "topology=1p1d_cpu"])
    assert proxy_api_key(run, typed_proxy(plain)) is None


def test_api_key_file(tmp_path):
    (tmp_path / "key").write_text("from-a-file\nignored\n")
    cfg = compose_config(["model=tiny_llama", "topology=1p1d_cpu",
                          f"proxy.api_key_file={tmp_path / 'key'}"])
    assert proxy_api_key(tmp_path, typed_proxy(cfg)) == "from-a-file"
