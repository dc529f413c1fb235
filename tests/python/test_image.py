"""The tpud image (deploy/Containerfile): what it ships matches what the
DaemonSet runs, its runtime dependencies resolve, and it builds where a
container builder is installed."""
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT, bazel_bin

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


def test_containerfile_builds_on_debian_in_two_stages_and_ships_three_binaries():
    text = CONTAINERFILE.read_text()
    froms = stages(text)
    assert len(froms) == 2, froms
    assert froms[0][1] == "build"
    arg = re.search(r"^ARG DEBIAN_IMAGE=(\S+)$", text, re.M)
    assert arg and re.match(r"(docker\.io/library/)?debian:bookworm", arg.group(1)), arg
    assert all(base == "${DEBIAN_IMAGE}" for base, _ in froms)
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


def container_builder():
    """A usable builder: podman, buildah, or docker with a daemon; else why not."""
    for tool in ("podman", "buildah"):
        if shutil.which(tool):
            return [tool, "build"] if tool == "podman" else [tool, "bud"], None
    if shutil.which("docker"):
        r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return ["docker", "build"], None
        return None, "docker is installed but has no daemon to build with"
    return None, "no container builder (podman, buildah or docker) is installed"


def test_image_builds_where_a_container_builder_is_installed():
    builder, why = container_builder()
    if builder is None:
        pytest.skip(f"{why}; the image was not built here")
    tag = "tpud-test-image:latest"
    r = subprocess.run(builder + ["-f", str(CONTAINERFILE), "-t", tag, str(ROOT)],
                       capture_output=True, text=True, timeout=3 * 3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    tool = builder[0] if builder[0] != "buildah" else "podman"
    if shutil.which(tool):
        for name in BINARIES:
            r = subprocess.run([tool, "run", "--rm", "--entrypoint", "sh", tag, "-c",
                                f"ldd /usr/bin/{name} | grep -c 'not found' || true"],
                               capture_output=True, text=True, timeout=300)
            assert r.stdout.strip() == "0", (name, r.stdout, r.stderr)
