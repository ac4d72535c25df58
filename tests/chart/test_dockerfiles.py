"""Static checks of the images' recipes (they cannot be built here) and of the e2e script."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess

import pytest
from packaging.requirements import Requirement

from chartkit import ROOT

tomllib = pytest.importorskip("tomllib", reason="Python < 3.11")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPENDENCIES = {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in PYPROJECT["project"]["dependencies"]}


def instructions(path):
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pip_pins(instrs):
    pins = {}
    for word, rest in instrs:
        if word == "RUN" and "pip install" in rest:
            for token in shlex.split(rest.replace("&&", " ")):
                if "==" in token and not token.startswith("-"):
                    name, _, version = token.partition("==")
                    pins[name.lower().replace("_", "-")] = version
    return pins


@pytest.mark.parametrize("dockerfile,entrypoint,port", [
    ("Dockerfile.operator", "shoal-operator", 8080),
    ("Dockerfile.engine", "/usr/bin/tini", 8000),
])
def test_dockerfile_is_pinned_non_root_and_has_the_entrypoint(dockerfile, entrypoint, port):
    instrs = instructions(ROOT / dockerfile)
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in instrs if word == "ARG" and "=" in rest}
    bases = [rest.split()[0] for word, rest in instrs if word == "FROM"]
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image} is not pinned"
    users = [rest for word, rest in instrs if word == "USER"]
    assert users, "no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "the final user must be a numeric non-root uid (runAsNonRoot)"
    (ep,) = [rest for word, rest in instrs if word == "ENTRYPOINT"]
    assert entrypoint in ep and ep.startswith("[")  # exec form: signals reach the process
    assert f"EXPOSE {port}" in [f"{w} {r}" for w, r in instrs]
    # the distribution is installed without re-resolving the engine's heavy dependencies
    assert any(w == "RUN" and "pip install --no-deps /src" in r for w, r in instrs)


def copied(dockerfile: str) -> set[str]:
    """The repository paths a Dockerfile copies into its build stage."""
    return {src for word, rest in instructions(ROOT / dockerfile) if word == "COPY" and "--from" not in rest
            for src in rest.split()[:-1]}


def test_each_image_carries_one_half():
    """The operator image: operator/ and, of engine/, exactly the option declarations (no engine code, no kernels);
    the engine image: no operator. Each narrows pyproject's package list to what it copied."""
    spec = importlib.util.spec_from_file_location("image_packages", ROOT / "operator" / "image_packages.py")
    image_packages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image_packages)

    operator_files, engine_files = copied("Dockerfile.operator"), copied("Dockerfile.engine")
    assert "operator" in operator_files and "engine" not in operator_files
    assert {f for f in operator_files if f.startswith("engine")} == set(image_packages.OPERATOR_ENGINE_FILES)
    # the engine image runs the build script that narrows pyproject, then removes it with the rest of /src
    assert "engine" in engine_files and [f for f in engine_files if f.startswith("operator")] == ["operator/image_packages.py"]
    for dockerfile, half in (("Dockerfile.operator", "operator"), ("Dockerfile.engine", "engine")):
        assert any(w == "RUN" and f"image_packages.py {half} /src/pyproject.toml" in r
                   for w, r in instructions(ROOT / dockerfile)), dockerfile

    text = (ROOT / "pyproject.toml").read_text()
    narrowed = {half: tomllib.loads(image_packages.narrow(half, text)) for half in ("operator", "engine")}
    packages = {half: set(p["tool"]["setuptools"]["packages"]) for half, p in narrowed.items()}
    everything = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert packages["operator"] == {p for p in everything if p.startswith("shoal.operator")} | \
        set(image_packages.OPERATOR_ENGINE_PACKAGES)
    assert packages["engine"] == {p for p in everything if p.startswith("shoal.engine")}
    # each kept engine package of the operator image has its __init__.py among the copied files
    for package in image_packages.OPERATOR_ENGINE_PACKAGES:
        assert "/".join(["engine", *package.split(".")[2:], "__init__.py"]) in image_packages.OPERATOR_ENGINE_FILES
    for half, project in narrowed.items():
        assert all(v.startswith(f"shoal.{half}.") for v in project["project"]["scripts"].values())
        assert all(k.startswith(f"shoal.{half}") for k in project["tool"]["setuptools"]["package-data"])


@pytest.mark.parametrize("dockerfile,required", [
    ("Dockerfile.operator", {"kopf", "kubernetes", "pydantic", "pyyaml", "aiohttp", "huggingface-hub"}),
    ("Dockerfile.engine", {"torch", "transformers", "tokenizers", "safetensors", "aiohttp", "pydantic",
                           "prometheus-client", "pyyaml", "numpy"}),
])
def test_pinned_versions_satisfy_pyproject(dockerfile, required):
    instrs = instructions(ROOT / dockerfile)
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in instrs if word == "ARG" and "=" in rest}
    pins = {name: re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], v) for name, v in pip_pins(instrs).items()}
    assert required <= set(pins), f"unpinned: {sorted(required - set(pins))}"
    for name, version in pins.items():
        if name in DEPENDENCIES:
            assert DEPENDENCIES[name].specifier.contains(version), f"{name}=={version} vs {DEPENDENCIES[name]}"


def test_dockerignore_keeps_what_the_builds_copy():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*"
    kept = {p[1:] for p in patterns if p.startswith("!")}
    for dockerfile in ("Dockerfile.operator", "Dockerfile.engine"):
        for word, rest in instructions(ROOT / dockerfile):
            if word == "COPY" and "--from" not in rest:
                for src in rest.split()[:-1]:
                    parents = {"/".join(src.split("/")[:i]) for i in range(1, src.count("/") + 2)}
                    assert parents & kept, f"{dockerfile} copies {src}, which .dockerignore drops"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_e2e_script_parses():
    out = subprocess.run(["bash", "-n", str(ROOT / "e2e" / "run.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_engine_image_states_its_compatibility_floors():
    """CUDA 12 (driver >= 525.60.13 through minor-version compatibility), not 13 (R580 only); the floors are labels;
    the chart's kubeVersion matches the preStop sleep action (Kubernetes 1.30)."""
    instrs = instructions(ROOT / "Dockerfile.engine")
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in instrs if word == "ARG" and "=" in rest}
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", args["CUDA_IMAGE"])
    assert cuda and cuda.group(1) == "12"
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{cuda.group(1)}{cuda.group(2)}")  # wheel and base agree
    labels = " ".join(rest for word, rest in instrs if word == "LABEL")
    assert 'dev.shoal.min-nvidia-driver="525.60.13"' in labels and 'dev.shoal.min-kubernetes="1.30"' in labels
    assert any(word == "ENV" and 'NVIDIA_REQUIRE_CUDA="cuda>=12.0"' in rest for word, rest in instrs)
    import yaml

    chart = yaml.safe_load((ROOT / "charts" / "shoal" / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"


def test_engine_pods_keep_the_images_init_as_pid_1():
    """Dockerfile.engine's ENTRYPOINT is tini, which execs its arguments; every container the operator renders from
    that image gives its argv as args and no command (a command would replace tini and leave Python as PID 1).
    The pods' helper containers come from the operator image instead (no engine code there), as shoal-podtools."""
    import json

    from shoal.operator import render

    instrs = instructions(ROOT / "Dockerfile.engine")
    (ep,) = [json.loads(rest) for word, rest in instrs if word == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for word, rest in instrs if word == "CMD"]
    assert ep == ["/usr/bin/tini", "--"] and cmd[:2] == ["shoal-engine", "serve"]
    assert any(w == "RUN" and "apt-get install" in r and " tini " in r for w, r in instrs)
    settings = render.Settings(engine_image="registry.test/shoal-engine:1")
    for spec in ({"model": {"uri": "hf://org/m"}},  # Deployment, with the download init container
                 {"model": {"uri": "hf://org/m"}, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}}):
        isvc = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}
        workloads = [o for o in render.render(isvc, settings) if o["kind"] in ("Deployment", "StatefulSet")
                     and o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
        assert workloads
        for obj in workloads:
            pod = obj["spec"]["template"]["spec"]
            for c in pod["containers"] + pod["initContainers"]:
                if c["image"] == settings.fleet_image:
                    assert c["command"] == ["shoal-podtools"], c["name"]
                    continue
                assert "command" not in c, c["name"]
                assert c["args"][:1] in (["shoal-engine"], ["/bin/sh"]), c["args"][:3]
            assert any(c["image"] == settings.fleet_image for c in pod["initContainers"])
