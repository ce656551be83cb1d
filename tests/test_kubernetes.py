"""examples/kubernetes/, checked offline: there is no cluster here.

The manifests parse; every command, flag and ``JAXPS_*`` name exists; the
servers' names, ports and counts agree with what the workers are told; and
a worker pod's environment gives jaxps the rank of its index.
(``kubectl create --dry-run=client`` is no help here: kubectl 1.32 asks the
API server for its resource list even then, and fails without one.)
"""

import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from jaxps._src import config

ROOT = pathlib.Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "examples" / "kubernetes"


def _load():
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def manifests():
    return _load()


def _container(pod_spec):
    (container,) = pod_spec["containers"]
    return container


def _env(container, **extra):
    """The container's plain env values (a Secret's as a placeholder)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "jaxps-token", "key": "token"}, var
            env[var["name"]] = "secret-from-the-secret"
    return {**env, **extra}


def _flags(argv):
    return {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if "=" in a}


def test_every_kind_is_there(manifests):
    assert set(manifests) == {
        ("Service", "jaxps-servers"),
        ("StatefulSet", "jaxps-server"),
        ("Job", "jaxps-train"),
        ("NetworkPolicy", "jaxps-servers"),
    }


def test_server_command_flags_and_probes(manifests):
    sts = manifests[("StatefulSet", "jaxps-server")]
    pod = sts["spec"]["template"]["spec"]
    server = _container(pod)
    command = server["command"]
    assert command[0] == "jaxps-server"
    help_text = subprocess.run(
        [sys.executable, "-m", "jaxps.servers", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for flag in _flags(command[1:]):
        assert re.search(rf"\[{re.escape(flag)}[ \]]", help_text), flag
    flags = _flags(command[1:])
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert int(flags["--port"]) == ports["grpc"]
    assert int(flags["--data-port"]) == ports["data"]  # fixed, for a Service
    assert flags["--host"] == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"]["port"] == ports["grpc"], probe
    assert pod["nodeSelector"] == {"jaxps.dev/pool": "cpu"}
    assert set(_env(server)) <= set(config.ENV.values())


def test_workers_are_told_what_the_servers_are(manifests):
    svc = manifests[("Service", "jaxps-servers")]
    sts = manifests[("StatefulSet", "jaxps-server")]
    job = manifests[("Job", "jaxps-train")]
    policy = manifests[("NetworkPolicy", "jaxps-servers")]
    server = _container(sts["spec"]["template"]["spec"])
    worker = _container(job["spec"]["template"]["spec"])
    env = _env(worker)
    assert set(env) <= set(config.ENV.values()), env

    # headless Service of the StatefulSet, selecting its pods
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()

    # one address per server pod, by its stable name, on the gRPC port
    replicas = sts["spec"]["replicas"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    expected = [
        f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:"
        f"{ports['grpc']}"
        for i in range(replicas)
    ]
    assert env["JAXPS_SERVERS"].split(",") == expected
    assert {p["port"] for p in svc["spec"]["ports"]} == set(ports.values())

    # one worker per index: the size the servers and the workers expect
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    n = int(env["JAXPS_NUM_WORKERS"])
    assert spec["completions"] == spec["parallelism"] == n
    assert int(_flags(server["command"])["--num-workers"]) == n

    # the policy lets the workers' pods reach both ports of the servers
    (rule,) = policy["spec"]["ingress"]
    worker_labels = spec["template"]["metadata"]["labels"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert {p["port"] for p in rule["ports"]} == set(ports.values())
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        labels.items()
    )

    # the worker's program is in the image (the repository)
    assert worker["command"][0] == "python"
    assert (ROOT / worker["command"][1]).is_file()


def test_each_pod_gets_its_rank_from_its_index(manifests):
    job = manifests[("Job", "jaxps-train")]
    env = _env(_container(job["spec"]["template"]["spec"]))
    n = job["spec"]["completions"]
    for index in range(n):
        cfg = config.Config.from_env(
            {**env, "JOB_COMPLETION_INDEX": str(index)}
        )
        assert (cfg.worker_rank, cfg.num_workers) == (index, n)
        assert cfg.token and cfg.job_id == "jaxps-train"
