"""The operator container as the chart runs it: `shoal-operator` with the Deployment's rendered arguments starts
against a real HTTP Kubernetes API (kmock's emulator on localhost) and answers the kubelet's liveness probe."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from chartkit import one, render
from prockit import free_port

kmock = importlib.import_module("kmock")
importlib.import_module("shoal.operator.handlers")

# Far above any realistic start (a loaded CI machine took more than 20 s): the test waits for the probe's answer or
# the operator's exit, whichever comes first, and says which it waited for when neither came.
START_BOUND = 300.0


def test_operator_starts_with_the_chart_arguments_and_passes_its_liveness_probe(tmp_path):
    port = free_port()
    dep = one(render({"operator": {"healthPort": port, "logFormat": "plain"}}), "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    probe = container["livenessProbe"]["httpGet"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe_url = f"http://127.0.0.1:{named[probe['port']]}{probe['path']}"

    async def scenario() -> tuple[int, str]:
        async with kmock.KubernetesEmulator() as k, kmock.Server(k):
            k.resources.load_bundled()
            k.resources["serving.shoal.dev/v1alpha1/inferenceservices"] = kmock.ResourceInfo(
                kind="InferenceService", singular="inferenceservice", namespaced=True,
                verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status", "scale"})
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": str(k.url)}}],
                "users": [{"name": "u", "user": {"token": "test"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "u"}}]}))
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
                   "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": "shoal-system"}
            log = (tmp_path / "operator.log").open("w")
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "shoal.operator", *container["args"],
                                                        env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + START_BOUND
                while proc.returncode is None and time.monotonic() < deadline:
                    try:
                        status = await asyncio.to_thread(
                            lambda: urllib.request.urlopen(probe_url, timeout=2).status)
                        return status, ""
                    except OSError:
                        await asyncio.sleep(0.2)
                what = (f"the operator exited ({proc.returncode}) before answering {probe_url}"
                        if proc.returncode is not None else
                        f"waited {START_BOUND:.0f} s for the operator to answer its liveness probe {probe_url}")
                return 0, what + "\n" + (tmp_path / "operator.log").read_text()
            finally:
                if proc.returncode is None:
                    proc.terminate()
                    try:
                        await asyncio.wait_for(proc.wait(), 15)
                    except asyncio.TimeoutError:
                        proc.kill()
                        await proc.wait()
                log.close()

    status, log = asyncio.run(scenario())
    assert status == 200, log
