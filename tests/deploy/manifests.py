"""The KServe manifests (config/runtimes/, docs/examples/) as tests read them: their YAML
documents, KServe's CRD schemas as strict JSON Schema, each container as KServe's controller
assembles it, and the argv this server starts with in it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from huggingfaceserver.cli import ServerConfig, parse_args

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = Path(__file__).resolve().parent / "kserve-crds"  # KServe's own, copied: see its README
RUNTIME_DIR = REPO / "config" / "runtimes"
EXAMPLE_DIR = REPO / "docs" / "examples"
MANIFESTS = sorted(p for d in (REPO / "config", EXAMPLE_DIR) for p in d.rglob("*.y*ml"))
DOCKERFILES = [REPO / "Dockerfile", REPO / "Dockerfile.gpu"]

KSERVE_GROUP = "serving.kserve.io"
IMAGE_NAME = "huggingfaceserver"
SERVER_COMMAND = ["python", "-m", "huggingfaceserver"]
SHELLS = ("bash", "sh")
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2 MB

# What KServe's controller puts in a multi-node head container's environment (sample values).
KSERVE_ENV = {
    "TENSOR_PARALLEL_SIZE": "1",
    "PIPELINE_PARALLEL_SIZE": "2",
    "RAY_NODE_COUNT": "2",
    "MODEL_DIR": "/mnt/models",
    "POD_IP": "10.0.0.1",
    "POD_NAMESPACE": "default",
}


@cache
def documents(path: Path) -> list[Any]:
    """The YAML documents of a file, empty ones dropped."""
    return [doc for doc in yaml.load_all(path.read_text(), Loader=Loader) if doc is not None]


def project_version() -> str:
    """``version`` in pyproject.toml."""
    text = (REPO / "pyproject.toml").read_text()
    return str(tomllib.loads(text)["project"]["version"])


def built_images() -> set[str]:
    """The CPU and GPU images (the contract between the Dockerfiles, the Makefile and YAML)."""
    version = project_version()
    return {f"{IMAGE_NAME}:{version}", f"{IMAGE_NAME}:{version}-gpu"}


def is_kserve(doc: dict[str, Any]) -> bool:
    return str(doc.get("apiVersion", "")).split("/")[0] == KSERVE_GROUP


def name_of(doc: dict[str, Any]) -> str:
    return str(doc.get("metadata", {}).get("name", doc["kind"]))


def find(node: Any, key: str) -> Iterator[Any]:
    """Every value of ``key`` in nested mappings and lists."""
    if isinstance(node, dict):
        for name, value in node.items():
            if name == key:
                yield value
            yield from find(value, key)
    elif isinstance(node, list):
        for item in node:
            yield from find(item, key)


def shell_scripts(node: Any) -> Iterator[str]:
    """The scripts of every `bash -c` / `sh -c` command (containers and exec probes)."""
    for command in find(node, "command"):
        if isinstance(command, list) and len(command) >= 3 and is_shell(command):
            yield command[2]


def is_shell(command: list[str]) -> bool:
    """``bash -c SCRIPT ...`` or ``sh -c SCRIPT ...``."""
    return command[0] in SHELLS and command[1:2] == ["-c"]


# --- CRD schemas as JSON Schema --------------------------------------------------------------

# Kubernetes validates metadata itself (the CRDs say only `type: object`): what a manifest sets.
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}

FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def strict_schema(node: Any) -> Any:
    """A CRD's openAPIV3Schema as a JSON Schema that rejects unknown fields.

    The API server prunes fields a structural schema does not list, but kubectl (1.27+) applies
    with `--validate=strict` by default: server-side field validation then refuses them
    ("unknown field"). So every object that lists `properties` and neither allows
    `additionalProperties` nor sets `x-kubernetes-preserve-unknown-fields` gets
    `additionalProperties: false`. The rest is JSON Schema already: `x-kubernetes-int-or-string`
    comes with `anyOf: [integer, string]`, other `x-kubernetes-*` keys are ignored. A null value
    is refused where a type is given (the API server would drop it: in a manifest it is a slip).
    """
    if isinstance(node, list):
        return [strict_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = strict_schema(node[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = strict_schema(node[key])
    if "properties" in node:
        out["properties"] = {name: strict_schema(s) for name, s in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


def object_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    """A whole object's schema: the CRD's, with Kubernetes' own rules for its metadata."""
    schema = strict_schema(openapi)
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def crd_validators(crd_dir: Path) -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator, for every version of every CRD in ``crd_dir``."""
    validators = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        for crd in documents(path):
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = object_schema(version["schema"]["openAPIV3Schema"])
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                validators[key] = jsonschema.Draft4Validator(schema, format_checker=FORMATS)
    return validators


def schema_errors(validator: jsonschema.protocols.Validator, doc: Any) -> list[str]:
    """``path: message`` for each violation, the path as in kubectl's messages."""
    found = []
    for error in validator.iter_errors(doc):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        found.append(f"{path.lstrip('.') or '(root)'}: {error.message}")
    return sorted(found)


# --- containers as KServe runs them ----------------------------------------------------------


@dataclass
class Container:
    """One container of a manifest, as KServe's controller assembles it."""

    where: str
    image: str | None
    """None: no image of ours (a predictor served by another runtime, e.g. Triton)."""
    command: list[str] | None
    args: list[str]
    gpu: bool = False


@cache
def our_runtimes() -> dict[str, dict[str, Any]]:
    """Our serving runtimes by name (ClusterServingRuntime or ServingRuntime)."""
    return {
        doc["metadata"]["name"]: doc
        for path in sorted(RUNTIME_DIR.glob("*.yaml"))
        for doc in documents(path)
        if is_kserve(doc) and doc["kind"].endswith("ServingRuntime")
    }


def wants_gpu(resources: dict[str, Any] | None) -> bool:
    amounts = {**(resources or {}).get("requests", {}), **(resources or {}).get("limits", {})}
    return any(name.endswith("/gpu") for name in amounts)


def kserve_image(image: str, model: dict[str, Any], runtime: dict[str, Any]) -> str:
    """The image KServe runs for a predictor: ``runtimeVersion`` replaces the tag, else a GPU
    request appends ``-gpu`` for runtimes of the huggingfaceserver server type (its
    ``UpdateImageTag``)."""
    name, _, tag = image.rpartition(":")
    if model.get("runtimeVersion"):
        return f"{name}:{model['runtimeVersion']}"
    server_type = runtime["metadata"].get("annotations", {}).get(f"{KSERVE_GROUP}/server-type")
    if server_type == IMAGE_NAME and wants_gpu(model.get("resources")) and tag[-4:] != "-gpu":
        return f"{image}-gpu"
    return image


def plain_container(where: str, container: dict[str, Any]) -> Container:
    return Container(
        where,
        container["image"],
        container.get("command"),
        list(container.get("args", [])),
        gpu=wants_gpu(container.get("resources")),
    )


def predictor_containers(isvc: dict[str, Any]) -> Iterator[Container]:
    """A predictor's containers: a huggingface model merged into our runtime's (the runtime's
    args first, the model's after them), or the predictor's own containers."""
    name = isvc["metadata"]["name"]
    predictor = isvc["spec"]["predictor"]
    model = predictor.get("model")
    if model is not None and model["modelFormat"]["name"] != "huggingface":
        yield Container(f"{name}: {model['modelFormat']['name']} predictor", None, None, [])
    elif model is not None:
        runtime_name = model.get("runtime")
        assert runtime_name in our_runtimes(), (
            f"{name}: a huggingface model names one of our runtimes ({sorted(our_runtimes())}),"
            f" not {runtime_name!r}: KServe ships its own runtime for this model format"
        )
        runtime = our_runtimes()[runtime_name]
        assert ("workerSpec" in predictor) == ("workerSpec" in runtime["spec"]), (
            f"{name}: KServe picks a multi-node runtime exactly when the predictor has a workerSpec"
        )
        head = runtime["spec"]["containers"][0]
        yield Container(
            f"{name}: predictor ({runtime_name})",
            kserve_image(model.get("image", head["image"]), model, runtime),
            model.get("command", head.get("command")),
            [*head.get("args", []), *model.get("args", [])],
            gpu=wants_gpu(model.get("resources")),
        )
        for worker in runtime["spec"].get("workerSpec", {}).get("containers", []):
            yield plain_container(f"{name}: worker ({runtime_name})", worker)
    for container in predictor.get("containers", []):
        yield plain_container(f"{name}: predictor container", container)


def transformer_containers(isvc: dict[str, Any]) -> Iterator[Container]:
    """A transformer's containers, with the args KServe's controller adds (its
    ``CustomTransformer.GetContainer``)."""
    name = isvc["metadata"]["name"]
    transformer = isvc["spec"].get("transformer", {})
    for container in transformer.get("containers", []):
        found = plain_container(f"{name}: transformer", container)
        added = {
            "--model_name": name,
            "--predictor_host": f"{name}-predictor.default",
            "--http_port": "8080",
        }
        if transformer.get("containerConcurrency"):
            added["--workers"] = str(transformer["containerConcurrency"])
        for flag, value in added.items():
            if not any(arg.startswith(flag) for arg in found.args):
                found.args += [flag, value]
        yield found


def containers(doc: dict[str, Any]) -> Iterator[Container]:
    """Every container of a manifest's object, as KServe runs it (for any other kind, every
    container in it as written: runtimes, Jobs, ...)."""
    if doc["kind"] == "InferenceService":
        yield from predictor_containers(doc)
        yield from transformer_containers(doc)
        return
    for key in ("containers", "initContainers"):
        for listed in find(doc, key):
            for container in listed:
                where = f"{doc['kind']} {name_of(doc)}: {container.get('name')}"
                yield plain_container(where, container)


# --- the server's argv -----------------------------------------------------------------------

TEMPLATE = re.compile(r"\{\{\s*\.(\w+)((?:\.[\w.-]+)?)\s*\}\}")


def substitute_templates(args: list[str], name: str) -> list[str]:
    """KServe's `{{.Name}}`-style placeholders, as its controller fills them in."""
    values = {"Name": name, "Namespace": "default", "Labels": "label", "Annotations": "note"}

    def value(match: re.Match[str]) -> str:
        if match.group(1) not in values:
            raise AssertionError(f"KServe fills in no {match.group(0)}")
        return values[match.group(1)]

    return [TEMPLATE.sub(value, arg) for arg in args]


def shell_server_lines(script: str) -> list[str]:
    """What follows ``python -m huggingfaceserver`` on each line of a shell script that runs it
    (continued lines joined)."""
    joined = script.replace("\\\n", " ")
    marker = " ".join(SERVER_COMMAND)
    return [line.split(marker, 1)[1] for line in joined.splitlines() if marker in line]


def shell_argv(words: str, args: list[str], env: dict[str, str]) -> list[str]:
    """The argv a shell builds from ``words`` ("$0" "$@" being ``args``), by running bash with
    only ``env`` set (and ``set -u``: a variable nobody sets is an error)."""
    done = subprocess.run(
        ["bash", "-c", f"set -u; printf '%s\\0' {words}", *args],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"the server's command line does not expand: {done.stderr}"
    return done.stdout.split("\0")[:-1]


def server_argvs(container: Container, env: dict[str, str]) -> list[list[str]]:
    """The argv lists this server starts with in a container: the image's entrypoint (`python -m
    huggingfaceserver`) with the args, or the server command of a shell script; none when the
    container runs something else (Ray, a download) or is not ours."""
    command = container.command
    if container.image is None:
        return []
    if not command:
        return [container.args]
    if command[:3] == SERVER_COMMAND:
        return [command[3:] + container.args]
    if is_shell(command):
        return [shell_argv(w, container.args, env) for w in shell_server_lines(command[2])]
    return []


def container_env(doc: dict[str, Any]) -> dict[str, str]:
    """What KServe's controller sets, and the literal env values anywhere in the object."""
    env = dict(KSERVE_ENV)
    for listed in find(doc, "env"):
        env.update({var["name"]: var["value"] for var in listed if "value" in var})
    return env


def parse_server_args(argv: list[str]) -> tuple[ServerConfig | None, str]:
    """The server's config for ``argv``, or None and the CLI's error message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_args(argv), ""
    except SystemExit:
        return None, stderr.getvalue().strip().splitlines()[-1]


def server_commands(doc: dict[str, Any]) -> Iterator[tuple[Container, list[str]]]:
    """Each container that runs this server, with the argv it starts it with."""
    env = container_env(doc)
    for container in containers(doc):
        args = substitute_templates(container.args, name_of(doc))
        for argv in server_argvs(dataclasses.replace(container, args=args), env):
            yield container, argv


def argv_problems(doc: dict[str, Any]) -> list[str]:
    """What would stop this server at startup from its command line, per container: a flag
    the CLI refuses (unknown, conflicting, a bad value), or KServe's --workers above 1."""
    problems = []
    for container, argv in server_commands(doc):
        config, error = parse_server_args(argv)
        if config is None:
            problems.append(f"{container.where}: {error} (argv {argv})")
        elif config.server.workers > 1:
            problems.append(f"{container.where}: --workers > 1 is refused (argv {argv})")
    return problems


# --- metrics ---------------------------------------------------------------------------------

METRIC = re.compile(r"\b(?:vllm:[a-z_:]+|hfserver_[a-z_]+)")


def documented_metrics() -> set[str]:
    """The metric names of the README's Metrics section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    return set(METRIC.findall(section))


def query_metrics(query: str) -> set[str]:
    """This server's metric names in a PromQL query (histogram series as their histogram)."""
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in METRIC.findall(query)}
