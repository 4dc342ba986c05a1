"""The SDK as its own distribution (sdk/pyproject.toml): its wheel, installed alone into a fresh venv.

The wheel is built the way sdk/README.md says (`pip wheel --no-deps ./sdk`; pip fetches the build
backend, hatchling, into an isolated build environment) and installed with pip (dependencies from the
package index, under the repository's constraints.txt) into a venv made by `python -m venv` without
the system site-packages. Then:
  - the wheel holds exactly specd_client/ and the wire API's stubs (not protos/regen.py);
  - the venv holds only specd-client, grpcio, protobuf, grpcio-health-checking and what they
    declare (no torch, transformers, ray, matplotlib or numpy);
  - that venv's python (isolated, from a directory outside the repository) streams a completion,
    sync and async, from the scripted server of test_client_sdk over loopback, through one
    UNAVAILABLE that gRPC's retry policy retries, and prints what it got as JSON.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_client_sdk import CHUNK, Script, serve

ROOT = Path(__file__).resolve().parents[2]
SDK_DEPS = {"grpcio", "protobuf", "grpcio-health-checking"}
HEAVY = {"torch", "transformers", "ray", "matplotlib", "numpy"}

pytestmark = pytest.mark.timeout(300)  # a wheel build, a venv and a pip install from the package index


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _clean_env() -> dict[str, str]:
    """This environment without PYTHON* variables (no PYTHONPATH into the repository)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdk-wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(ROOT / "sdk"), "-w", str(out)],
         cwd=ROOT, env=_clean_env(), timeout=240)
    [whl] = out.glob("specd_client-*.whl")
    return whl


INSPECT = r"""
import importlib.metadata as m, json
print(json.dumps({d.metadata["Name"]: [r for r in (d.requires or []) if "extra ==" not in r]
                  for d in m.distributions()}))
"""


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> dict:
    """A fresh venv with the wheel installed: its python, and its distributions before and after."""
    root = tmp_path_factory.mktemp("sdk-venv")
    env_dir = root / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)], cwd=root, env=_clean_env(), timeout=120)
    py = env_dir / "bin" / "python"

    def installed() -> dict[str, list[str]]:
        out = _run([str(py), "-I", "-c", INSPECT], cwd=root, env=_clean_env(), timeout=60).stdout
        return {_norm(k): v for k, v in json.loads(out).items()}

    before = installed()  # what venv's bootstrap put there (pip, and setuptools on 3.11)
    _run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "-c", str(ROOT / "constraints.txt"), str(wheel)], cwd=root, env=_clean_env(), timeout=240)
    return {"python": py, "dir": root, "before": before, "after": installed()}


def test_wheel_holds_the_sdk_and_the_stubs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sdk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "specd_client").rglob("*")
           if p.is_file() and "__pycache__" not in p.parts}
    stubs = {f"protos/{f}" for f in ("__init__.py", "specd.proto", "specd_pb2.py", "specd_pb2.pyi", "specd_pb2_grpc.py")}
    dist_info = {n for n in names if n.startswith("specd_client-") and ".dist-info/" in n}
    assert "specd_client/client.py" in sdk and names == sdk | stubs | dist_info
    assert "protos/regen.py" not in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in dist_info if n.endswith("/METADATA"))).decode()
    requires = {_norm(re.split(r"[<>=!~;\[ ]", line.split(":", 1)[1].strip())[0])
                for line in meta.splitlines() if line.startswith("Requires-Dist:")}
    assert requires == SDK_DEPS, meta


def test_installs_only_grpc_protobuf_and_health_checking(venv):
    before, after = venv["before"], venv["after"]
    new = set(after) - set(before)
    # the dependency closure of specd-client among what is installed (declared requirements, extras aside)
    closure, todo = set(), ["specd-client"]
    while todo:
        name = todo.pop()
        if name in closure or name not in after:
            continue
        closure.add(name)
        todo += [_norm(re.split(r"[<>=!~;\[ (]", r.strip())[0]) for r in after[name]]
    assert SDK_DEPS | {"specd-client"} <= new, sorted(new)
    assert new == closure, f"installed beyond the SDK's dependencies: {sorted(new - closure)}"
    assert not HEAVY & set(after), sorted(HEAVY & set(after))


CLIENT = r"""
import asyncio, json, sys
import specd_client
from specd_client import AsyncSpecdClient, SpecdClient

address, prompt = sys.argv[1], sys.argv[2]
with SpecdClient(address, timeout=30, retries=2, backoff=0.05) as c:
    chunks = list(c.stream(prompt, max_tokens=64))
    health = c.health(specd_client.HEALTH_SERVICE)


async def via_async():
    async with AsyncSpecdClient(address, timeout=30) as ac:
        return [ch.text async for ch in ac.stream(prompt, max_tokens=64)]

print(json.dumps({"file": specd_client.__file__, "texts": [ch.text for ch in chunks],
                  "tokens": [t for ch in chunks for t in ch.token_ids], "finish": chunks[-1].finish_reason,
                  "completion_tokens": chunks[-1].usage.completion_tokens, "health": health,
                  "async_texts": asyncio.run(via_async()),
                  "heavy": sorted(m for m in ("torch", "transformers", "ray", "numpy") if m in sys.modules)}))
"""


def test_the_installed_sdk_streams_from_a_server(venv):
    prompt = "streamed through the wheel"
    script = Script()
    script.fail_unavailable = 1  # the first attempt fails before any chunk: gRPC's retry policy retries it
    with serve(script) as address:
        proc = subprocess.run([str(venv["python"]), "-I", "-c", CLIENT, address, prompt], cwd=venv["dir"],
                              env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the SDK came from the venv, not from this repository
    assert Path(out["file"]).resolve().is_relative_to(venv["dir"].resolve()), out["file"]
    assert not Path(out["file"]).resolve().is_relative_to(ROOT), out["file"]
    assert out["texts"] == [prompt[i:i + CHUNK] for i in range(0, len(prompt), CHUNK)]
    assert out["tokens"] == [ord(ch) for ch in prompt] and out["completion_tokens"] == len(prompt)
    assert out["finish"] == "stop" and out["health"] == "SERVING" and out["heavy"] == []
    assert "".join(out["async_texts"]) == prompt
    assert script.count("GenerateStream") == 3 and script.count("Check") == 1  # 1 failed + 1 retried, + async
