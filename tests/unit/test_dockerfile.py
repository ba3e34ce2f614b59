"""Lint the Dockerfile, docker-compose.yml, prometheus.yml and example configs (no Docker here).

Checks what ops.md §7–8 promise: exec-form ENTRYPOINT/CMD/HEALTHCHECK, tini as PID 1, a non-root
user, no secrets, the four ports, COPY sources that exist and survive .dockerignore, and an
entry command that resolves to the console script pyproject.toml declares.
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


def test_exposes_the_four_ports(runtime):
    ports = set(" ".join(r for i, r in runtime if i == "EXPOSE").split())
    assert {p if "/" in p else f"{p}/tcp" for p in ports} == {"31337/tcp", "31337/udp", "50051/tcp", "9400/tcp"}


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
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


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


def test_compose_node_services(compose):
    nodes = node_services(compose)
    assert {"bootstrap", "noloco"} <= set(nodes) and "prometheus" in compose["services"]
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
    assert nodes["noloco"]["depends_on"]["bootstrap"]["condition"] == "service_healthy"


def test_compose_images_are_pinned(compose):
    for name, svc in compose["services"].items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"


def test_compose_env_and_configs_validate():
    config = pytest.importorskip("node.config")
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, svc in node_services(compose).items():
        env = {k: _interpolate(str(v)) for k, v in svc.get("environment", {}).items()}
        command = svc["command"]
        overrides = {"role": command[command.index("--role") + 1]} if "--role" in command else {}
        if command[0] == "bootstrap":
            overrides["role"] = "bootstrap"
        cfg = config.load_config(_config_path(command), overrides=overrides, environ=env)
        assert cfg.role == (overrides.get("role") or cfg.role)
        assert cfg.dht.host_port == 31337 and cfg.ops.port == 9400 and cfg.grpc.port == 50051
    for toml in sorted((DEPLOY / "configs").glob("*.toml")):
        cfg = config.load_config(toml, environ={})
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
    names, ports = set(), set()
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            names |= set(sd["names"])
            ports.add(sd["port"])
            assert sd.get("type", "A") == "A"
    assert set(node_services(compose)) <= names <= set(compose["services"])
    assert ports == {9400}
    mounts = [v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"]]
    assert "./prometheus/prometheus.yml" in mounts


def test_compose_healthcheck_matches_dockerfile(runtime, compose):
    _, rest = split_flags(one(runtime, "HEALTHCHECK"))
    for svc in node_services(compose).values():
        assert svc["healthcheck"]["test"][1:] == exec_form(rest[4:], "HEALTHCHECK CMD")


def test_parser_sanity():
    parsed = parse_dockerfile('FROM x AS b\n# c\nRUN a \\\n  # inner\n  && b\nCMD ["x"]\n')
    assert parsed == [("FROM", "x AS b"), ("RUN", "a  && b"), ("CMD", '["x"]')]


# ---- CUDA build (issue 9): the TORCH_INDEX build argument ---------------------------------
CUDA_INDEX = re.compile(r"--build-arg TORCH_INDEX=(https://download\.pytorch\.org/whl/cu\d{3})\b")


def _torch_install(runtime) -> str:
    runs = [rest for i, rest in runtime if i == "RUN" and '"torch' in rest]
    assert len(runs) == 1, f"the runtime stage needs exactly one torch install RUN, found {runs}"
    return runs[0]


def test_cuda_build_is_documented_and_selects_the_torch_index(runtime):
    text = (REPO / "Dockerfile").read_text()
    documented = CUDA_INDEX.findall(text)
    assert documented, "the Dockerfile header must show the CUDA build (--build-arg TORCH_INDEX=.../cuNNN)"
    args = dict(rest.partition("=")[::2] for i, rest in runtime if i == "ARG")
    assert args.get("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu", "CPU must stay the default"
    cmd = _torch_install(runtime)
    assert '--index-url "${TORCH_INDEX}"' in cmd
    wheel_install = next(rest for i, rest in runtime if i == "RUN" and "/tmp/wheels/" in rest)
    assert '--extra-index-url "${TORCH_INDEX}"' in wheel_install, \
        "the wheel install must see the same index, or pip may swap the CUDA torch for a CPU one"
    assert "--gpus all" in text and "device.device" in text


def test_cuda_install_command_resolves_outside_docker(runtime, tmp_path):
    """Expand the Dockerfile's torch install with the documented CUDA index, check its argv, then
    resolve its requirement with pip against this machine's local wheels (no network, no GPU):
    the range must admit a torch wheel for the image's python (3.11, x86_64)."""
    import shlex
    import subprocess
    import sys

    index = CUDA_INDEX.findall((REPO / "Dockerfile").read_text())[0]
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
