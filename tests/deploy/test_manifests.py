"""The KServe manifests (config/runtimes/, docs/examples/) against what they deploy.

Every YAML document parses; every KServe object validates against the CRD schema of its
apiVersion (KServe's own, copied into kserve-crds/ beside this file); every container that runs
this server, as KServe's controller assembles it, starts with args the server's command line
accepts; every image is one the Dockerfiles build; the runtimes probe and expose metrics where
the server serves them; the metric names in autoscaling queries are ones the README documents.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from huggingfaceserver.cli import parse_args
from tests.deploy.manifests import (
    CRD_DIR,
    DOCKERFILES,
    EXAMPLE_DIR,
    KSERVE_ENV,
    KSERVE_GROUP,
    MANIFESTS,
    REPO,
    RUNTIME_DIR,
    Container,
    argv_problems,
    built_images,
    containers,
    crd_validators,
    documented_metrics,
    documents,
    find,
    is_kserve,
    kserve_image,
    our_runtimes,
    query_metrics,
    schema_errors,
    server_argvs,
    server_commands,
    shell_scripts,
    substitute_templates,
)

IDS = [str(p.relative_to(REPO)) for p in MANIFESTS]
Validators = dict[tuple[str, str], jsonschema.protocols.Validator]


@pytest.fixture(scope="session")
def validators() -> Validators:
    """KServe's CRDs as JSON Schema validators, loaded once."""
    return crd_validators(CRD_DIR)


# --- the tests: every manifest ---------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_manifest_parses_into_kubernetes_objects(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no document"
    for doc in docs:
        assert isinstance(doc, dict), f"a document of {path.name} is not a mapping"
        assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str)
        if doc["kind"] != "Kustomization":  # kustomize's own file, not an object it applies
            assert isinstance(doc.get("metadata", {}).get("name"), str), f"{doc['kind']}: name"


@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_kserve_objects_validate_against_the_crds(path: Path, validators: Validators) -> None:
    for doc in filter(is_kserve, documents(path)):
        key = (doc["apiVersion"], doc["kind"])
        assert key in validators, f"no CRD in {CRD_DIR} for {key}"
        errors = schema_errors(validators[key], doc)
        assert not errors, f"{doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(errors)


@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_server_containers_start_with_args_the_cli_accepts(path: Path) -> None:
    problems = [p for doc in documents(path) for p in argv_problems(doc)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_images_are_the_ones_the_dockerfiles_build(path: Path) -> None:
    built = built_images()
    for doc in documents(path):
        for container in containers(doc):
            if container.image is None:
                continue
            assert container.image in built, f"{container.where}: {container.image} not in {built}"
            if doc["kind"] == "InferenceService" and container.gpu:
                assert container.image.endswith("-gpu"), f"{container.where}: GPU, CPU image"


@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_shell_scripts_are_valid_bash(path: Path) -> None:
    for script in shell_scripts(documents(path)):
        done = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
        assert done.returncode == 0, f"{done.stderr}\nin:\n{script}"


@pytest.mark.vllm
@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_engine_flags_are_ones_the_installed_vllm_parses(path: Path) -> None:
    """vLLM engine flags pass the CLI unchecked; the vLLM backend hands them to vLLM's own
    parser, and logs (only) those it does not know as ignored. Here they go through the
    installed vLLM's parser, as the backend passes them."""
    pytest.importorskip("vllm")
    from huggingfaceserver.backends.lora import parse_lora_modules
    from huggingfaceserver.backends.vllm import compat

    known = compat.engine_flag_names()
    for doc in documents(path):
        for container, argv in server_commands(doc):
            flags = compat.translate_speculative_flags(parse_args(argv).engine_flags)
            assert set(flags) <= known, f"{container.where}: vLLM ignores {set(flags) - known}"
            if "lora-modules" in flags:
                assert "enable-lora" in flags, f"{container.where}: --lora-modules alone"
                assert parse_lora_modules(flags.pop("lora-modules"))
            engine_argv = ["--model", "model", *compat.flags_to_argv(flags)]
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                try:
                    compat.engine_parser().parse_args(engine_argv)
                except SystemExit:
                    pytest.fail(f"{container.where}: {stderr.getvalue().strip()}")


@pytest.mark.parametrize("path", MANIFESTS, ids=IDS)
def test_readiness_probes_pass_knatives_validation(path: Path) -> None:
    """Knative takes a readiness probe without periodSeconds for its own aggressive probing,
    and refuses failureThreshold or timeoutSeconds with it."""
    for probe in find(documents(path), "readinessProbe"):
        if not probe.get("periodSeconds"):
            assert not {"failureThreshold", "timeoutSeconds"} & set(probe), probe


# --- the tests: the runtimes and the examples as a whole -------------------------------------


def test_the_runtimes_probe_and_expose_metrics_on_the_servers_http_port() -> None:
    port = parse_args([]).server.http_port
    assert set(our_runtimes()) == {"huggingfaceserver", "huggingfaceserver-multinode"}
    for name, runtime in our_runtimes().items():
        spec = runtime["spec"]
        assert spec["annotations"]["prometheus.kserve.io/port"] == str(port), name
        assert spec["annotations"]["prometheus.io/port"] == str(port), name
        assert {"v1", "v2"} <= set(spec["protocolVersions"])
        assert [f["name"] for f in spec["supportedModelFormats"]] == ["huggingface"]
        (head,) = spec["containers"]
        probes = {kind: head[f"{kind}Probe"]["httpGet"] for kind in ("liveness", "readiness")}
        assert probes["liveness"] == {"path": "/v2/health/live", "port": port}, name
        assert probes["readiness"] == {"path": "/v2/health/ready", "port": port}, name
        assert head["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": port}
        startup = head["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, "slow loads"


def test_the_runtimes_run_restricted_as_the_images_user_with_shared_memory() -> None:
    users = {re.findall(r"^USER\s+(\S+)", d.read_text(), re.M)[-1] for d in DOCKERFILES}
    assert len(users) == 1, f"the Dockerfiles' users differ: {users}"
    for name, runtime in our_runtimes().items():
        spec = runtime["spec"]
        memory_volumes = {
            v["name"]
            for s in (spec, spec.get("workerSpec", {}))
            for v in s.get("volumes", [])
            if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        heads_and_workers = [*spec["containers"], *spec.get("workerSpec", {}).get("containers", [])]
        for container in heads_and_workers:
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, name
            assert str(context["runAsUser"]) in users, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert context["seccompProfile"]["type"] == "RuntimeDefault", name
            shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            assert shm and shm[0]["name"] in memory_volumes, f"{name}: /dev/shm in memory"


def test_the_gpu_image_installs_ray_for_the_multinode_runtime() -> None:
    runtime = our_runtimes()["huggingfaceserver-multinode"]
    assert any("ray start" in script for script in shell_scripts(runtime))
    dockerfile = (REPO / "Dockerfile.gpu").read_text().replace("\\\n", " ")
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert any(re.search(r"[\s\"']ray(\[[\w,]+\])?([=<>~]|[\s\"']|$)", i) for i in installs)


def test_the_makefile_tags_the_images_the_manifests_name() -> None:
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "image", "image-gpu"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    words = shlex.split(done.stdout.replace("\\\n", " "))
    tags = {words[i + 1] for i, word in enumerate(words) if word == "-t"}
    files = {REPO / words[i + 1] for i, word in enumerate(words) if word == "-f"}
    assert tags == built_images()
    assert files == set(DOCKERFILES)


def test_every_example_has_a_service_a_readme_and_a_line_in_the_index() -> None:
    index = (EXAMPLE_DIR / "README.md").read_text()
    folders = sorted(p for p in EXAMPLE_DIR.iterdir() if p.is_dir())
    assert len(folders) >= 13
    for folder in folders:
        assert (folder / "inferenceservice.yaml").is_file(), folder.name
        assert (folder / "README.md").is_file(), folder.name
        assert f"]({folder.name})" in index, f"docs/examples/README.md does not link {folder.name}"
        kinds = {doc["kind"] for doc in documents(folder / "inferenceservice.yaml")}
        assert "InferenceService" in kinds, folder.name


def test_the_kustomization_installs_every_runtime() -> None:
    (kustomization,) = documents(RUNTIME_DIR / "kustomization.yaml")
    files = {p.name for p in RUNTIME_DIR.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_autoscaling_queries_use_metrics_the_readme_documents() -> None:
    documented = documented_metrics()
    assert {"vllm:num_requests_waiting", "hfserver_requests_in_flight"} <= documented
    queries = [q for path in MANIFESTS for q in find(documents(path), "query")]
    assert len(queries) >= 3
    for query in queries:
        names = query_metrics(query)
        assert names, f"no metric of this server in {query!r}"
        assert names <= documented, f"not in the README's Metrics section: {names - documented}"


# --- the checks can fail ---------------------------------------------------------------------


def isvc(**model: Any) -> dict[str, Any]:
    model = {"modelFormat": {"name": "huggingface"}, "runtime": "huggingfaceserver", **model}
    return {
        "apiVersion": f"{KSERVE_GROUP}/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": "check"},
        "spec": {"predictor": {"model": model}},
    }


def test_the_schema_check_catches_wrong_fields_types_and_values(
    validators: Validators,
) -> None:
    validator = validators[(f"{KSERVE_GROUP}/v1beta1", "InferenceService")]
    assert schema_errors(validator, isvc(args=["--model_name=x"])) == []
    misspelled = isvc(storageURI="hf://x")
    assert "Additional properties" in schema_errors(validator, misspelled)[0]
    wrong_type = isvc(args="--model_name=x")
    assert schema_errors(validator, wrong_type)[0].startswith("spec.predictor.model.args:")
    env = isvc(env=[{"name": "N", "value": 1}])  # an unquoted YAML number
    assert "is not of type 'string'" in schema_errors(validator, env)[0]
    quantity = isvc(resources={"limits": {"cpu": 1, "memory": "2Gi"}})
    assert schema_errors(validator, quantity) == []  # int-or-string
    assert schema_errors(validator, isvc(resources={"limits": {"memory": "2 GB"}}))
    top = {**isvc(), "spek": {}}
    assert "'spek' was unexpected" in schema_errors(validator, top)[0]
    meta = {**isvc(), "metadata": {"name": "Check_1"}}
    assert schema_errors(validator, meta)[0].startswith("metadata.name:")
    huge = isvc()
    huge["spec"]["predictor"]["minReplicas"] = 2**31
    assert "int32" in schema_errors(validator, huge)[0]


def test_the_args_check_catches_unknown_flags_conflicts_and_workers() -> None:
    assert argv_problems(isvc(args=["--model_id=x", "--enforce-eager"])) == []
    (unknown,) = argv_problems(isvc(args=["--model_idd=x"]))
    assert "unrecognized arguments: --model_idd" in unknown
    (conflict,) = argv_problems(isvc(args=["--return_probabilities", "--return_raw_logits"]))
    assert "not allowed with" in conflict
    transformer = isvc()
    transformer["spec"]["transformer"] = {
        "containerConcurrency": 4,
        "containers": [{"name": "kserve-container", "image": "huggingfaceserver:x"}],
    }
    (workers,) = argv_problems(transformer)
    assert "--workers" in workers


def test_the_args_check_reads_shell_scripts_and_fills_in_templates() -> None:
    script = (
        "set -eu\n"
        'exec python -m huggingfaceserver ${MODEL_DIR:+--model_dir="$MODEL_DIR"} \\\n'
        '  --tensor-parallel-size="${TENSOR_PARALLEL_SIZE}" "$0" "$@"\n'
    )
    container = Container("c", "i", ["bash", "-c", script], ["--model_name=x", "--task=fill_mask"])
    (argv,) = server_argvs(container, KSERVE_ENV)
    assert argv == [
        "--model_dir=/mnt/models", "--tensor-parallel-size=1", "--model_name=x", "--task=fill_mask"
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="does not expand"):
        server_argvs(
            Container("c", "i", ["bash", "-c", "python -m huggingfaceserver $NOPE"], []), {}
        )
    assert substitute_templates(["--model_name={{.Name}}"], "llm") == ["--model_name=llm"]
    with pytest.raises(AssertionError, match="no"):
        substitute_templates(["{{.Nope}}"], "llm")


def test_the_image_check_follows_kserves_gpu_tag_rule() -> None:
    runtime = our_runtimes()["huggingfaceserver"]
    image = runtime["spec"]["containers"][0]["image"]
    gpu = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    assert kserve_image(image, {}, runtime) == image
    assert kserve_image(image, gpu, runtime) == f"{image}-gpu"
    assert kserve_image(image, {**gpu, "runtimeVersion": "9.9"}, runtime).endswith(":9.9")
