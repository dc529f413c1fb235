"""Checks of the deployment files under deploy/ (systemd unit, flagfile, Kubernetes)."""

import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "tpud.service"
SYSUSERS = DEPLOY / "systemd" / "tpud-sysusers.conf"
FLAGFILE = DEPLOY / "config" / "tpud.flags"
K8S = DEPLOY / "kubernetes" / "tpud-daemonset.yaml"
EXAMPLE_POD = DEPLOY / "kubernetes" / "example-pod.yaml"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"

# Every flag tpud documents; the example flagfile must show each exactly once.
DOCUMENTED_FLAGS = {
    "allocation_state",
    "compile_cache_dir",
    "compile_cache_bytes",
    "op_timeout",
    "max_connections_per_uid",
    "max_sessions_per_uid",
    "handshake_timeout",
    "topology",
    "socket",
    "admin_socket",
    "hbm_bytes",
    "session_quota_bytes",
    "log_level",
    "socket_group",
    "metrics_address",
    "executor_nice",
    "small_pool_bytes",
}
FLAG_LINE = re.compile(r"^--([a-z_][a-z0-9_]*)=(\S*)$")
TPUCTL_HEALTH = ["/usr/bin/tpuctl", "--admin_socket=/run/tpud/admin.sock", "health"]


# --- helpers -----------------------------------------------------------------


def parse_flagfile(text):
    """Parses an abseil flagfile strictly; returns [(name, value, comment_before)]."""
    flags = []
    previous_was_comment = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() == "":
            previous_was_comment = False
            continue
        if line.startswith("#"):
            previous_was_comment = True
            continue
        match = FLAG_LINE.match(line)
        assert match, f"line {number} is neither --name=value nor a comment: {line!r}"
        flags.append((match.group(1), match.group(2), previous_was_comment))
        previous_was_comment = False
    return flags


def flag_dict(text):
    flags = parse_flagfile(text)
    names = [name for name, _, _ in flags]
    assert len(names) == len(set(names)), f"duplicate flags: {names}"
    return {name: value for name, value, _ in flags}


def parse_unit(text):
    """Parses a systemd unit into {section: {key: [values]}} (keys may repeat)."""
    sections = {}
    current = None
    pending = ""
    for line in text.splitlines():
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.endswith("\\"):
            pending = stripped[:-1].rstrip()
            continue
        if stripped.startswith("["):
            assert stripped.endswith("]"), f"bad section header {stripped!r}"
            current = stripped[1:-1]
            assert current not in sections, f"section [{current}] repeated"
            sections[current] = {}
            continue
        assert current is not None, f"key outside a section: {stripped!r}"
        key, sep, value = stripped.partition("=")
        assert sep, f"not a key=value line: {stripped!r}"
        sections[current].setdefault(key.strip(), []).append(value.strip())
    assert not pending, "unit ends with a line continuation"
    return sections


def one(section, key):
    values = section.get(key)
    assert values, f"{key}= missing"
    assert len(values) == 1, f"{key}= given {len(values)} times"
    return values[0]


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def docs():
    loaded = [d for d in yaml.safe_load_all(K8S.read_text()) if d is not None]
    assert loaded, "no YAML documents"
    return loaded


def by_kind(docs, kind):
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def daemonset(docs):
    return by_kind(docs, "DaemonSet")


@pytest.fixture(scope="module")
def configmap(docs):
    return by_kind(docs, "ConfigMap")


def containers_by_name(daemonset):
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    by_name = {c["name"]: c for c in containers}
    assert len(by_name) == len(containers), "container names repeat"
    return by_name


@pytest.fixture(scope="module")
def container(daemonset):
    return containers_by_name(daemonset)["tpud"]


@pytest.fixture(scope="module")
def plugin_container(daemonset):
    return containers_by_name(daemonset)["device-plugin"]


# --- flagfile ----------------------------------------------------------------


def test_flagfile_lines_are_flags_or_comments():
    flags = parse_flagfile(FLAGFILE.read_text())
    assert flags, "flagfile has no flags"
    for name, _, commented in flags:
        assert name in DOCUMENTED_FLAGS, f"undocumented flag --{name}"
        assert commented, f"--{name} has no comment line before it"


def test_flagfile_shows_every_flag_once_with_sane_values():
    flags = flag_dict(FLAGFILE.read_text())
    assert set(flags) == DOCUMENTED_FLAGS
    assert flags["socket"] == "/run/tpud/tpud.sock"
    assert flags["admin_socket"] == "/run/tpud/admin.sock"
    assert re.fullmatch(r"v(5e|5p|6e|7x)-\d+", flags["topology"]), flags["topology"]
    assert flags["log_level"] in {"trace", "debug", "info", "warn", "error"}
    assert flags["hbm_bytes"].isdigit()
    assert flags["session_quota_bytes"].isdigit()
    assert flags["socket_group"] == "tpu"
    assert re.fullmatch(r"(127\.0\.0\.1|localhost):\d+|/\S+", flags["metrics_address"])


def test_flagfile_parser_rejects_bad_lines():
    with pytest.raises(AssertionError):
        parse_flagfile("--topology v6e-4\n")
    with pytest.raises(AssertionError):
        parse_flagfile("--log_level=info \n")  # trailing space would join the value
    with pytest.raises(AssertionError):
        parse_flagfile("  # indented comment is fine for abseil but not our style\n")


def test_sysusers_creates_the_socket_group():
    flags = flag_dict(FLAGFILE.read_text())
    entries = [
        line.split()
        for line in SYSUSERS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ["g", flags["socket_group"], "-"] in entries


# --- systemd unit ------------------------------------------------------------


def test_unit_sections(unit):
    assert set(unit) == {"Unit", "Service", "Install"}
    assert one(unit["Unit"], "Description")
    assert "multi-user.target" in one(unit["Install"], "WantedBy").split()


def test_unit_service_basics(unit):
    service = unit["Service"]
    assert one(service, "Type") == "notify"
    assert one(service, "ExecStart") == "/usr/bin/tpud --flagfile=/etc/tpud/tpud.flags"
    assert "--flagfile=" in one(service, "ExecStart")
    assert one(service, "RuntimeDirectory") == "tpud"
    assert one(service, "RuntimeDirectoryMode") == "0755"
    assert one(service, "Restart") == "on-failure"
    assert one(service, "LimitMEMLOCK") == "infinity"
    assert one(service, "TimeoutStopSec")


def test_unit_hardening(unit):
    service = unit["Service"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateNetwork": "yes",
        "RestrictAddressFamilies": "AF_UNIX",
        "LockPersonality": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
        "DevicePolicy": "closed",
    }.items():
        assert one(service, key) == value, key
    # Hiding devices or other processes would break tpud.
    assert "PrivateDevices" not in service
    assert "ProtectProc" not in service
    allowed = [v.split() for v in service.get("DeviceAllow", [])]
    assert all(len(a) == 2 and set(a[1]) <= set("rwm") for a in allowed), allowed
    specs = {a[0] for a in allowed}
    assert any("accel" in s for s in specs), specs
    assert any("vfio" in s for s in specs), specs


def verify_unit_copy(unit_text, tmp_path):
    """Runs systemd-analyze verify on a copy whose ExecStart binary exists.

    Returns the lines of output that concern the unit (empty when clean).
    """
    true_bin = pathlib.Path("/bin/true")
    if not true_bin.exists():
        true_bin = pathlib.Path(shutil.which("true"))
    text, count = re.subn(
        r"^ExecStart=/usr/bin/tpud\b", f"ExecStart={true_bin}", unit_text, flags=re.M
    )
    assert count == 1, "ExecStart=/usr/bin/tpud not found in the unit"
    copy = tmp_path / "tpud.service"
    copy.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = (result.stdout + result.stderr).splitlines()
    problems = [line for line in output if "tpud.service" in line]
    if result.returncode != 0:
        problems.append(f"systemd-analyze verify exited {result.returncode}")
        problems.extend(output)
    return problems


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


@needs_systemd_analyze
def test_systemd_analyze_verify(tmp_path):
    problems = verify_unit_copy(UNIT.read_text(), tmp_path)
    assert not problems, "\n".join(problems)


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_mistakes(tmp_path):
    broken = UNIT.read_text().replace("Type=notify", "Type=notify\nTypo=notify")
    assert verify_unit_copy(broken, tmp_path), "a misspelled key went unnoticed"


# --- Kubernetes --------------------------------------------------------------


def test_manifest_kinds(docs):
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "ResourceQuota"]
    for doc in docs:
        assert doc.get("apiVersion"), doc["kind"]
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == "tpu-system"
        else:
            assert doc["metadata"]["namespace"] == "tpu-system", doc["kind"]


def test_daemonset_basics(daemonset, container):
    assert daemonset["apiVersion"] == "apps/v1"
    assert daemonset["metadata"]["name"] == "tpud"
    spec = daemonset["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    pod = spec["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["hostPID"] is True
    assert container["image"] == "tpud:latest"
    assert container["command"] == ["/usr/bin/tpud", "--flagfile=/etc/tpud/tpud.flags"]
    assert container["securityContext"]["privileged"] is True
    requests = container["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory")


def volume_for_mount(daemonset, container, mount_path):
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    assert len(mounts) == 1, f"{mount_path} not mounted exactly once"
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    return mounts[0], volumes[mounts[0]["name"]]


def test_daemonset_mounts_run_tpud_from_host(daemonset, container):
    mount, volume = volume_for_mount(daemonset, container, "/run/tpud")
    assert not mount.get("readOnly", False)
    assert volume["hostPath"] == {"path": "/run/tpud", "type": "DirectoryOrCreate"}


def test_daemonset_mounts_devices(daemonset, container):
    _, volume = volume_for_mount(daemonset, container, "/dev")
    assert volume["hostPath"]["path"] == "/dev"


def test_daemonset_mounts_flags_configmap(daemonset, container, configmap):
    mount, volume = volume_for_mount(daemonset, container, "/etc/tpud")
    assert mount.get("readOnly") is True
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert "tpud.flags" in configmap["data"]


def test_daemonset_schedules_on_tpu_nodes(daemonset):
    pod = daemonset["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert {
        "key": "cloud.google.com/gke-tpu-accelerator",
        "operator": "Exists",
    } in [e for t in terms for e in t["matchExpressions"]]
    assert any(
        t.get("key") == "google.com/tpu"
        and t.get("effect") == "NoSchedule"
        and t.get("operator") == "Exists"
        for t in pod["tolerations"]
    ), pod["tolerations"]


def test_daemonset_probes_call_tpuctl_health(container, configmap):
    admin_socket = flag_dict(configmap["data"]["tpud.flags"])["admin_socket"]
    assert TPUCTL_HEALTH[1] == f"--admin_socket={admin_socket}"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == TPUCTL_HEALTH, probe
    if "startupProbe" in container:
        assert container["startupProbe"]["exec"]["command"] == TPUCTL_HEALTH


def test_configmap_flags_match_flagfile(configmap):
    text = configmap["data"]["tpud.flags"]
    for name, _, commented in parse_flagfile(text):
        assert name in DOCUMENTED_FLAGS, f"undocumented flag --{name}"
        assert commented, f"--{name} has no comment line before it"
    in_configmap = flag_dict(text)
    in_flagfile = flag_dict(FLAGFILE.read_text())
    assert set(in_configmap) == set(in_flagfile)
    # The sockets must be where the hostPath and the probes expect them.
    for name in ("socket", "admin_socket"):
        assert in_configmap[name] == in_flagfile[name]
        assert in_configmap[name].startswith("/run/tpud/")


def test_tpud_accepts_the_example_flagfile(tmp_path):
    """The shipped flagfile parses in the real daemon (paths overridden for the test)."""
    import socket as socketlib
    import subprocess
    import time

    from conftest import bazel_bin

    sock = tmp_path / "tpud.sock"
    proc = subprocess.Popen(
        [bazel_bin("daemon/tpud"), f"--flagfile={FLAGFILE}", f"--socket={sock}",
         f"--admin_socket={tmp_path / 'admin.sock'}", "--socket_group=root",
         f"--metrics_address={tmp_path / 'metrics.sock'}",
         f"--allocation_state={tmp_path / 'state' / 'allocations.state'}",
         f"--compile_cache_dir={tmp_path / 'cache'}", "--hbm_bytes=1MiB"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not sock.exists():
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        s = socketlib.socket(socketlib.AF_UNIX)
        s.connect(str(sock))
        s.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


# --- the device plugin beside tpud --------------------------------------------


def plugin_flags(plugin_container):
    command = plugin_container["command"]
    assert command[0] == "/usr/bin/tpud-device-plugin"
    flags = {}
    for arg in command[1:]:
        match = FLAG_LINE.match(arg)
        assert match, f"not a --name=value flag: {arg!r}"
        flags[match.group(1)] = match.group(2)
    return flags


def test_daemonset_runs_the_device_plugin_beside_tpud(daemonset, plugin_container):
    assert set(containers_by_name(daemonset)) == {"tpud", "device-plugin"}
    assert plugin_container["image"] == "tpud:latest"
    security = plugin_container["securityContext"]
    assert not security.get("privileged", False)
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]


def test_device_plugin_mounts_the_kubelet_directory(daemonset, plugin_container):
    mount, volume = volume_for_mount(daemonset, plugin_container, DEVICE_PLUGIN_DIR)
    assert not mount.get("readOnly", False)
    assert volume["hostPath"]["path"] == DEVICE_PLUGIN_DIR
    assert plugin_flags(plugin_container)["device_plugin_dir"] == DEVICE_PLUGIN_DIR


def test_device_plugin_reaches_tpud_and_hands_out_its_socket(daemonset, plugin_container,
                                                            configmap):
    tpud_flags = flag_dict(configmap["data"]["tpud.flags"])
    flags = plugin_flags(plugin_container)
    assert flags["admin_socket"] == tpud_flags["admin_socket"]
    assert flags["container_tpud_socket"] == tpud_flags["socket"]
    assert flags["host_tpud_socket_dir"] == "/run/tpud"
    assert int(flags["shares_per_chip"]) >= 1
    _, volume = volume_for_mount(daemonset, plugin_container, "/run/tpud")
    assert volume["hostPath"]["path"] == "/run/tpud"


def test_device_plugin_accepts_its_flags(plugin_container, tmp_path):
    """The manifest's flags parse in the real binary (it then waits for tpud)."""
    import subprocess

    from conftest import bazel_bin

    flags = plugin_flags(plugin_container)
    flags["admin_socket"] = str(tmp_path / "no-tpud.sock")
    flags["device_plugin_dir"] = str(tmp_path)
    proc = subprocess.Popen([bazel_bin("plugins/k8s_device_plugin/tpud-device-plugin"),
                             *(f"--{k}={v}" for k, v in flags.items())],
                            stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.5)  # still waiting for tpud: the flags were accepted
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, proc.stderr.read()


def test_example_pod_requests_one_chip_share():
    (pod,) = [d for d in yaml.safe_load_all(EXAMPLE_POD.read_text()) if d is not None]
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"] == {"tpud.io/chip-share": 1}
    # The device plugin's Allocate supplies the socket, the mount and the token.
    assert "volumes" not in spec and "volumeMounts" not in container
    env = {e["name"] for e in container.get("env", [])}
    assert not env & {"TPUD_SOCKET", "TPUD_TOKEN", "TPU_VISIBLE_CHIPS"}
    assert spec["securityContext"]["supplementalGroups"], "join the socket's group"
