"""Bad topologies and proxy settings that tests/e2e/test_validation.py does not
cover, per-role engine overrides and their escape hatch, and how the proxy API key is
carried (item 9). Fast: `pdtopo render` and pure functions only, no processes."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pdtopo.cli import main
from pdtopo.config.compose import compose_config
from pdtopo.launcher.plan.expand import API_KEY_ENV, expand_plan
from pdtopo.launcher.programs.nodelay_exec import inner_command
from pdtopo.launcher.programs.router_entry import (
    API_KEY_FILE_ENV,
    read_api_key,
    split_router_module,
)
from pdtopo.launcher.render.run_dir import resolved_config
from pdtopo.launcher.render.supervisord import render_supervisord
from pdtopo.runtime.settings import direct_process_context, load_process_context


def render_fails(tmp_path: Path, capsys, *overrides: str) -> str:
    run = tmp_path / "run"
    code = main(["render", "model=tiny_llama", f"hydra.run.dir={run}", *overrides])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert not run.exists(), "a run dir was written for an invalid topology"
    return err


CASES = {
    "duplicate_host": (["topology.hosts=[{name: a, address: 127.0.0.1}, "
                        "{name: a, address: 127.0.0.2}]", "topology.bootstrap.host=a",
                        "topology.proxy.host=a"],
                       ["topology.hosts.1.name", "'a'", "duplicate host name"]),
    "no_hosts": (["topology.hosts=[]"], ["topology.hosts", "at least one host"]),
    "unknown_proxy_kind": (["proxy.kind=nginx"], ["proxy.kind", "nginx", "unknown proxy kind"]),
    "zero_health_threshold": (["proxy.health_failure_threshold=0"],
                              ["proxy.health_failure_threshold", "at least 1"]),
    "misspelt_policy": (["proxy.policy=cache_awre"],
                        ["proxy.policy", "'cache_awre'", "not a policy of the rust proxy",
                         "cache_aware"]),
    "prefill_only_policy_for_decode": (["proxy.decode_policy=bucket"],
                                       ["proxy.decode_policy", "'bucket'", "power_of_two"]),
    "power_of_two_one_prefill": (["proxy.policy=power_of_two"],
                                 ["proxy.policy", "'power_of_two'", "fewer than 2 prefill",
                                  "topology.prefill.instances=1"]),
    "power_of_two_one_decode": (["proxy.decode_policy=power_of_two"],
                                ["proxy.decode_policy", "fewer than 2 decode"]),
    "mini_lb_cache_aware": (["proxy=mini_lb", "proxy.policy=cache_aware"],
                            ["proxy.policy", "'cache_aware'", "mini_lb routes at random only"]),
    "mini_lb_decode_round_robin": (["proxy=mini_lb", "proxy.decode_policy=round_robin"],
                                   ["proxy.decode_policy", "use proxy=rust"]),
    "mini_lb_with_api_key": (["proxy=mini_lb", "proxy.api_key=k"],
                             ["proxy.api_key", "mini_lb does not check API keys"]),
    "mini_lb_with_key_file": (["proxy=mini_lb", "proxy.api_key_file=/tmp/k"],
                              ["proxy.api_key_file", "/tmp/k", "mini_lb"]),
    "gateway_misspelt_policy": (["proxy=gateway", "proxy.policy=prefixhash"],
                                ["proxy.policy", "'prefixhash'", "not a policy of the gateway",
                                 "prefix_hash"]),
    "gateway_negative_grace": (["proxy=gateway", "proxy.shutdown_grace_s=-1"],
                               ["proxy.shutdown_grace_s", "-1", "must be 0"]),
    "gateway_grace_past_the_kill": (["proxy=gateway", "proxy.shutdown_grace_s=15"],
                                    ["proxy.shutdown_grace_s", "15", "kills a program 15 s"]),
    "load_monitor_on_the_rust_router": (["+proxy.load_monitor_interval_s=1"],
                                        ["proxy.load_monitor_interval_s", "only the gateway"]),
    "gateway_load_monitor_zero": (["proxy=gateway", "proxy.load_monitor_interval_s=0"],
                                  ["proxy.load_monitor_interval_s", "at least 1"]),
    "extra_arg_owned_by_pdtopo": (['proxy.extra_args=["--cache-threshold","0.5","--port=1"]'],
                                  ["proxy.extra_args.2", "'--port=1'",
                                   "pdtopo sets this flag itself"]),
    "mini_lb_extra_args": (["proxy=mini_lb", 'proxy.extra_args=["--x"]'],
                           ["proxy.extra_args", "mini_lb takes no extra flags"]),
    "key_twice": (["proxy.api_key=k", "proxy.api_key_file=/tmp/k"],
                  ["proxy.api_key_file", "give the key once"]),
    "chip_lists_vs_instances": (["topology.prefill.chips=[[0],[1]]"],
                                ["topology.prefill.chips", "2 chip lists for 1 instances"]),
    "zero_chips_per_instance": (["topology.decode.chips_per_instance=0"],
                                ["topology.decode.chips_per_instance", "0", "at least 1"]),
    "mesh_axis_zero": (["topology.prefill.mesh.tp=0"],
                       ["topology.prefill.mesh.tp", "0", ">= 1"]),
    "port_override_index": (["+topology.prefill.port_overrides={3: {http: 40000}}"],
                            ["topology.prefill.port_overrides", "3", "instance index"]),
    "port_override_kind": (["+topology.decode.port_overrides={0: {grpc: 40000}}"],
                           ["topology.decode.port_overrides.0.grpc", "40000",
                            "unknown port kind"]),
    "rust_without_prometheus_port": (["topology.proxy.prometheus_port=null"],
                                     ["topology.proxy.prometheus_port", "prometheus port"]),
    "bootstrap_and_proxy_same_port": (["topology.proxy.port=8998"],
                                      ["topology.proxy.port", "8998", "bootstrap (http)"]),
    "unknown_role_host": (["topology.decode.host=elsewhere"],
                          ["topology.decode.host", "elsewhere", "unknown host"]),
    "negative_port": (["topology.bootstrap.port=-1"],
                      ["topology.bootstrap.port", "-1", "out of range"]),
    "proxy_bad_type": (["proxy.request_timeout_s=soon"], ["proxy.request_timeout_s", "soon"]),
    "proxy_unknown_key": (["+proxy.max_connections=3"], ["proxy.max_connections", "unknown key"]),
    "role_dtype_bad_type": (["+topology.decode.engine.page_size=big"],
                            ["topology.decode.engine.page_size", "big"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_rejects(case, tmp_path, capsys):
    overrides, expected = CASES[case]
    err = render_fails(tmp_path, capsys, *overrides)
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"


def test_run_dir_that_holds_a_deployment_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}"]) == 0
    capsys.readouterr()
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}"]) == 2
    assert "already holds a deployment" in " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------------------- per-role engine

def test_per_role_overrides_that_agree_are_planned_and_applied(tmp_path):
    over = ["+topology.prefill.engine.page_size=32", "+topology.decode.engine.page_size=32",
            "topology.prefill.engine.num_pages=300"]  # pool sizes may differ per role
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}", *over]) == 0
    p = load_process_context(run, "prefill_0")
    d = load_process_context(run, "decode_0")
    assert p.cfg.engine.page_size == d.cfg.engine.page_size == 32
    assert (p.settings.engine.num_pages, d.settings.engine.num_pages) == (300, 512)
    assert p.cfg.engine.kv_dtype == "auto"  # untouched keys keep engine.*
    boot = load_process_context(run, "bootstrap")
    assert boot.cfg.engine.page_size == 16  # no engine override for the bootstrap role


def test_direct_context_applies_role_overrides():
    cfg = compose_config(["model=tiny_llama", "+topology.decode.engine.kv_dtype=bfloat16"])
    assert direct_process_context(cfg, role="decode").cfg.engine.kv_dtype == "bfloat16"
    assert direct_process_context(cfg, role="prefill").cfg.engine.kv_dtype == "auto"
    assert cfg.engine.kv_dtype == "auto"  # the caller's config is not modified


def test_incompatible_roles_escape_hatch_warns_loudly(tmp_path, capsys):
    over = ["+topology.decode.engine.page_size=8"]
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}", *over]) == 2
    capsys.readouterr()
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}", *over,
                 "launcher.allow_incompatible_roles=true"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "WARNING" in err and "topology.decode.engine.page_size=8" in err
    assert "prefill page_size=16 but decode page_size=8" in err
    assert load_process_context(run, "decode_0").cfg.engine.page_size == 8
    assert load_process_context(run, "prefill_0").cfg.engine.page_size == 16


# ---------------------------------------------------------------------------- API key

def test_api_key_travels_in_the_environment_only(tmp_path):
    cfg = compose_config(["model=tiny_llama", "proxy.api_key=s3cr3t-key"])
    plan = expand_plan(cfg, run_dir=str(tmp_path), python="/py")
    proxy = plan.by_name()["proxy"]
    assert inner_command(proxy.command)[2] == "pdtopo.launcher.programs.router_entry"
    assert "s3cr3t-key" not in json.dumps(plan.to_dict())
    assert "s3cr3t-key" not in resolved_config(cfg)
    text = render_supervisord(plan, run_dir=tmp_path, token="tok", workdir=tmp_path)
    proxy_env = [line for line in text.splitlines()
                 if line.startswith("environment=") and API_KEY_ENV in line]
    assert len(proxy_env) == 1 and f'{API_KEY_ENV}="s3cr3t-key"' in proxy_env[0]
    plain = expand_plan(compose_config(["model=tiny_llama"]), python="/py").by_name()["proxy"]
    assert inner_command(plain.command)[2] == "sglang_router.launch_router"
    assert not plain.secret_env


def test_api_key_from_the_launching_environment(monkeypatch):
    monkeypatch.setenv("PDTOPO_TEST_ROUTER_KEY", "from-env")
    cfg = compose_config(["model=tiny_llama", "proxy.api_key=${oc.env:PDTOPO_TEST_ROUTER_KEY}"])
    proxy = expand_plan(cfg, python="/py").by_name()["proxy"]
    assert proxy.secret_env == {API_KEY_ENV: "from-env"}
    assert "from-env" not in OmegaConf.to_yaml(OmegaConf.create(resolved_config(cfg)))


def test_api_key_file_is_a_path_in_the_plan(tmp_path):
    proxy = expand_plan(compose_config(["model=tiny_llama", f"proxy.api_key_file={tmp_path}/k"]),
                        python="/py").by_name()["proxy"]
    assert proxy.env[API_KEY_FILE_ENV] == f"{tmp_path}/k" and not proxy.secret_env


def test_read_api_key(tmp_path):
    assert read_api_key({API_KEY_ENV: "k1"}) == "k1"
    key = tmp_path / "key"
    key.write_text("k2\nignored\n")
    assert read_api_key({API_KEY_FILE_ENV: str(key)}) == "k2"
    with pytest.raises(SystemExit, match=API_KEY_ENV):
        read_api_key({})
    with pytest.raises(SystemExit, match="cannot read it"):
        read_api_key({API_KEY_FILE_ENV: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        read_api_key({API_KEY_FILE_ENV: str(tmp_path / "empty")})


@pytest.mark.parametrize("proxy_kind", ["rust", "gateway"])
def test_each_router_parses_the_planned_command(proxy_kind, monkeypatch):
    """The router package's own parser accepts every flag pdtopo plans (an unknown flag or a
    bad value is an argparse SystemExit), and the key set by the entry lands on its RouterArgs."""
    extra = {"rust": '["--cache-threshold","0.4"]',
             "gateway": '["--worker-wedge-secs","120","--cache-threshold","0.4"]'}[proxy_kind]
    cfg = compose_config(["model=tiny_llama", "topology=2p2d_cpu", f"proxy={proxy_kind}",
                          "proxy.retries=0", "proxy.circuit_breaker=false", "proxy.api_key=k9",
                          f"proxy.extra_args={extra}"])
    cmd = expand_plan(cfg, python="/py").by_name()["proxy"].command
    module, argv = split_router_module(inner_command(cmd)[3:])
    assert module == {"rust": "sglang_router.launch_router",
                      "gateway": "smg.launch_router"}[proxy_kind]
    args = importlib.import_module(module).parse_router_args(argv)
    assert args.pd_disaggregation and args.disable_retries and args.disable_circuit_breaker
    assert [url for url, _port in args.prefill_urls] == ["http://127.0.0.1:30000",
                                                          "http://127.0.0.1:30001"]
    assert args.decode_urls == ["http://127.0.0.1:30002", "http://127.0.0.1:30003"]
    assert args.prefill_policy == ("cache_aware" if proxy_kind == "gateway" else "round_robin")
    assert args.cache_threshold == pytest.approx(0.4)
    if proxy_kind == "gateway":  # polled each second (conf/proxy/gateway.yaml)
        assert args.load_monitor_interval == 1


def test_router_entry_module_choice():
    assert split_router_module(["--pd-disaggregation"]) == ("sglang_router.launch_router",
                                                            ["--pd-disaggregation"])
    assert split_router_module(["--router-module", "smg.launch_router", "--port", "1"]) == \
        ("smg.launch_router", ["--port", "1"])
    with pytest.raises(SystemExit, match="--router-module takes one of"):
        split_router_module(["--router-module", "os"])
    with pytest.raises(SystemExit, match="got nothing"):
        split_router_module(["--router-module"])
