"""The tpud image (deploy/Containerfile): what it ships matches what the
DaemonSet runs, its runtime dependencies resolve, and it is built offline with
podman (deploy/image/build.sh) and run: tpud in a container serves a PyTorch
job on the host through the bind-mounted socket directory."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import yaml

from conftest import ROOT, bazel_bin
from tpud_process import can_connect

pytestmark = pytest.mark.slow  # builds and inspects the image's binaries

CONTAINERFILE = ROOT / "deploy" / "Containerfile"
RUNTIME_DEPS = ROOT / "deploy" / "image" / "runtime-deps.sh"
K8S_DIR = ROOT / "deploy" / "kubernetes"
BINARIES = {
    "tpud": "daemon/tpud",
    "tpuctl": "tools/tpuctl/tpuctl",
    "tpud-device-plugin": "plugins/k8s_device_plugin/tpud-device-plugin",
}


def stages(text):
    """[(base, name)] of each FROM line."""
    return re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?\s*$", text, re.M | re.I)


def test_containerfile_builds_on_debian_and_ships_three_binaries():
    text = CONTAINERFILE.read_text()
    froms = stages(text)
    # The binaries from the host (build.sh) or from source, then the image.
    assert froms == [("${DEBIAN_IMAGE}", "binaries-host"), ("${DEBIAN_IMAGE}", "binaries-source"),
                     ("binaries-${BINARIES}", "build"), ("${DEBIAN_IMAGE}", "")], froms
    arg = re.search(r"^ARG DEBIAN_IMAGE=(\S+)$", text, re.M)
    assert arg and re.match(r"(docker\.io/library/)?debian:bookworm", arg.group(1)), arg
    assert re.search(r"^ARG BINARIES=source$", text, re.M)
    # The build stage sets up the project as CI does, then builds optimized.
    assert "tools/setup.sh" in text
    joined = re.sub(r"\\\n\s*", " ", text)  # continuation lines joined
    build = re.search(r"tools/bazel\.sh build -c opt[^\n]*", joined)
    assert build, "an optimized Bazel build of the binaries"
    for name, path in BINARIES.items():
        label = "//" + os.path.dirname(path) + ":" + name
        assert label in build.group(0), label
        # The target exists (bazel build //... made it).
        assert os.access(bazel_bin(path), os.X_OK), path
    # The final stage: binaries, the flagfile, and the group the runtime
    # socket belongs to (deploy/README.md gives clients that gid).
    assert "COPY --from=build /out/usr/bin/ /usr/bin/" in text
    assert "COPY deploy/config/tpud.flags /etc/tpud/tpud.flags" in text
    gid = re.search(r"groupadd --system --gid (\d+) tpu", text)
    assert gid, "the image has the socket group `tpu`"
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert f"supplementalGroups: [{gid.group(1)}]" in readme


def test_every_binary_the_manifests_run_is_in_the_image():
    shipped = {f"/usr/bin/{name}" for name in BINARIES}
    images = set()
    commands = []
    for manifest in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if not doc or doc.get("kind") != "DaemonSet":
                continue
            spec = doc["spec"]["template"]["spec"]
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                images.add(c["image"])
                if c.get("command"):
                    commands.append(c["command"][0])
                for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                    cmd = c.get(probe, {}).get("exec", {}).get("command")
                    if cmd:
                        commands.append(cmd[0])
    assert images == {"tpud:latest"}, "the DaemonSet runs the image this Containerfile builds"
    assert commands and set(commands) <= shipped, set(commands) - shipped


def test_runtime_deps_resolve_the_built_binaries():
    bins = [bazel_bin(p) for p in BINARIES.values()]
    r = subprocess.run([str(RUNTIME_DEPS)] + bins, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    packages = {l.split(" ", 1)[1] for l in lines if l.startswith("package ")}
    copies = [l.split(" ", 1)[1] for l in lines if l.startswith("copy ")]
    assert len(packages) + len(copies) == len(lines), lines
    assert any(p.startswith("libgrpc++") for p in packages), packages
    assert any(p.startswith("libprometheus-cpp-core") for p in packages), packages
    assert any(p.startswith("libabsl") for p in packages), packages
    # torch's libraries are not Debian's: they are copied into the image.
    names = {os.path.basename(c) for c in copies}
    assert {"libtorch_cpu.so", "libc10.so"} <= names, copies
    # A binary with Debian's libraries only needs no copies.
    r = subprocess.run([str(RUNTIME_DEPS), "/bin/true"], capture_output=True, text=True)
    assert r.returncode == 0 and "package libc6" in r.stdout and "copy " not in r.stdout


BUILD_SH = ROOT / "deploy" / "image" / "build.sh"
TAG = "localhost/tpud-test:latest"


def podman(*args, check=True, timeout=300):
    env = dict(os.environ, CONTAINERS_CONF=os.path.join(
        os.environ.get("TPUD_IMAGE_CACHE", "/var/tmp/tpud-image"), "containers.conf"))
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    if check:
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-4000:])
    return r


@pytest.fixture(scope="module")
def image():
    """The image, built by deploy/image/build.sh from this checkout's binaries."""
    for tool in ("podman", "debootstrap"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (tools/setup.sh installs podman, buildah, "
                        "runc and debootstrap); the image was not built here")
    if os.geteuid() != 0:
        pytest.skip("building the base image (debootstrap) and running podman with runc "
                    "need root here; the image was not built")
    for p in ("daemon/tpud", "tools/tpuctl/tpuctl",
              "plugins/k8s_device_plugin/tpud-device-plugin"):
        bazel_bin(p)
    t0 = time.time()
    r = subprocess.run(["bash", str(BUILD_SH), "--bazel-bin", str(ROOT / "bazel-bin"),
                        "--tag", TAG], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    info = {"build_s": time.time() - t0}
    made = re.search(r"made \S+ in (\d+) s", r.stdout)
    info["base_image_s"] = int(made.group(1)) if made else 0  # 0: the cached one
    built = re.search(r"built \S+ in (\d+) s \((\d+) bytes\)", r.stdout)
    assert built, r.stdout[-2000:]
    info["image_build_s"], info["image_bytes"] = int(built.group(1)), int(built.group(2))
    print(f"\nimage: {json.dumps(info)}")
    yield info
    podman("rmi", "-f", TAG, check=False)


def test_the_image_has_every_library_its_binaries_load(image):
    for name in BINARIES:
        r = podman("run", "--rm", "--network", "none", "--entrypoint", "sh", TAG, "-c",
                   f"ldd /usr/bin/{name} | grep -c 'not found' || true")
        assert r.stdout.strip() == "0", (name, r.stdout, r.stderr)
    r = podman("run", "--rm", "--network", "none", "--entrypoint", "sh", TAG, "-c",
               "getent group tpu; cat /etc/tpud/tpud.flags")
    assert r.stdout.startswith("tpu:x:5000:"), r.stdout
    assert "--allocation_state=/var/lib/tpud/allocations.state" in r.stdout


TRAIN = """
    import os, sys, time, torch, torch_tpu
    def losses(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(64, 16).to(device)
        y = torch.randn(64, 1).to(device)
        out = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out
    cpu, tpu = losses("cpu"), losses("tpu")
    print("losses", cpu, tpu, flush=True)
    held = torch.empty(8 << 20, dtype=torch.uint8, device="tpu")
    print("ready", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    try:
        print((held.float().sum()).item(), flush=True)
    except RuntimeError as e:
        print("ERROR", e, flush=True)
"""


def test_tpud_in_the_container_serves_a_job_on_the_host_and_stops_cleanly(image, tmp_path):
    run_dir = tempfile.mkdtemp(prefix="tpud-img.", dir="/tmp")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    name = f"tpud-test-{os.getpid()}"
    job = None
    try:
        # tpud needs no network: its sockets are unix sockets in run_dir.
        podman("run", "-d", "--name", name, "--network", "none",
               "-v", f"{run_dir}:/run/tpud", "-v", f"{state_dir}:/var/lib/tpud", TAG,
               "--flagfile=/etc/tpud/tpud.flags", "--hbm_bytes=256MiB", "--executor_nice=0")
        sock, admin = os.path.join(run_dir, "tpud.sock"), os.path.join(run_dir, "admin.sock")
        deadline = time.time() + 60
        while not (can_connect(sock) and can_connect(admin)):
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running" and time.time() < deadline, \
                podman("logs", name, check=False).stderr[-3000:]
            time.sleep(0.1)
        assert (state_dir / "allocations.state").exists()

        env = dict(os.environ, TPUD_SOCKET=sock, TPUD_ADMIN_SOCKET=admin)
        go = tmp_path / "go"
        job = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAIN), str(go)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = job.stdout.readline()
        assert line.startswith("losses"), line + job.stderr.read()[-3000:]
        cpu, tpu = (json.loads(part) for part in
                    line[len("losses "):].replace("] [", "]|[").split("|"))
        assert len(cpu) == 5 and cpu[-1] < cpu[0]
        for a, b in zip(cpu, tpu):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (cpu, tpu)
        assert job.stdout.readline().strip() == "ready"

        # tpuctl on the host and inside the container see the job's session.
        host = json.loads(subprocess.run(
            [bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={admin}", "sessions", "--json"],
            capture_output=True, text=True, timeout=30, check=True).stdout)
        inside = json.loads(podman("exec", name, "tpuctl", "sessions", "--json").stdout)
        assert len(host["sessions"]) == 1, host
        assert [s["id"] for s in inside["sessions"]] == [s["id"] for s in host["sessions"]]
        (session,) = host["sessions"]
        assert sum(session["hbm_bytes_per_chip"].values()) >= 8 << 20

        # SIGTERM: the job is told, its HBM reclaimed, the sockets removed.
        t0 = time.time()
        podman("stop", "-t", "30", name)
        stop_s = time.time() - t0
        go.touch()
        out, err = job.communicate(timeout=60)
        # Idle when tpud stopped, the job learns it at its next call.
        assert "ERROR" in out and "UNAVAILABLE" in out, (out, err[-2000:])
        assert "shutting down" in out or "the daemon stopped" in out, out
        logs = podman("logs", name).stderr
        assert "received SIGTERM" in logs, logs[-3000:]
        reclaimed = re.search(r"(\d+) sessions ended, ([\d.]+ \w+) of HBM reclaimed", logs)
        assert reclaimed and reclaimed.group(1) == "1", logs[-3000:]
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", logs[-3000:]
        assert not os.path.exists(sock) and not os.path.exists(admin)
        print(f"container stopped in {stop_s:.1f} s; {reclaimed.group(2)} reclaimed; "
              f"image {image['image_bytes'] / 1e6:.0f} MB")
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait()
        podman("rm", "-f", name, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)
