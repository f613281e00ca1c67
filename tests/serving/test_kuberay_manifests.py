"""The KubeRay manifests in configs/kuberay cannot rot silently: each is a RayService whose serveConfigV2
imports `jaxserve serve-ray`'s app builder, whose args serve-ray's own parser and app_builder accept
(the model swapped for the same architecture's config-only directory, weights dummy: no model is
downloaded here), and whose worker pods hold what the replicas ask Ray for. No Kubernetes here: this
checks the files against jaxserve, not against a cluster."""

from __future__ import annotations

import glob
import importlib
import math
import os

import pytest
import yaml

from jaxserve.serving.ray.cli import app_builder, argv_from_args, build_parser, spec_from_namespace
from jaxserve.serving.ray.deployments import engine_deployment_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "configs", "kuberay", "*.yaml")))
# The model each manifest serves -> the directory of its config.json (no weights) in configs/models.
CONFIG_ONLY = {
    "Meta-Llama-3-8B-Instruct": "configs/models/llama3-8b",
    "Meta-Llama-3-70B-Instruct": "configs/models/llama3-70b",
}
# The node pools' accelerators (GKE node labels) -> the planner's device names.
POOL_DEVICE = {"nvidia-l4": "l4", "tpu-v5-lite-podslice": "tpu-v5e"}
# Kubernetes resource names of the accelerators a pod holds -> Ray's resource names.
K8S_TO_RAY = {"nvidia.com/gpu": "GPU", "google.com/tpu": "TPU", "cpu": "CPU"}


DISTRIBUTED = ("num_processes", "process_id", "coordinator_address", "distributed_timeout")  # serve-ray's to fill


def applications(manifest: dict) -> list[dict]:
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])  # a YAML document inside a string
    return serve_config["applications"]


def pod_resources(group: dict) -> dict[str, float]:
    """What one worker pod of the group offers Ray, in Ray's names (cpu "8" -> CPU 8)."""
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    return {K8S_TO_RAY[name]: float(value) for name, value in limits.items() if name in K8S_TO_RAY}


def test_there_are_manifests_for_gpus_and_tpus():
    names = {os.path.basename(p) for p in MANIFESTS}
    assert {"rayservice.yaml", "rayservice-tpu.yaml"} <= names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_a_manifest_runs_serve_rays_application(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with open(path) as f:
        manifest = yaml.safe_load(f)
    (app,) = applications(manifest)
    module, _, attr = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), attr) is app_builder

    args = dict(app["args"])
    served = os.path.basename(args["model"])
    assert served in CONFIG_ONLY, f"add {served}'s config-only directory to CONFIG_ONLY"
    args.update(model=CONFIG_ONLY[served], load_format="dummy")
    parser = build_parser()
    ns = parser.parse_args(argv_from_args(args, set(parser._option_string_actions)))  # SystemExit on a bad arg
    spec = spec_from_namespace(ns)
    assert type(app_builder(args)).__name__ == "Application"

    # Every replica (each of its processes) fits one worker pod, and a replica's processes fit the pods
    # of one worker-group replica (numOfHosts pods, one per host).
    options = engine_deployment_options(spec)
    bundles = options.get("placement_group_bundles", [{"CPU": 1, **spec.replica_resources}])
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    offered = pod_resources(group)
    for bundle in bundles:
        assert all(amount <= offered.get(name, 0) for name, amount in bundle.items()), (bundle, offered)
    assert len(bundles) == group.get("numOfHosts", 1), "one process per host of the worker group"
    if len(bundles) > 1:  # a replica spanning hosts: its mesh takes every device of its processes
        assert options["placement_group_strategy"] == "STRICT_SPREAD"
        devices = spec.settings.mesh_shape[0] * spec.settings.mesh_shape[1]
        assert devices == sum(b.get("TPU", b.get("GPU", 0)) for b in bundles), "the mesh uses every device"
        topology = group["template"]["spec"]["nodeSelector"].get("cloud.google.com/gke-tpu-topology")
        if topology is not None:  # a TPU slice of that many chips
            assert math.prod(int(n) for n in topology.split("x")) == devices, (topology, devices)
    # The model fits the node pool's accelerators (the planner, on the manifest's engine settings).
    from jaxserve.config import EngineConfig
    from jaxserve.plan import main as plan

    selector = group["template"]["spec"]["nodeSelector"]
    pool = selector.get("cloud.google.com/gke-accelerator") or selector["cloud.google.com/gke-tpu-accelerator"]
    engine = {k: v for k, v in args.items() if k in EngineConfig.field_names() and k not in DISTRIBUTED}
    devices = spec.settings.mesh_shape[0] * spec.settings.mesh_shape[1]
    assert plan([*argv_from_args(engine), "--device", POOL_DEVICE[pool], "--devices", str(devices)]) == 0
    # The Serve HTTP proxy listens where the head pod's serve port is.
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    head_ports = {
        p["name"]: p["containerPort"]
        for p in manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert serve_config["http_options"]["port"] == head_ports["serve"]
