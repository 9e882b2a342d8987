"""The deployment files agree with each other and with kvbank, and `kvbank cluster up` builds
vllm-router's command right. Nothing starts.

deploy/compose.yaml goes through `docker compose config` where docker has compose; both it
and deploy/k8s/*.yaml are read with PyYAML and checked for the facts that break a deployment
silently: data volumes where the stacks keep their data, probes on ports the containers
expose, the router naming every stack (pod DNS names, service names) with the ports the
stacks expose, one block size on both sides, the model id the shims serve, event sockets that
bind on the container's interfaces while the router connects to a name.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")

from kvbank.apps.shim.server import DEFAULT_MODEL_NAME
from kvbank.deploy import cluster

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "deploy" / "compose.yaml"
K8S = ROOT / "deploy" / "k8s"
ROUTER_FLAGS_WITH_LISTS = {"--worker-urls"}  # nargs='*' in vllm-router


# -- reading commands -----------------------------------------------------------------------


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value given to `flag` (`--f v`, `--f=v`, and for --worker-urls all values up to
    the next flag), in order."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = str(argv[i])
        if a == flag:
            if flag in ROUTER_FLAGS_WITH_LISTS:
                i += 1
                while i < len(argv) and not str(argv[i]).startswith("--"):
                    out.append(str(argv[i]))
                    i += 1
                continue
            out.append(str(argv[i + 1]))
            i += 2
            continue
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        i += 1
    return out


def one(argv: list[str], flag: str, where: str) -> str:
    values = flag_values(argv, flag)
    assert len(values) == 1, f"{where}: expected one {flag}, found {values}"
    return values[0]


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def endpoint_host(endpoint: str) -> str:
    return endpoint.split("://", 1)[1].rsplit(":", 1)[0]


def sources(argv: list[str], flag: str) -> dict[str, str]:
    """`--kv-event-source URL=tcp://...` (repeated) as {URL: endpoint}."""
    out = {}
    for v in flag_values(argv, flag):
        url, _, endpoint = v.partition("=")
        assert url not in out, f"{flag}: {url} given twice"
        out[url] = endpoint
    return out


def command_of(container: dict) -> list[str]:
    return [str(x) for x in (container.get("command") or []) + (container.get("args") or [])]


def is_stack(argv: list[str]) -> bool:
    return argv[:2] == ["kvbank", "up"]


def is_router(argv: list[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "vllm-router"


@pytest.fixture(scope="module")
def k8s_docs() -> list[tuple[str, dict]]:
    files = sorted(K8S.glob("*.yaml"))
    assert files, f"no manifests in {K8S}"
    docs = []
    for f in files:
        for d in yaml.safe_load_all(f.read_text()):
            if d is not None:
                docs.append((f.name, d))
    return docs


def by_kind(docs, kind: str) -> list[tuple[str, dict]]:
    return [(f, d) for f, d in docs if d.get("kind") == kind]


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def container_ports(c: dict) -> set:
    ports = set()
    for p in c.get("ports") or []:
        ports.add(p["containerPort"])
        if "name" in p:
            ports.add(p["name"])
    return ports


def named_port(c: dict, port) -> int:
    for p in c.get("ports") or []:
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    raise AssertionError(f"container {c['name']}: no port {port!r}")


def labels_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- what both the compose file and the manifests must agree on ------------------------------


def check_router_against_stacks(where: str, router: list[str], stacks: dict[str, dict]):
    """`stacks`: {host name the router uses: {"argv": the stack's command, "ports": the
    ports its container exposes}}."""
    problems = []
    urls = flag_values(router, "--worker-urls")
    events = sources(router, "--kv-event-source")
    replays = sources(router, "--kv-event-replay-source")
    expected_urls = []
    for host, stack in stacks.items():
        argv, exposed = stack["argv"], stack["ports"]
        shim_port = int(one(argv, "--shim-port", f"{where}: stack {host}"))
        url = f"http://{host}:{shim_port}"
        expected_urls.append(url)
        if shim_port not in exposed:
            problems.append(f"stack {host}: the shim's port {shim_port} is not exposed")
        if one(argv, "--shim-host", f"{where}: stack {host}") in ("127.0.0.1", "localhost"):
            problems.append(f"stack {host}: the shim listens on loopback; the router cannot "
                            f"reach it")
        for flag, table, src_flag in (("--kv-events-endpoint", events, "--kv-event-source"),
                                      ("--kv-events-replay-endpoint", replays,
                                       "--kv-event-replay-source")):
            bind = one(argv, flag, f"{where}: stack {host}")
            if endpoint_host(bind) not in ("*", "0.0.0.0"):
                problems.append(f"stack {host}: {flag} {bind} does not bind on the "
                                f"container's interfaces (tcp://*:PORT)")
            if endpoint_port(bind) not in exposed:
                problems.append(f"stack {host}: {flag} port {endpoint_port(bind)} not exposed")
            want = f"tcp://{host}:{endpoint_port(bind)}"
            if table.get(url) != want:
                problems.append(f"router {src_flag} for {url}: {table.get(url)!r}, "
                                f"expected {want!r}")
        bs = one(argv, "--kv-events-block-size", f"{where}: stack {host}")
        router_bs = one(router, "--kv-event-block-size", f"{where}: router")
        if bs != router_bs:
            problems.append(f"stack {host}: --kv-events-block-size {bs} but the router's "
                            f"--kv-event-block-size is {router_bs}")
    if sorted(urls) != sorted(expected_urls):
        problems.append(f"router --worker-urls {urls}, expected {expected_urls}")
    for table, flag in ((events, "--kv-event-source"), (replays, "--kv-event-replay-source")):
        extra = set(table) - set(expected_urls)
        if extra:
            problems.append(f"router {flag} for unknown workers {sorted(extra)}")
        for endpoint in table.values():
            if endpoint_host(endpoint) in ("*", "0.0.0.0", "127.0.0.1", "localhost"):
                problems.append(f"router {flag} {endpoint}: the router must connect to the "
                                f"stack's name")
    if len(set(replays.values())) != len(replays):
        problems.append(f"router --kv-event-replay-source endpoints repeat: {replays}")
    if one(router, "--policy", f"{where}: router") != "kv_aware":
        problems.append("router --policy is not kv_aware")
    model = one(router, "--kv-event-model", f"{where}: router")
    if model != DEFAULT_MODEL_NAME:
        problems.append(f"router --kv-event-model {model!r}, but the shims serve "
                        f"{DEFAULT_MODEL_NAME!r}")
    assert not problems, f"{where}:\n  " + "\n  ".join(problems)


# -- docker compose -------------------------------------------------------------------------


def _docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    return r.returncode == 0


@pytest.mark.skipif(not _docker_compose(), reason="no `docker compose` here; PyYAML checks run")
def test_compose_config_is_valid():
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{COMPOSE}: docker compose config says:\n{r.stderr}"


def test_compose_stacks_and_router_agree():
    doc = yaml.safe_load(COMPOSE.read_text())  # resolves the `<<: *stack` merges
    where = "deploy/compose.yaml"
    services = doc["services"]
    problems = []
    stacks, routers = {}, []
    for name, svc in services.items():
        argv = [str(x) for x in svc.get("command") or []]
        if "healthcheck" not in svc or not svc["healthcheck"].get("test"):
            problems.append(f"service {name}: no healthcheck")
        if is_stack(argv):
            data_dir = one(argv, "--data-dir", f"{where}: {name}")
            mounts = [str(v).split(":") for v in svc.get("volumes") or []]
            if not any(len(m) >= 2 and m[1] == data_dir for m in mounts):
                problems.append(f"service {name}: no volume mounted at its --data-dir "
                                f"{data_dir}")
            for m in mounts:
                if m[0] not in (doc.get("volumes") or {}) and not m[0].startswith(("/", ".")):
                    problems.append(f"service {name}: volume {m[0]} is not declared")
            shim_port = one(argv, "--shim-port", f"{where}: {name}")
            check = " ".join(str(x) for x in svc["healthcheck"]["test"])
            if f":{shim_port}/health" not in check:
                problems.append(f"service {name}: its healthcheck does not ask the shim's "
                                f"/health on {shim_port}: {check}")
            if svc.get("ports"):
                problems.append(f"service {name}: publishes {svc['ports']}; the stacks stay "
                                f"on the private network, clients use the router")
            stacks[name] = {"argv": argv,
                            "ports": {int(str(p).split("/")[0]) for p in svc.get("expose", [])}}
        elif is_router(argv):
            routers.append((name, svc, argv))
    assert not problems, f"{where}:\n  " + "\n  ".join(problems)
    assert stacks, f"{where}: no service runs `kvbank up`"
    assert len(routers) == 1, f"{where}: expected one vllm-router service, found {routers}"
    name, svc, argv = routers[0]
    depends = svc.get("depends_on") or {}
    for s in stacks:
        cond = depends.get(s, {}).get("condition") if isinstance(depends, dict) else None
        assert cond == "service_healthy", (f"{where}: router does not wait for {s} to be "
                                           f"healthy (depends_on: {depends})")
    internal = [n for n, net in (doc.get("networks") or {}).items() if (net or {}).get("internal")]
    for s in stacks:
        nets = services[s].get("networks") or ["default"]
        assert set(nets) <= set(internal), (f"{where}: stack {s} is on {nets}; its event "
                                            f"ports belong on an internal network {internal}")
    check_router_against_stacks(where, argv, stacks)


# -- Kubernetes -----------------------------------------------------------------------------


def test_k8s_documents_are_well_formed(k8s_docs):
    problems = []
    for f, d in k8s_docs:
        for key in ("apiVersion", "kind"):
            if not d.get(key):
                problems.append(f"{f}: a document without {key}")
        if not (d.get("metadata") or {}).get("name"):
            problems.append(f"{f}: {d.get('kind')} without metadata.name")
    assert not problems, "\n".join(problems)
    kinds = {d["kind"] for _, d in k8s_docs}
    assert {"StatefulSet", "Service", "Deployment"} <= kinds, f"deploy/k8s has only {kinds}"


def test_k8s_probes_use_exposed_ports(k8s_docs):
    problems = []
    for f, d in k8s_docs:
        if d["kind"] not in ("StatefulSet", "Deployment"):
            continue
        for c in containers(d):
            exposed = container_ports(c)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if p is None:
                    if probe != "startupProbe":
                        problems.append(f"{f}: {d['kind']} {d['metadata']['name']}/{c['name']}: "
                                        f"no {probe}")
                    continue
                action = p.get("httpGet") or p.get("tcpSocket") or p.get("grpc")
                port = (action or {}).get("port")
                if port not in exposed:
                    problems.append(f"{f}: {d['metadata']['name']}/{c['name']} {probe} port "
                                    f"{port!r} is not one of its ports {sorted(map(str, exposed))}")
            if not (c.get("resources") or {}).get("requests"):
                problems.append(f"{f}: {d['metadata']['name']}/{c['name']}: no resource requests")
    assert not problems, "\n".join(problems)


def test_k8s_statefulset_keeps_its_data_on_claims(k8s_docs):
    (f, sts), = by_kind(k8s_docs, "StatefulSet")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates") or []}
    assert claims, f"{f}: StatefulSet {sts['metadata']['name']} has no volumeClaimTemplates"
    for c in containers(sts):
        argv = command_of(c)
        if not is_stack(argv):
            continue
        data_dir = one(argv, "--data-dir", f"{f}: {c['name']}")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
        assert mounts.get(data_dir) in claims, (
            f"{f}: container {c['name']} keeps its data in {data_dir}, but mounts there "
            f"{mounts.get(data_dir)!r}, not one of the claim templates {sorted(claims)}")


def test_k8s_router_names_every_pod(k8s_docs):
    (f, sts), = by_kind(k8s_docs, "StatefulSet")
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    headless = [d for _, d in by_kind(k8s_docs, "Service")
                if d["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert headless, f"{f}: no Service {sts['spec']['serviceName']!r} (the StatefulSet's " \
                     f"serviceName) in deploy/k8s"
    svc = headless[0]
    assert svc["spec"].get("clusterIP") == "None", f"Service {svc['metadata']['name']}: not " \
                                                   f"headless (clusterIP: None)"
    assert labels_match(svc["spec"]["selector"], pod_labels), \
        f"Service {svc['metadata']['name']} does not select the StatefulSet's pods"
    (stack_c,) = [c for c in containers(sts) if is_stack(command_of(c))]
    exposed = {p["containerPort"] for p in stack_c["ports"]}
    stacks = {f"{name}-{i}.{svc['metadata']['name']}": {"argv": command_of(stack_c),
                                                         "ports": exposed}
              for i in range(replicas)}
    routers = [(rf, d, c) for rf, d in by_kind(k8s_docs, "Deployment") for c in containers(d)
               if is_router(command_of(c))]
    assert len(routers) == 1, f"deploy/k8s: expected one vllm-router container, found " \
                              f"{len(routers)}"
    rf, dep, router_c = routers[0]
    check_router_against_stacks(f"deploy/k8s/{rf}", command_of(router_c), stacks)
    # The router's own Service reaches its HTTP port.
    router_labels = dep["spec"]["template"]["metadata"]["labels"]
    fronts = [d for _, d in by_kind(k8s_docs, "Service")
              if labels_match(d["spec"].get("selector") or {}, router_labels)]
    assert fronts, "deploy/k8s: no Service selects the router's pods"
    http_port = int(one(command_of(router_c), "--port", "router"))
    for p in fronts[0]["spec"]["ports"]:
        assert named_port(router_c, p.get("targetPort", p["port"])) == http_port, \
            f"Service {fronts[0]['metadata']['name']} port {p} does not reach the router's " \
            f"--port {http_port}"


def test_k8s_event_ports_are_fenced(k8s_docs):
    (f, sts), = by_kind(k8s_docs, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    argv = command_of(containers(sts)[0])
    event_ports = {endpoint_port(one(argv, flag, f)) for flag in
                   ("--kv-events-endpoint", "--kv-events-replay-endpoint")}
    policies = [d for _, d in by_kind(k8s_docs, "NetworkPolicy")
                if labels_match(d["spec"]["podSelector"].get("matchLabels") or {}, pod_labels)]
    assert policies, "deploy/k8s: no NetworkPolicy covers the kvbank pods (KV events carry " \
                     "no tenant)"
    allowed = {p["port"] for rule in policies[0]["spec"].get("ingress") or []
               for p in rule.get("ports") or []}
    assert event_ports <= allowed, f"NetworkPolicy allows {allowed}, not the event ports " \
                                   f"{event_ports}"
    for rule in policies[0]["spec"]["ingress"]:
        assert rule.get("from"), "NetworkPolicy: an ingress rule open to every pod"


# -- `kvbank cluster up`: the commands it builds -----------------------------------------------


def _plan(n=3, policy="kv_aware"):
    return cluster.plan_cluster(n, Path("/tmp/c"), port=30000, policy=policy,
                                ports=list(range(41000, 41000 + 4 * n + 1)),
                                model_name="tiny")


def test_cluster_router_argv_for_three_stacks():
    plan = _plan(3)
    argv = cluster.router_argv("/x/vllm-router", plan)
    assert argv[0] == "/x/vllm-router"
    urls = [f"http://127.0.0.1:{41000 + 4 * i + 1}" for i in range(3)]
    assert flag_values(argv, "--worker-urls") == urls
    assert sources(argv, "--kv-event-source") == {
        u: f"tcp://127.0.0.1:{41000 + 4 * i + 2}" for i, u in enumerate(urls)}
    assert sources(argv, "--kv-event-replay-source") == {
        u: f"tcp://127.0.0.1:{41000 + 4 * i + 3}" for i, u in enumerate(urls)}
    assert one(argv, "--kv-event-block-size", "argv") == "16"
    assert one(argv, "--kv-event-model", "argv") == "tiny"
    assert one(argv, "--policy", "argv") == "kv_aware"
    assert (one(argv, "--host", "argv"), one(argv, "--port", "argv")) == ("127.0.0.1", "30000")
    assert one(argv, "--prometheus-port", "argv") == "41012"
    assert plan.base_url == "http://127.0.0.1:30000/v1"
    # each stack binds what the router reads, with the same block size
    for s, url in zip(plan.stacks, urls):
        flags = cluster.stack_flags(s, plan.block_size)
        assert s.shim_url == url and s.data_dir == Path(f"/tmp/c/stack-{s.index}")
        assert one(flags, "--kv-events-endpoint", "stack") == sources(
            argv, "--kv-event-source")[url]
        assert one(flags, "--kv-events-replay-endpoint", "stack") == sources(
            argv, "--kv-event-replay-source")[url]
        assert one(flags, "--kv-events-block-size", "stack") == "16"


def test_cluster_round_robin_has_no_event_sources():
    argv = cluster.router_argv("vllm-router", _plan(2, "round_robin"))
    assert one(argv, "--policy", "argv") == "round_robin"
    assert not any(a.startswith("--kv-event") for a in argv)
    assert len(flag_values(argv, "--worker-urls")) == 2


def test_cluster_free_ports_are_distinct():
    plan = cluster.plan_cluster(4, Path("/tmp/c"), metrics_port=9500)
    ports = [p for s in plan.stacks for p in (s.port, s.shim_port, s.events_port,
                                              s.replay_port)] + [plan.port,
                                                                 plan.prometheus_port]
    assert len(set(ports)) == len(ports)
    assert [s.metrics_port for s in plan.stacks] == [9500, 9503, 9506, 9509]


def test_ports_picked_but_not_yet_bound_are_not_handed_out_again(monkeypatch):
    """A test picks ports for its own flags, then starts a stack that picks the router's:
    neither is bound yet, so only the picker's memory keeps them apart."""
    from kvbank.deploy import local

    monkeypatch.setenv("KVBANK_PORT_RANGE", "41000-41008")
    monkeypatch.setattr(local, "_handed_out", set())
    first, second = local.free_ports(4), local.free_ports(4)
    assert not set(first) & set(second)


def test_cluster_up_dry_run_passes_flags_to_every_stack(capsys):
    from kvbank.apps.cli import main

    assert main(["cluster", "up", "--dry-run", "--stacks", "3", "--model", "/m",
                 "--memory-budget", "+1000", "--kv-events-block-size", "32",
                 "--router-arg=--retry-max-retries=2", "--data-dir", "/tmp/c"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4, lines
    *stack_lines, router_line = [line.split() for line in lines]
    for i, argv in enumerate(stack_lines, 1):
        assert argv[:2] == ["kvbank", "up"]
        assert one(argv, "--memory-budget", "stack") == "+1000"
        assert one(argv, "--kv-events-block-size", "stack") == "32"
        assert one(argv, "--data-dir", "stack") == f"/tmp/c/stack-{i}"
        assert one(argv, "--model", "stack") == "/m"
        one(argv, "--kv-events-endpoint", "stack")  # exactly once: the cluster's
    assert one(router_line, "--kv-event-block-size", "router") == "32"
    assert router_line[-1] == "--retry-max-retries=2"
    assert len(flag_values(router_line, "--worker-urls")) == 3


def test_workers_on_one_machine_share_its_cores_for_blas(monkeypatch):
    """Three stacks on two cores: one OpenBLAS thread each (each would start two); two on
    eight: four each; an operator's own OPENBLAS_NUM_THREADS is left as it is."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert cluster.blas_threads(3, cores=2) == {"OPENBLAS_NUM_THREADS": "1"}
    assert cluster.blas_threads(2, cores=8) == {"OPENBLAS_NUM_THREADS": "4"}
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert cluster.blas_threads(3, cores=2) == {}


def test_cluster_missing_router_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cluster.ClusterError, match="pip install vllm-router"):
        cluster.find_router_bin()
    with pytest.raises(cluster.ClusterError, match="pip install vllm-router"):
        cluster.find_router_bin("no-such-router")


def test_stack_urls_parse():
    # the router's worker URL is the bare origin, the same string in every flag
    s = _plan(1).stacks[0]
    parts = urlsplit(s.shim_url)
    assert (parts.scheme, parts.path) == ("http", "") and parts.port == s.shim_port


def test_cluster_stack_serves_through_the_router(tiny_model, cache_dir, tmp_path):
    """Two real stacks behind the real vllm-router: one chat completion through its URL; the
    stop leaves no process behind."""
    try:
        cluster.find_router_bin()
    except cluster.ClusterError as e:
        pytest.skip(str(e))
    import httpx

    c = cluster.ClusterStack.start(tiny_model, tmp_path / "cluster", stacks=2,
                                   env={"KVBANK_CACHE_DIR": str(cache_dir)}, timeout_s=180)
    try:
        r = httpx.post(f"{c.base_url}/chat/completions", timeout=60, json={
            "model": "kvbank", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert c.dead() == []
    finally:
        c.stop()
    assert c.router.returncode is not None
    assert all(s.proc.returncode is not None for s in c.stacks)
    for s in c.stacks:  # each supervisor stopped its own processes
        assert not list(s.layout.run_dir.glob("*.pid")), f"{s.log}: pid files left"


# -- the MLX backend an install picks ---------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA wheels are Linux-only")
@pytest.mark.parametrize("smi_says, expected", [
    (None, "cpu"),  # no NVIDIA driver
    ("| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |", "cuda12"),
    ("| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: 13.0     |", "cuda13"),
    ("| NVIDIA-SMI 470.82.01   Driver Version: 470.82.01   CUDA Version: 11.4     |", "cpu"),
])
def test_install_picks_mlx_backend_by_the_gpu_driver(tmp_path, smi_says, expected):
    """`make install` installs kvbank with the extra deploy/mlx-backend prints: MLX's CUDA
    wheels where the NVIDIA driver supports them, the CPU wheel elsewhere. The driver is
    outside the project: a fake `nvidia-smi` stands in for it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi_says is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\necho '{smi_says}'\n")
        fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = subprocess.run([str(ROOT / "deploy" / "mlx-backend")], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == expected
    chosen = subprocess.run([str(ROOT / "deploy" / "mlx-backend")], capture_output=True,
                            text=True, check=True, env={**env, "KVBANK_MLX_BACKEND": "cuda12"})
    assert chosen.stdout.strip() == "cuda12"
    # Every backend it can print is an extra of kvbank's pyproject.
    import tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert expected in extras and "metal" in extras
