"""docs/launching.md's recipes for Kubernetes and SkyPilot, checked by each engine's own API, as its
server would check them: a field misspelled or gone from the engine's current release fails here,
not on a cluster. The recipes are read from the page, so that what users copy is what is checked.
"""
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from kubeflow_trainer_api import models

from conftest import clean_env, recipe

pytestmark = pytest.mark.timeout(120)

# Trainer v2.3.0's CRD schemas, descriptions left out: where they come from is in the folder's README.
CRDS = Path(__file__).resolve().parent / "data" / "trainer-v2.3.0"
JSON_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool}
ANY = {"x-kubernetes-preserve-unknown-fields": True}  # a schema any value fits


def unknown_fields(value, annotation, path):
    """The paths in `value` for which the type `annotation`, one of kubeflow-trainer-api's models
    (Trainer's OpenAPI types, those of its CRDs), has no field: kubectl's strict field validation
    refuses each, where the models, as the API server's pruning would, drop them without a word."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union:  # Optional[...]
        return unknown_fields(value, args[0], path)
    if origin is list:
        return [bad for i, item in enumerate(value) for bad in unknown_fields(item, args[0], f"{path}[{i}]")]
    if origin is dict:
        return [bad for key, item in value.items() for bad in unknown_fields(item, args[1], f"{path}.{key}")]
    if not isinstance(value, dict):  # a leaf (a quantity is a model, its value a number or a string)
        return []
    fields = {info.alias or name: info.annotation for name, info in annotation.model_fields.items()}
    unknown = []
    for key, item in value.items():
        if key in fields:
            unknown += unknown_fields(item, fields[key], f"{path}.{key}")
        else:
            unknown.append(f"{path}.{key}")
    return unknown


def schema_problems(value, schema, path):
    """Where `value` breaks `schema`, a CRD's openAPIV3Schema, as the API server's strict field validation
    (kubectl apply --validate=strict) finds it: "path: why" for each unknown field, wrong type, missing required
    field or value out of an enum. Formats, patterns, bounds and CEL rules (x-kubernetes-validations) are left out."""
    if value is None:  # the API server drops a null, as if the field were left out
        return []
    if schema.get("x-kubernetes-int-or-string"):
        types = ["integer", "string"]
    else:
        types = [schema["type"]] if "type" in schema else list(JSON_TYPES)  # untyped: where unknown fields are kept
    # A bool is an int to Python, not to JSON.
    if not isinstance(value, tuple(JSON_TYPES[t] for t in types)) or isinstance(value, bool) and "boolean" not in types:
        return [f"{path}: not {' or '.join(types)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: not one of {schema['enum']}"]
    if isinstance(value, list):
        items = schema.get("items", ANY)
        return [bad for i, item in enumerate(value) for bad in schema_problems(item, items, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    properties, values = schema.get("properties", {}), schema.get("additionalProperties")  # a map's values
    problems = [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
    for key, item in value.items():
        if key in properties or values is not None:
            problems += schema_problems(item, properties.get(key, values), f"{path}.{key}")
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{path}.{key}: unknown field")
    return problems


def crd_problems(manifest, kind):
    """`schema_problems` of a `kind` manifest against Trainer v2.3.0's CRD, whose schema the API server completes:
    it serves the kind at one version, and reads metadata as Kubernetes' ObjectMeta (to the CRD, `type: object`)."""
    schema = json.loads((CRDS / f"{kind.lower()}.schema.json").read_text())
    schema.setdefault("required", []).extend(["apiVersion", "kind"])
    schema["properties"]["apiVersion"]["enum"] = ["trainer.kubeflow.org/v1alpha1"]
    schema["properties"]["kind"]["enum"] = [kind]
    fields = models.IoK8sApimachineryPkgApisMetaV1ObjectMeta.model_fields
    meta = {info.alias or name: ANY for name, info in fields.items()}
    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    meta.update(name={"type": "string"}, labels=strings, annotations=strings)
    schema["properties"]["metadata"]["properties"] = meta
    return schema_problems(manifest, schema, kind)


@pytest.mark.parametrize("kind", ["TrainJob", "ClusterTrainingRuntime"])
def test_the_kubeflow_recipes_fit_trainer_2_3s_api_field_by_field(kind):
    manifest = recipe(f"kind: {kind}")
    model = {"TrainJob": models.TrainerV1alpha1TrainJob,
             "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime}[kind]
    assert manifest["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert unknown_fields(manifest, model, kind) == []
    model.from_dict(manifest)  # each value of its type, every required field there


@pytest.mark.parametrize("kind", ["TrainJob", "ClusterTrainingRuntime"])
def test_the_kubeflow_recipes_fit_trainer_2_3s_crd_schemas(kind):
    assert crd_problems(recipe(f"kind: {kind}"), kind) == []


def test_strict_field_validation_refuses_the_old_trainjob_field_and_a_misspelled_one():
    # What a check that only parsed would miss: Trainer v2.1's podTemplateOverrides, which
    # v2.2 replaced by runtimePatches, and a misspelling that a plain parse drops without a word.
    def refused(manifest):  # by both strict checks, at the same path: the models' and the CRD's
        by_models = unknown_fields(manifest, models.TrainerV1alpha1TrainJob, "TrainJob")
        assert crd_problems(manifest, "TrainJob") == [f"{path}: unknown field" for path in by_models]
        return by_models

    manifest = recipe("kind: TrainJob")
    manifest["spec"]["podTemplateOverrides"] = manifest["spec"].pop("runtimePatches")
    pod = manifest["spec"]["podTemplateOverrides"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = pod["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    assert models.TrainerV1alpha1TrainJob.from_dict(manifest).spec.runtime_patches is None
    assert refused(manifest) == ["TrainJob.spec.podTemplateOverrides"]
    del manifest["spec"]["podTemplateOverrides"]
    manifest["spec"]["runtimePatches"] = [{"manager": "example.com/x", "trainingRuntimeSpec": {"template": {
        "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}]
    assert refused(manifest) == [
        "TrainJob.spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template"
        ".spec.terminationGracePeriodSecond"]


def test_the_trainjob_keeps_trainers_webhook_rules_and_launch_sh_runs_first():
    # Trainer v2.3.0's admission webhook (pkg/runtime/framework/plugins/jobset/jobset.go): a patch's
    # manager is a domain-prefixed path, and the container "node" takes no env from a patch (it
    # comes from trainer.env, which may not set PET_* names: torch.go).
    spec = recipe("kind: TrainJob")["spec"]
    (patch,) = spec["runtimePatches"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[\w./-]+", patch["manager"])
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert job["name"] == "node" and [c["name"] for c in pod["containers"]] == ["node"]
    assert "env" not in pod["containers"][0]
    assert not [e for e in spec["trainer"]["env"] if e["name"].startswith("PET_")]
    assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} == {"/data", "/ckpt", "/dev/shm"}
    # The container's first process, which gets Kubernetes' SIGTERM: launch.sh, not a shell around it.
    assert spec["trainer"]["command"][:2] == ["bash", "/workspace/launch.sh"]
    (run_id,) = [e for e in spec["trainer"]["env"] if e["name"] == "RUN_ID"]
    assert run_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"


SKYPILOT_CHECK = """
import sys, yaml
from sky.server import plugins
# As SkyPilot's API server checks a task: with its plugins loaded (none here), unknown fields fail.
plugins.load_plugins(plugins.ExtensionContext())
import sky
from sky.jobs import recovery_strategy  # registers the recovery strategies
from sky.utils import registry
task = yaml.safe_load(sys.stdin)
strategy = task["resources"]["job_recovery"]["strategy"]
sky.Task.from_yaml_config(task)
registry.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(strategy)
"""


def skypilot_check(task, tmp_path):
    """SkyPilot 0.14.1 checking `task`: its exit code and its last line. sky writes under HOME."""
    result = subprocess.run([sys.executable, "-c", SKYPILOT_CHECK], input=yaml.safe_dump(task), text=True,
                            capture_output=True, env=clean_env(HOME=tmp_path, IS_SKYPILOT_SERVER=1), timeout=90)
    return result.returncode, (result.stderr.strip().splitlines() or [""])[-1]


def test_the_skypilot_task_fits_skypilots_own_schema(tmp_path):
    task = recipe("job_recovery")
    assert skypilot_check(task, tmp_path) == (0, "")
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [75]  # launch.sh's stop
    assert "exec" not in task["run"]  # SkyPilot's upload of MOUNT_CACHED waits for run: to end


@pytest.mark.parametrize("mistake", ["recover_on_exit_code", "MOUNT_CACHE", "EAGER_NEXT_REGON"])
def test_skypilots_schema_refuses_a_misspelled_task(tmp_path, mistake):
    # Each a misspelling that SkyPilot's client lets through, or its controller finds only at run time.
    task = recipe("job_recovery")
    recovery = task["resources"]["job_recovery"]
    if mistake == "recover_on_exit_code":
        recovery[mistake] = recovery.pop("recover_on_exit_codes")
    elif mistake == "MOUNT_CACHE":
        task["file_mounts"]["/checkpoints"]["mode"] = mistake
    else:
        recovery["strategy"] = mistake
    code, line = skypilot_check(task, tmp_path)
    assert code == 1 and mistake in line, line
