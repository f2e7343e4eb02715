"""deploy/k8s/ stays deployable and true to the code.

Every manifest validates against Kubernetes' own schemas (strict: an unknown field is an error),
and the fields Marduk depends on say what the CLI and docs/operations.md say: the controllers'
flags and probes, the trainers' environment and exit-code policy, the monitor daemon's
credential, the NATS chart's auth include, and no seed or password anywhere.
"""

from __future__ import annotations

import copy
import posixpath
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.supervise.supervisor import ExitCode
from marduk.transport import auth

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "k8s"
HELM_VALUES = DEPLOY / "nats-values.yaml"  # Helm values, not a Kubernetes manifest

# 1.31: podFailurePolicy is GA, backoffLimitPerIndex and podReplacementPolicy on by default (beta
# since 1.29). And the newest version the installed kubernetes-validate ships.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())

NATS_NODES = [f"nats://nats-{i}.nats-headless.marduk.svc:4222" for i in range(3)]

# The agent's exit codes (`marduk agent run --help`, docs/operations.md) and what a trainer Job
# does with each. 2 (usage) is typer's, not in ExitCode.
EXIT_POLICY = {
    ExitCode.SETUP: "Count",  # includes "cannot register within --connect-timeout": transient
    2: "FailJob",  # bad options: the same on every pod
    ExitCode.GAVE_UP: "Count",  # replace the pod, within the per-index budget
    ExitCode.DEVICE_FAILED: "Count",  # a bad device: replace the pod, within the budget
    ExitCode.STOPPED: "FailJob",  # an operator's `stop`: rescheduling would undo it
    ExitCode.PREEMPTED: "Ignore",  # SIGTERM: not the job's fault
}

# JobSet v1alpha2 (jobset.x-k8s.io), from its API types: the fields used here, the actions
# every release since v0.7 accepts, and the Job failure reasons its webhook allows.
JOBSET_SPEC_FIELDS = {
    "replicatedJobs",
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "suspend",
    "coordinator",
    "managedBy",
    "ttlSecondsAfterFinished",
}
JOBSET_REPLICATED_JOB_FIELDS = {"name", "groupName", "template", "replicas", "dependsOn"}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
JOBSET_FAILURE_REASONS = {
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}
JOBSET_RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")

# An nkey seed: 'S', the key type (U for users), base32. No password or token in clear either.
SEED = re.compile(r"S[ACNOUX][A-Z2-7]{50,}")
URL_CREDENTIALS = re.compile(r"\w+://[^/\s:@]+:[^/\s@]+@")


# --- loading ---------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p != HELM_VALUES)


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in documents() if d["kind"] == kind]
    if name is not None:
        found = [d for d in found if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def as_job(template: dict[str, Any], name: str) -> dict[str, Any]:
    """A JobSet's replicatedJobs[].template (a JobTemplateSpec) as the batch/v1 Job it becomes."""
    metadata = {**template.get("metadata", {}), "name": name}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]}


def trainer_jobs() -> list[tuple[str, dict[str, Any]]]:
    """Every Job that runs trainers: the plain indexed Job and each JobSet child Job."""
    jobs = [("Job", find("Job"))]
    jobset = find("JobSet")
    for rjob in jobset["spec"]["replicatedJobs"]:
        jobs.append((f"JobSet/{rjob['name']}", as_job(rjob["template"], rjob["name"])))
    return jobs


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def secret_at(workload: dict[str, Any], c: dict[str, Any], mount_path: str) -> str:
    """The Secret mounted at mount_path in container c."""
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount_path]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    name: str = volume["secret"]["secretName"]
    return name


def walk(node: Any) -> Iterator[tuple[str | None, Any]]:
    """(key, value) for every scalar in a YAML tree (key None in lists)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict | list):
                yield from walk(v)
            else:
                yield str(k), v
    elif isinstance(node, list):
        for v in node:
            if isinstance(v, dict | list):
                yield from walk(v)
            else:
                yield None, v


# --- schema validation -----------------------------------------------------------------------


def test_the_folder_has_every_piece() -> None:
    kinds = sorted(d["kind"] for _, d in documents())
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Deployment",
        "Job",
        "JobSet",
        "Namespace",
        "PodDisruptionBudget",
        "ServiceAccount",
    ]


def test_the_monitor_may_read_nodes_and_nothing_more() -> None:
    docs = {d["kind"]: d for _, d in documents()}
    [rule] = docs["ClusterRole"]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    [subject] = docs["ClusterRoleBinding"]["subjects"]
    assert subject["name"] == pod["serviceAccountName"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), documents(), ids=[w for w, _ in documents()])
def test_manifest_validates_against_the_kubernetes_schema(
    where: str, doc: dict[str, Any], version: str
) -> None:
    if doc["kind"] == "JobSet":
        # The JobSet CRD's schema is not among Kubernetes' own: each child Job template is
        # validated as the batch/v1 Job the JobSet controller creates from it, and the JobSet's
        # own fields are checked in test_jobset_fields.
        for rjob in doc["spec"]["replicatedJobs"]:
            kubernetes_validate.validate(as_job(rjob["template"], rjob["name"]), version, True)
        return
    kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    doc = copy.deepcopy(find("Deployment"))
    container(doc, "controller")["livenessprobe"] = {}  # a typo of livenessProbe
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


# --- controller --------------------------------------------------------------------------------


def test_controller_deployment_is_a_leader_and_a_standby_with_probes() -> None:
    dep = find("Deployment", "marduk-controller")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(dep, "controller")
    cmd = c["command"]
    assert cmd[:2] == ["marduk", "controller"]
    assert "--no-embedded" in cmd
    assert cmd[cmd.index("--kv-replicas") + 1] == "3"
    host, port = cmd[cmd.index("--metrics-addr") + 1].rsplit(":", 1)
    assert host == "0.0.0.0"
    (metrics,) = [p for p in c["ports"] if p["containerPort"] == int(port)]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": metrics["name"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": metrics["name"]}
    e = env(c)
    assert e["MARDUK_ADDR"]["value"].split(",") == NATS_NODES
    assert e["MARDUK_NKEY"]["value"] == "/auth/controller.nk"
    assert secret_at(dep, c, "/auth") == "marduk-controller"
    pdb = find("PodDisruptionBudget", "marduk-controller")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == dep["spec"]["selector"]


# --- trainers ----------------------------------------------------------------------------------


def first_matching_action(
    policy: dict[str, Any], exit_code: int, conditions: Sequence[str] = ()
) -> str:
    """What the Job controller does with a failed pod: the first rule that matches, else Count."""
    for rule in policy["rules"]:
        if "onPodConditions" in rule:
            if any(
                c["type"] in conditions and c.get("status", "True") == "True"
                for c in rule["onPodConditions"]
            ):
                return str(rule["action"])
        else:
            codes = rule["onExitCodes"]
            inside = exit_code in codes["values"]
            if inside == (codes["operator"] == "In"):
                return str(rule["action"])
    return "Count"


@pytest.mark.parametrize(("where", "job"), trainer_jobs(), ids=[w for w, _ in trainer_jobs()])
def test_trainer_pod_failure_policy_maps_every_agent_exit_code(
    where: str, job: dict[str, Any]
) -> None:
    spec = job["spec"]
    policy = spec["podFailurePolicy"]
    # Every code the agent can exit with has an explicit rule (a new one must be decided).
    assert {int(c) for c in ExitCode if c != ExitCode.OK} | {2} == set(map(int, EXIT_POLICY))
    explicit = {
        v for r in policy["rules"] if "onExitCodes" in r for v in r["onExitCodes"]["values"]
    }
    assert set(map(int, EXIT_POLICY)) <= explicit
    for code, action in EXIT_POLICY.items():
        assert first_matching_action(policy, int(code)) == action, code
    # Preempted, evicted or drained: ignored whatever the exit code.
    for code in (1, 70, 71, 137):
        assert first_matching_action(policy, code, ["DisruptionTarget"]) == "Ignore"
    for rule in policy["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == "trainer"
            assert 0 not in rule["onExitCodes"]["values"]  # the API forbids it with In
    # What the API requires around podFailurePolicy, and the per-index budget it counts against.
    assert pod_spec(job)["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["completionMode"] == "Indexed"
    assert spec["backoffLimitPerIndex"] >= 1
    assert spec["maxFailedIndexes"] == 0
    assert spec["completions"] == spec["parallelism"]


@pytest.mark.parametrize(("where", "job"), trainer_jobs(), ids=[w for w, _ in trainer_jobs()])
def test_trainers_run_under_the_agent_with_its_environment(where: str, job: dict[str, Any]) -> None:
    c = container(job, "trainer")
    assert c["command"][:4] == ["marduk", "agent", "run", "--"]
    assert len(c["command"]) > 4  # a trainer command after --
    e = env(c)
    assert e["MARDUK_ADDR"]["value"].split(",") == NATS_NODES
    assert e["MARDUK_NKEY"]["value"] == "/auth/agent.nk"
    assert e["MARDUK_CONTROLLER_KEY"]["value"] == f"/auth/{auth.CONTROLLER_PUB}"
    assert secret_at(job, c, "/auth") == "marduk-agent"
    assert e["MARDUK_SCOPE"]["value"] in {"replica", "job"}
    # Identity from the pod's own metadata (downward API), never typed in per pod.
    job_from = e["MARDUK_JOB"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert job_from in {
        "metadata.labels['batch.kubernetes.io/job-name']",
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']",
    }
    fields = {v["valueFrom"]["fieldRef"]["fieldPath"] for v in e.values() if "valueFrom" in v}
    assert "metadata.annotations['batch.kubernetes.io/job-completion-index']" in fields
    replica = e["MARDUK_REPLICA_ID"]["value"]
    (ref,) = re.findall(r"\$\((\w+)\)", replica)
    assert "fieldRef" in e[ref]["valueFrom"]
    assert list(e).index(ref) < list(e).index("MARDUK_REPLICA_ID")  # $(VAR) needs it defined first
    # The pod's grace covers the trainer's (its checkpoint) and the agent's report.
    grace = float(e["MARDUK_GRACE"]["value"])
    assert pod_spec(job)["terminationGracePeriodSeconds"] >= grace + 10


def test_jobset_fields() -> None:
    js = find("JobSet")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    spec = js["spec"]
    assert set(spec) <= JOBSET_SPEC_FIELDS
    names = [r["name"] for r in spec["replicatedJobs"]]
    for rjob in spec["replicatedJobs"]:
        assert set(rjob) <= JOBSET_REPLICATED_JOB_FIELDS
        assert isinstance(rjob["replicas"], int) and rjob["replicas"] >= 1
    assert set(spec["successPolicy"]) <= {"operator", "targetReplicatedJobs"}
    assert spec["successPolicy"]["operator"] == "All"
    assert set(spec["successPolicy"]["targetReplicatedJobs"]) <= set(names)
    fp = spec["failurePolicy"]
    assert set(fp) <= {"maxRestarts", "restartStrategy", "rules"}
    assert fp["restartStrategy"] in {"Recreate", "BlockingRecreate"}
    assert isinstance(fp["maxRestarts"], int) and fp["maxRestarts"] >= 0
    actions: dict[str, str] = {}
    for rule in fp["rules"]:
        allowed = {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns"}
        assert set(rule) <= allowed | {"targetReplicatedJobs"}
        assert JOBSET_RULE_NAME.fullmatch(rule["name"]), rule["name"]
        assert rule["action"] in JOBSET_ACTIONS
        assert set(rule["onJobFailureReasons"]) <= JOBSET_FAILURE_REASONS
        for reason in rule["onJobFailureReasons"]:
            actions.setdefault(reason, rule["action"])  # the first matching rule wins
    # A Job failed by a FailJob rule (exit 2 or 72) fails the JobSet: restarting repeats it.
    assert actions["PodFailurePolicy"] == "FailJobSet"
    assert actions["MaxFailedIndexesExceeded"] in {"RestartJobSet", "FailJobSet"}


# --- monitor daemon ----------------------------------------------------------------------------


def test_monitor_daemonset_runs_the_probe_daemon_with_the_monitor_credential() -> None:
    ds = find("DaemonSet", "marduk-monitor")
    spec = pod_spec(ds)
    c = container(ds, "monitor")
    assert c["command"] == ["marduk", "monitor", "run"]
    e = env(c)
    assert e["MARDUK_NKEY"]["value"] == "/auth/monitor.nk"
    assert e["MARDUK_ADDR"]["value"].split(",") == NATS_NODES
    assert secret_at(ds, c, "/auth") == "marduk-monitor"
    assert spec["hostPID"] is False
    assert not spec.get("hostNetwork", False)
    # It watches the node's accelerators without taking any from the trainers.
    resources = c["resources"]
    for section in ("requests", "limits"):
        assert not any(k.startswith(("nvidia.com/", "google.com/")) for k in resources[section])
    assert {t["key"] for t in spec["tolerations"]} >= {"nvidia.com/gpu"}


# --- NATS Helm values ----------------------------------------------------------------------------


def test_nats_values_are_a_three_node_jetstream_cluster_with_marduk_auth() -> None:
    values = yaml.safe_load(HELM_VALUES.read_text())
    config = values["config"]
    assert config["cluster"]["enabled"] is True
    assert config["cluster"]["replicas"] == 3
    js = config["jetstream"]
    assert js["enabled"] is True
    assert js["fileStore"]["enabled"] is True
    assert js["fileStore"]["pvc"]["enabled"] is True
    # The include (relative to the chart's /etc/nats-config/nats.conf) lands on the Secret the
    # container patch mounts, and names the file `marduk auth init` writes.
    (include,) = [v for k, v in config["merge"].items() if k.endswith("$include")]
    included = posixpath.normpath(posixpath.join("/etc/nats-config", include))
    (mount_patch,) = values["container"]["patch"]
    assert (mount_patch["op"], mount_patch["path"]) == ("add", "/volumeMounts/-")
    mount = mount_patch["value"]
    assert posixpath.dirname(included) == mount["mountPath"]
    assert posixpath.basename(included) == auth.CONFIG_FILE
    (volume_patch,) = values["podTemplate"]["patch"]
    assert (volume_patch["op"], volume_patch["path"]) == ("add", "/spec/volumes/-")
    volume = volume_patch["value"]
    assert volume["name"] == mount["name"]
    assert volume["secret"]["secretName"] == "marduk-nats-auth"
    # The patched-in mount and volume are valid core/v1 objects.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "nats-0"},
        "spec": {
            "containers": [{"name": "nats", "image": "nats", "volumeMounts": [mount]}],
            "volumes": [volume],
        },
    }
    kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=True)
    # The URLs every Marduk process uses are this release's pods.
    assert len(NATS_NODES) == config["cluster"]["replicas"]


# --- secrets -----------------------------------------------------------------------------------


def test_make_secrets_creates_every_secret_the_manifests_mount(tmp_path: Path) -> None:
    script = (DEPLOY / "make-secrets.sh").read_text()
    created: dict[str, set[str]] = {}
    for m in re.finditer(r"^secret (\S+)((?:.*\\\n)*.*)$", script, flags=re.M):
        created[m.group(1)] = set(re.findall(r"--from-file=([\w.-]+)=", m.group(2)))
    mounted: dict[str, set[str]] = {}
    for _, doc in documents():
        if "template" not in doc.get("spec", {}) and doc["kind"] != "JobSet":
            continue
        workloads = (
            [as_job(r["template"], r["name"]) for r in doc["spec"]["replicatedJobs"]]
            if doc["kind"] == "JobSet"
            else [doc]
        )
        for w in workloads:
            for c in pod_spec(w)["containers"]:
                e = env(c)
                files = {
                    Path(e[v]["value"]).name
                    for v in ("MARDUK_NKEY", "MARDUK_CONTROLLER_KEY")
                    if v in e and "value" in e[v]
                }
                mounted.setdefault(secret_at(w, c, "/auth"), set()).update(files)
    mounted.setdefault("marduk-nats-auth", set()).add(auth.CONFIG_FILE)
    for secret, files in mounted.items():
        assert secret in created, secret
        assert files <= created[secret], (secret, files)
    # What the script reads is what `marduk auth init` writes.
    auth.init(tmp_path / "auth")
    for files in created.values():
        for f in files:
            assert (tmp_path / "auth" / f).is_file(), f


def test_no_seed_or_password_in_deploy(tmp_path: Path) -> None:
    # The pattern finds a real seed (one `marduk auth init` writes).
    auth.init(tmp_path / "auth")
    assert SEED.search((tmp_path / "auth" / "agent.nk").read_text())
    assert URL_CREDENTIALS.search("nats://marduk:hunter2@nats-0:4222")
    for path in sorted(DEPLOY.iterdir()):
        text = path.read_text()
        assert not SEED.search(text), path.name
        assert not URL_CREDENTIALS.search(text), path.name
    trees = [d for _, d in documents()] + [yaml.safe_load(HELM_VALUES.read_text())]
    for tree in trees:
        assert tree.get("kind") != "Secret"  # make-secrets.sh creates them from the files
        for key, value in walk(tree):
            if key is not None and re.search(r"password|token|seed", key, re.I):
                pytest.fail(f"{key}: {value!r} in a manifest")
            if key == "name" and value in {"MARDUK_PASSWORD", "MARDUK_TOKEN", "MARDUK_USER"}:
                pytest.fail(f"{value} set in a manifest")
