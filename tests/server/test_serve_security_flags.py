"""``fw serve`` flags that decide who may use the server: keys (flag, FW_API_KEY, file), the exposure
warning, origins and hosts, MCP execution; and the unix socket's mode."""

from __future__ import annotations

import os
import socket
import stat

import pytest
from typer import Typer
from typer.testing import CliRunner

from framework.errors import ConfigError
from framework.server.launcher import BindAddress, exposure_warning, unix_socket


@pytest.fixture
def serve(monkeypatch):
    """``serve(args, env)``: run ``fw serve`` with ``run_server`` replaced; returns (result, config, bind)."""
    from cli import serve_cmd
    from framework.server import launcher

    calls = []
    monkeypatch.setattr(launcher, "run_server", lambda *args, **kwargs: calls.append(args) or 0)
    monkeypatch.delenv("FW_API_KEY", raising=False)
    app = Typer()
    app.command("serve")(serve_cmd.serve)
    app.command("other")(lambda: None)

    def run(args: list[str], env: dict[str, str] | None = None):
        calls.clear()
        result = CliRunner().invoke(app, ["serve", *args], env=env)
        _, config, bind = calls[0] if calls else (None, None, None)
        return result, config, bind

    return run


def test_default_bind_is_loopback_with_no_warning(serve):
    result, config, bind = serve([])
    assert result.exit_code == 0, result.output
    assert (bind.host, bind.port) == ("127.0.0.1", 2000) and "warning" not in result.output


def test_network_bind_without_a_key_warns_at_start_up(serve):
    result, _, bind = serve(["--h", "0.0.0.0"])
    assert result.exit_code == 0 and bind.host == "0.0.0.0"
    assert "warning: listening on http://0.0.0.0:2000 without an API key" in result.output
    assert "FW_API_KEY" in result.output
    keyed, _, _ = serve(["--h", "0.0.0.0", "--api-key", "k"])
    assert keyed.exit_code == 0 and "warning" not in keyed.output


def test_exposure_warning_only_for_non_loopback_tcp_without_keys():
    assert exposure_warning(BindAddress("192.168.1.5", 2000, None), []) is not None
    assert exposure_warning(BindAddress("::", 2000, None), []) is not None
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(BindAddress(host, 2000, None), []) is None, host
    assert exposure_warning(BindAddress(None, None, "/tmp/fw.sock"), []) is None
    assert exposure_warning(BindAddress("0.0.0.0", 2000, None), ["k"]) is None


def test_keys_come_from_flags_the_environment_and_a_file(serve, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfrom-file\n\n")
    result, config, _ = serve(["--api-key", "flag", "--api-key-file", str(key_file)], env={"FW_API_KEY": " env "})
    assert result.exit_code == 0, result.output
    assert config.api_keys == ["flag", "env", "from-file"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", ""], None, "--api-key is empty"),
        (["--api-key", "  "], None, "--api-key is empty"),
        ([], {"FW_API_KEY": ""}, "FW_API_KEY is set but empty"),
    ],
)
def test_an_empty_key_is_refused_at_start_up(serve, args, env, message):
    result, config, _ = serve(args, env)
    assert result.exit_code != 0 and config is None
    assert message in result.output


def test_an_empty_key_file_is_refused(serve, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("\n# only a comment\n")
    result, config, _ = serve(["--api-key-file", str(key_file)])
    assert result.exit_code != 0 and config is None and "holds no keys" in result.output


def test_origin_and_host_flags_reach_the_server_config(serve):
    result, config, _ = serve(
        [
            "--allowed-origins",
            "http://localhost:5173,https://App.example.com",
            "--allowed-origins",
            "http://127.0.0.1:8080",
            "--allowed-hosts",
            "gpu.lan",
        ]
    )
    assert result.exit_code == 0, result.output
    assert config.allowed_origins == ["http://localhost:5173", "https://app.example.com", "http://127.0.0.1:8080"]
    assert config.allowed_hosts == ["gpu.lan"]
    bad, config, _ = serve(["--allowed-origins", "localhost:5173"])
    assert bad.exit_code != 0 and config is None and "--allowed-origins 'localhost:5173'" in bad.output


def test_mcp_execution_flags_reach_the_server_config(serve):
    result, config, _ = serve([])
    assert config.mcp_execute is False
    result, config, _ = serve(
        ["--mcp-execute", "--mcp-max-calls-per-round", "2", "--mcp-max-result-bytes", "100", "--mcp-max-time", "5"]
    )
    assert result.exit_code == 0, result.output
    assert (config.mcp_execute, config.mcp_max_calls_per_round, config.mcp_max_result_bytes, config.mcp_max_time_s) == (
        True,
        2,
        100,
        5.0,
    )
    bad, config, _ = serve(["--mcp-max-time", "0"])
    assert bad.exit_code != 0 and "--mcp-max-time must be > 0" in bad.output


def test_unix_socket_is_0600_and_replaces_only_a_stale_socket(tmp_path):
    path = str(tmp_path / "fw.sock")
    for _ in range(2):  # the second time over the first one's stale file
        sock = unix_socket(path)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            with socket.socket(socket.AF_UNIX) as peer:
                peer.connect(path)
        finally:
            sock.close()
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(ConfigError, match="not a socket"):
        unix_socket(str(regular))
    assert regular.read_text() == "keep me"
