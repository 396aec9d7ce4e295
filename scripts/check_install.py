"""Install fw as a user would and check that it serves: ``install.sh`` into a fresh folder from the
wheels ``make dist`` built, then ``fw serve`` from that install (in an empty directory, no
repository on the path) on the embedded default model, and one chat completion through the
``openai`` client. Exits non-zero, saying which step failed. ``make check-install`` runs it (CI too).

    python scripts/check_install.py --wheels dist [--torch torch==2.13.0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(home: Path) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no virtualenv of ours, the install's bin first."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{home / 'bin'}:{env.get('PATH', '')}"
    return env


def install(home: Path, wheels: Path, torch: str) -> None:
    command = [
        "sh",
        str(REPO / "install.sh"),
        "--cpu",
        "--wheels",
        str(wheels.resolve()),
        "--prefix",
        str(home / "fw"),
        "--bin",
        str(home / "bin"),
        "--torch",
        torch,
        "--torch-index",
        "",
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=clean_env(home), cwd=home)


def check_imports_from_install(home: Path) -> None:
    python = home / "fw" / "venv" / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import framework, fw_gguf; print(framework.__file__, fw_gguf.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        env=clean_env(home),
        cwd=home,
    ).stdout.split()
    outside = [path for path in found if not path.startswith(str(home))]
    if outside:
        sys.exit(f"check_install: the install imports from outside it: {outside}")
    print("imports from the install:", *found, sep="\n  ", flush=True)


def serve_and_ask(home: Path) -> str:
    port = free_port()
    log = open(home / "serve.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [str(home / "bin" / "fw"), "serve", "--p", str(port), "--device", "cpu"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=clean_env(home),
        cwd=home,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                sys.exit(
                    f"check_install: fw serve exited with {server.returncode}:\n{(home / 'serve.log').read_text()}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"check_install: fw serve not healthy after 300 s:\n{(home / 'serve.log').read_text()}")
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        text = reply.choices[0].message.content or ""
        if not text.strip() or reply.usage.completion_tokens < 1:
            sys.exit(f"check_install: empty answer from {model}: {reply}")
        return f"{model}: {text!r}"
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="the folder make dist filled")
    parser.add_argument("--torch", default="torch>=2.9", help="the torch requirement install.sh installs")
    parser.add_argument("--keep", type=Path, help="install here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fw-install-") as scratch:
        home = (args.keep or Path(scratch)).resolve()
        home.mkdir(parents=True, exist_ok=True)
        install(home, args.wheels, args.torch)
        check_imports_from_install(home)
        print("check_install: ok:", serve_and_ask(home), flush=True)


if __name__ == "__main__":
    main()
