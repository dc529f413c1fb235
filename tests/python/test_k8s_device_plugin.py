"""tpud's Kubernetes device plugin against a stub kubelet and a real tpud.

The stub kubelet is written here: a gRPC Registration server on kubelet.sock
in a temporary device-plugins directory. On Register it connects to the
plugin's endpoint and follows ListAndWatch, as the kubelet does; the tests
then call GetPreferredAllocation and Allocate on the registered endpoints
and run PyTorch jobs with the environment Allocate returned. It also serves
the pod-resources API (List): each Allocate makes a pod that holds those
devices until the test ends it, as a kubelet's pods do. Python stubs of both
APIs are generated from plugins/k8s_device_plugin/{api,podresources}.proto
with grpcio-tools at test time.
"""
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent import futures

import pytest

from conftest import Daemon, bazel_bin

pytestmark = pytest.mark.slow  # a stub kubelet, the device plugin and tpud, and jobs through them

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (tools/setup.sh installs it)")
protoc = pytest.importorskip("grpc_tools.protoc",
                             reason="grpcio-tools is not installed (tools/setup.sh installs it)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
API_PROTO = ROOT / "plugins" / "k8s_device_plugin" / "api.proto"
POD_RESOURCES_PROTO = ROOT / "plugins" / "k8s_device_plugin" / "podresources.proto"
CHIP = "tpud.io/chip"
SHARE = "tpud.io/chip-share"
HBM = 256 << 20  # per chip
SHARES = 4
MiB = 1 << 20
RELEASE_GRACE = 0.5  # s: the plugin's --release_grace in these tests


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(api_pb2, api_pb2_grpc, podresources_pb2, podresources_pb2_grpc),
    generated from the plugin's protos."""
    out = tmp_path_factory.mktemp("kubelet_api")
    for proto in (API_PROTO, POD_RESOURCES_PROTO):
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto.parent}", f"--python_out={out}",
                          f"--grpc_python_out={out}", str(proto)])
        assert rc == 0, f"protoc failed on {proto.name}"
    sys.path.insert(0, str(out))
    try:
        return tuple(importlib.import_module(m) for m in (
            "api_pb2", "api_pb2_grpc", "podresources_pb2", "podresources_pb2_grpc"))
    finally:
        sys.path.remove(str(out))


class StubKubelet:
    """Serves Registration on <dir>/kubelet.sock; follows each registered
    plugin's ListAndWatch and keeps its latest device list."""

    def __init__(self, api, directory):
        self.pb2, self.pb2_grpc, self.pr_pb2, self.pr_pb2_grpc = api
        self.dir = directory
        self.socket = os.path.join(directory, "kubelet.sock")
        self.pod_resources_socket = os.path.join(directory, "pod-resources.sock")
        self.pods = {}  # name -> [(resource, [device ids])], one entry per container
        self.pod_count = 0
        self.cond = threading.Condition()
        self.registrations = []  # RegisterRequest, in order
        self.devices = {}  # resource -> {id: health}
        self.updates = {}  # resource -> number of ListAndWatch responses
        self.channels = {}  # resource -> grpc channel to the plugin
        self.server = None
        self.start()

    def start(self):
        kubelet = self

        class Registration(self.pb2_grpc.RegistrationServicer):
            def Register(self, request, context):
                kubelet.on_register(request)
                return kubelet.pb2.Empty()

        class PodResources(self.pr_pb2_grpc.PodResourcesListerServicer):
            def List(self, request, context):
                return kubelet.list_pod_resources()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.pb2_grpc.add_RegistrationServicer_to_server(Registration(), self.server)
        self.pr_pb2_grpc.add_PodResourcesListerServicer_to_server(PodResources(), self.server)
        self.server.add_insecure_port("unix:" + self.socket)
        self.server.add_insecure_port("unix:" + self.pod_resources_socket)
        self.server.start()

    def list_pod_resources(self):
        pb = self.pr_pb2
        with self.cond:
            pods = {name: list(containers) for name, containers in self.pods.items()}
        return pb.ListPodResourcesResponse(pod_resources=[
            pb.PodResources(name=name, namespace="default", containers=[
                pb.ContainerResources(name=f"c{i}", devices=[
                    pb.ContainerDevices(resource_name=resource, device_ids=ids)])
                for i, (resource, ids) in enumerate(containers)])
            for name, containers in pods.items()])

    def admit(self, resource, containers, pod=None):
        """Records a pod holding each container's devices (after their
        Allocate); pods that held any of them are gone, as the kubelet gives
        a device again only then. Returns the pod's name."""
        with self.cond:
            wanted = {d for ids in containers for d in ids}
            for name in [n for n, cs in self.pods.items()
                         if any(r == resource and wanted & set(ids) for r, ids in cs)]:
                del self.pods[name]
            if pod is None:
                self.pod_count += 1
                pod = f"pod-{self.pod_count}"
            self.pods.setdefault(pod, []).extend((resource, list(ids)) for ids in containers)
        return pod

    def end_pod(self, name):
        with self.cond:
            del self.pods[name]

    def stop(self, remove_plugin_sockets=False):
        """Stops serving and deletes kubelet.sock (and, as a restarting kubelet
        does, every plugin socket in the directory)."""
        self.server.stop(grace=None).wait()
        for name in os.listdir(self.dir):
            if name == "kubelet.sock" or remove_plugin_sockets:
                os.unlink(os.path.join(self.dir, name))

    def on_register(self, request):
        with self.cond:
            self.registrations.append(request)
            self.cond.notify_all()
        channel = grpc.insecure_channel("unix:" + os.path.join(self.dir, request.endpoint))
        stub = self.pb2_grpc.DevicePluginStub(channel)
        resource = request.resource_name
        with self.cond:
            self.channels[resource] = channel

        def follow():
            try:
                for resp in stub.ListAndWatch(self.pb2.Empty()):
                    with self.cond:
                        self.devices[resource] = {d.ID: d.health for d in resp.devices}
                        self.updates[resource] = self.updates.get(resource, 0) + 1
                        self.cond.notify_all()
            except grpc.RpcError:
                pass  # the plugin went away (or we did)

        threading.Thread(target=follow, daemon=True).start()

    def plugin(self, resource):
        with self.cond:
            return self.pb2_grpc.DevicePluginStub(self.channels[resource])

    def wait(self, predicate, timeout=15, what="condition"):
        with self.cond:
            ok = self.cond.wait_for(lambda: predicate(self), timeout)
        assert ok, f"stub kubelet: timed out waiting for {what}"

    def registered(self, after=0):
        with self.cond:
            return {r.resource_name: r for r in self.registrations[after:]}


class Plugin:
    def __init__(self, daemon, directory, extra=()):
        self.proc = subprocess.Popen(
            [bazel_bin("plugins/k8s_device_plugin/tpud-device-plugin"),
             f"--admin_socket={daemon.admin_socket}", f"--device_plugin_dir={directory}",
             f"--shares_per_chip={SHARES}", f"--container_tpud_socket={daemon.socket}",
             f"--host_tpud_socket_dir={daemon.dir}", "--health_interval=100ms",
             "--kubelet_check_interval=100ms", "--log_level=warn",
             f"--pod_resources_socket={os.path.join(directory, 'pod-resources.sock')}",
             "--pod_resources_interval=100ms", f"--release_grace={RELEASE_GRACE}s", *extra],
            stdin=subprocess.DEVNULL)

    def stop(self):
        self.proc.terminate()
        try:
            assert self.proc.wait(10) == 0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture(scope="module")
def cluster(api):
    """A v6e-8 tpud, a stub kubelet and the device plugin, registered, shared
    by the module's tests (Cluster)."""
    c = Cluster(api)
    try:
        yield c.daemon, c.kubelet, c.plugin
    finally:
        c.close()


def tpuctl(daemon, *args, check=True):
    r = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), *args], env=daemon.env(),
                       capture_output=True, text=True, timeout=30)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def allocate(kubelet, resource, *containers, pod=None):
    """Allocate, as the kubelet calls it for one pod's containers; the pod
    (named `pod`, or a new name) then holds the devices in the stub's
    pod-resources API until kubelet.end_pod."""
    pb2 = kubelet.pb2
    req = pb2.AllocateRequest(container_requests=[
        pb2.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers])
    resp = kubelet.plugin(resource).Allocate(req, timeout=10).container_responses
    kubelet.admit(resource, containers, pod)
    return resp


def preferred(kubelet, resource, available, size, must=()):
    pb2 = kubelet.pb2
    req = pb2.PreferredAllocationRequest(container_requests=[
        pb2.ContainerPreferredAllocationRequest(available_deviceIDs=list(available),
                                                must_include_deviceIDs=list(must),
                                                allocation_size=size)])
    (resp,) = kubelet.plugin(resource).GetPreferredAllocation(req, timeout=10).container_responses
    return list(resp.deviceIDs)


def chips(*ids):
    return [f"chip-{i}" for i in ids]


def job_env(container):
    """The environment of a container given `container`'s Allocate answer."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TPUD_SOCKET", "TPUD_ADMIN_SOCKET", "TPUD_TOKEN", "TPU_VISIBLE_CHIPS")}
    env.update(container.envs)
    return env


def run_job(env, code, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- registration and devices -------------------------------------------------


def test_both_resources_register_with_the_kubelet(cluster):
    _, kubelet, _ = cluster
    regs = kubelet.registered()
    assert set(regs) == {CHIP, SHARE}
    for resource, reg in regs.items():
        assert reg.version == "v1beta1"
        assert "/" not in reg.endpoint and reg.endpoint.endswith(".sock")
        assert os.path.exists(os.path.join(kubelet.dir, reg.endpoint))
        assert reg.options.get_preferred_allocation_available is True
        opts = kubelet.plugin(resource).GetDevicePluginOptions(kubelet.pb2.Empty(), timeout=10)
        assert opts.get_preferred_allocation_available is True
    assert regs[CHIP].endpoint != regs[SHARE].endpoint


def test_device_lists(cluster):
    _, kubelet, _ = cluster
    with kubelet.cond:
        chip_devices = dict(kubelet.devices[CHIP])
        share_devices = dict(kubelet.devices[SHARE])
    assert chip_devices == {f"chip-{i}": "Healthy" for i in range(8)}
    assert share_devices == {f"chip-{c}-share-{s}": "Healthy"
                             for c in range(8) for s in range(SHARES)}


def test_drained_chip_turns_unhealthy_and_back(cluster):
    daemon, kubelet, _ = cluster
    tpuctl(daemon, "drain", "3")
    try:
        kubelet.wait(lambda k: k.devices[CHIP]["chip-3"] == "Unhealthy"
                     and k.devices[SHARE]["chip-3-share-0"] == "Unhealthy",
                     what="chip 3 unhealthy after tpuctl drain")
        with kubelet.cond:
            unhealthy = {d for d, h in kubelet.devices[CHIP].items() if h != "Healthy"}
            unhealthy_shares = {d for d, h in kubelet.devices[SHARE].items() if h != "Healthy"}
        assert unhealthy == {"chip-3"}
        assert unhealthy_shares == {f"chip-3-share-{s}" for s in range(SHARES)}
    finally:
        tpuctl(daemon, "undrain", "3")
    kubelet.wait(lambda k: all(h == "Healthy" for h in k.devices[CHIP].values())
                 and all(h == "Healthy" for h in k.devices[SHARE].values()),
                 what="chip 3 healthy again after undrain")


# --- preferred allocation -----------------------------------------------------


def test_preferred_chips_are_a_contiguous_sub_slice(cluster):
    _, kubelet, _ = cluster
    all_chips = chips(*range(8))  # v6e-8: 2x4, chip = x + 2y
    assert preferred(kubelet, CHIP, all_chips, 4) == chips(0, 1, 2, 3)  # 2x2, not a 1x4 line
    assert preferred(kubelet, CHIP, chips(1, 2, 3, 4, 5, 6, 7), 4) == chips(2, 3, 4, 5)
    assert preferred(kubelet, CHIP, all_chips, 4, must=chips(7)) == chips(4, 5, 6, 7)
    assert preferred(kubelet, CHIP, chips(0, 3, 5), 2) == chips(3, 5)  # neighbours


def test_preferred_shares_pack_onto_few_chips(cluster):
    _, kubelet, _ = cluster
    everything = [f"chip-{c}-share-{s}" for c in range(8) for s in range(SHARES)]
    assert preferred(kubelet, SHARE, everything, 3) == [f"chip-0-share-{s}" for s in range(3)]
    # One share left on chip 5, four on chip 6: a single share fills chip 5.
    some = ["chip-5-share-2"] + [f"chip-6-share-{s}" for s in range(SHARES)]
    assert preferred(kubelet, SHARE, some, 1) == ["chip-5-share-2"]
    assert preferred(kubelet, SHARE, some, 2, must=["chip-6-share-3"]) == [
        "chip-6-share-0", "chip-6-share-3"]


# --- allocation, quotas, jobs -------------------------------------------------

HOLDER = """
    import os, sys, time, torch, torch_tpu
    assert torch.tpu.device_count() == 1, torch.tpu.device_count()
    x = torch.ones(1024, 1024, device="tpu")        # 4 MiB
    held = torch.empty(40 << 20, dtype=torch.uint8, device="tpu")  # within a 64 MiB share
    print("ready", flush=True)
    while not os.path.exists(sys.argv[1] if len(sys.argv) > 1 else os.environ["GO_FILE"]):
        time.sleep(0.05)
    y = (x * 3).sum().item()
    assert y == 3 * 1024 * 1024, y
    print("done", y)
"""

SECOND_PROCESS = """
    import torch, torch_tpu
    small = torch.empty(8 << 20, dtype=torch.uint8, device="tpu")   # fits beside the holder
    try:
        more = torch.empty(24 << 20, dtype=torch.uint8, device="tpu")  # together over 64 MiB
    except RuntimeError as e:
        print("REFUSED:", e)
    else:
        print("GRANTED")
"""

GREEDY = """
    import torch, torch_tpu
    x = torch.ones(256, 256, device="tpu")
    assert x.sum().item() == 65536
    try:
        big = torch.empty(100 << 20, dtype=torch.uint8, device="tpu")  # over a 64 MiB share
    except RuntimeError as e:
        print("REFUSED:", e)
    else:
        print("GRANTED")
"""


def test_two_pods_share_a_chip_each_held_to_its_share(cluster, tmp_path):
    daemon, kubelet, _ = cluster
    # Two pods, one share each; the plugin packs both onto chip 1 when that
    # is what the kubelet offers.
    free = ["chip-1-share-0", "chip-1-share-1"] + [f"chip-2-share-{s}" for s in range(SHARES)]
    first = preferred(kubelet, SHARE, free, 1)
    assert first == ["chip-1-share-0"]
    second = preferred(kubelet, SHARE, [d for d in free if d not in first], 1)
    assert second == ["chip-1-share-1"]
    (pod_a,) = allocate(kubelet, SHARE, first)
    (pod_b,) = allocate(kubelet, SHARE, second)

    for pod in (pod_a, pod_b):
        assert pod.envs["TPUD_SOCKET"] == daemon.socket
        assert pod.envs["TPU_VISIBLE_CHIPS"] == "1"
        assert re.fullmatch(r"[0-9a-f]{32}", pod.envs["TPUD_TOKEN"])
        (mount,) = pod.mounts
        assert mount.host_path == daemon.dir
        assert mount.container_path == os.path.dirname(daemon.socket)
    assert pod_a.envs["TPUD_TOKEN"] != pod_b.envs["TPUD_TOKEN"]

    go = tmp_path / "go"
    holder_env = job_env(pod_b)
    holder_env["GO_FILE"] = str(go)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER)], env=holder_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()

        # tpud holds each pod's sessions to its allocation: chip 1, 64 MiB.
        doc = json.loads(tpuctl(daemon, "allocations", "--json").stdout)
        assert doc["schema_version"] == 1
        by_name = {a["name"]: a for a in doc["allocations"]}
        b = by_name[f"{SHARE}: chip-1-share-1"]
        assert b["chips"] == [{"chip": 1, "quota_bytes": HBM // SHARES}]
        assert b["session_count"] == 1
        assert by_name[f"{SHARE}: chip-1-share-0"]["session_count"] == 0
        sessions = json.loads(tpuctl(daemon, "sessions", "--json").stdout)["sessions"]
        (held,) = [s for s in sessions if s["allocation_id"] == b["id"]]
        assert held["quota_bytes_per_chip"] == HBM // SHARES
        assert set(held["hbm_bytes_per_chip"]) == {"1"}
        assert 44 * MiB <= held["hbm_bytes_per_chip"]["1"] <= HBM // SHARES

        # A second process of pod B shares pod B's share with the holder: the
        # allocation's quota binds its sessions together.
        r = run_job(job_env(pod_b), SECOND_PROCESS)
        assert r.returncode == 0, r.stderr
        assert "REFUSED:" in r.stdout and "sessions of allocation" in r.stdout, r.stdout

        # Pod A runs a small job, then asks for more than its share.
        r = run_job(job_env(pod_a), GREEDY)
        assert r.returncode == 0, r.stderr
        assert "GRANTED" not in r.stdout
        assert "REFUSED:" in r.stdout, r.stdout
        refusal = r.stdout
        assert "quota" in refusal and "64.00 MiB" in refusal, refusal
        assert "chip 1" in refusal, refusal

        # Pod B is unaffected: its memory and its work.
        go.touch()
        out, err = holder.communicate(timeout=60)
        assert holder.returncode == 0, err
        assert "done 3145728" in out
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_pod_cannot_use_chips_outside_its_allocation(cluster):
    _, kubelet, _ = cluster
    (pod,) = allocate(kubelet, SHARE, ["chip-2-share-0"])
    env = job_env(pod)
    del env["TPU_VISIBLE_CHIPS"]  # sees every chip, may use only chip 2
    r = run_job(env, """
        import torch, torch_tpu
        x = torch.ones(16, device="tpu:2")
        assert x.sum().item() == 16
        try:
            torch.ones(16, device="tpu:0")
        except RuntimeError as e:
            print("REFUSED:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "REFUSED:" in r.stdout and "chip 0" in r.stdout and "chips 2" in r.stdout, r.stdout


def test_whole_chips_get_a_whole_chip_quota(cluster):
    daemon, kubelet, _ = cluster
    (pod,) = allocate(kubelet, CHIP, chips(4, 5))
    assert pod.envs["TPU_VISIBLE_CHIPS"] == "4,5"
    doc = json.loads(tpuctl(daemon, "allocations", "--json").stdout)
    (a,) = [a for a in doc["allocations"] if a["name"] == f"{CHIP}: chip-4,chip-5"]
    assert a["chips"] == [{"chip": 4, "quota_bytes": HBM}, {"chip": 5, "quota_bytes": HBM}]
    r = run_job(job_env(pod), """
        import torch, torch_tpu
        assert torch.tpu.device_count() == 2
        x = torch.ones(64, device="tpu:1") + torch.ones(64, device="tpu:1")
        print(x.sum().item())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "128.0"
    # Allocating a device again ends the allocation that held it (its pod is gone).
    (alone,) = allocate(kubelet, CHIP, chips(5))
    names = [a["name"] for a in json.loads(tpuctl(daemon, "allocations", "--json").stdout)
             ["allocations"]]
    assert f"{CHIP}: chip-4,chip-5" not in names
    assert f"{CHIP}: chip-5" in names
    assert "chip-5" in tpuctl(daemon, "allocations").stdout
    r = run_job(job_env(pod), "import torch, torch_tpu; torch.ones(1, device='tpu')")
    assert r.returncode != 0 and "TPUD_TOKEN" in r.stderr, r.stderr[-2000:]
    # The same devices again (the pod's next container) keep their allocation.
    (again,) = allocate(kubelet, CHIP, chips(5))
    assert again.envs["TPUD_TOKEN"] == alone.envs["TPUD_TOKEN"]
    assert again.annotations == alone.annotations
    names_again = [a["name"] for a in json.loads(tpuctl(daemon, "allocations", "--json").stdout)
                   ["allocations"]]
    assert names_again == names


def test_unknown_token_is_refused_at_session_open(cluster):
    daemon, _, _ = cluster
    env = daemon.env()
    env["TPUD_TOKEN"] = "0123456789abcdef0123456789abcdef"
    r = run_job(env, """
        import torch, torch_tpu
        torch.ones(4, device="tpu")
    """)
    assert r.returncode != 0
    assert "TPUD_TOKEN" in r.stderr and "PERMISSION_DENIED" in r.stderr, r.stderr[-2000:]


# --- bad input ------------------------------------------------------------------


def test_bad_device_ids_get_clear_errors(cluster):
    _, kubelet, _ = cluster
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, CHIP, ["chip-99"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chip-99" in e.value.details() and "chip-0 .. chip-7" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, SHARE, ["chip-0"])  # a whole chip's ID on the share resource
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chip-<0..7>-share-<0..3>" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, SHARE, ["chip-0-share-0"], [])  # a container with no devices
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        preferred(kubelet, CHIP, chips(0, 1), 3)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot pick 3" in e.value.details()


# --- kubelet restarts -----------------------------------------------------------


def test_registers_again_when_the_kubelet_restarts(cluster):
    _, kubelet, _ = cluster
    before = len(kubelet.registrations)
    updates = dict(kubelet.updates)
    # A restarting kubelet removes every socket in the directory, then
    # serves a new kubelet.sock.
    kubelet.stop(remove_plugin_sockets=True)
    time.sleep(0.3)
    kubelet.start()
    kubelet.wait(lambda k: set(k.registered(before)) == {CHIP, SHARE},
                 what="both resources registering again")
    kubelet.wait(lambda k: all(k.updates.get(r, 0) > updates.get(r, 0) for r in (CHIP, SHARE)),
                 what="device lists from the restarted plugin servers")
    for reg in kubelet.registered(before).values():
        assert os.path.exists(os.path.join(kubelet.dir, reg.endpoint))
    (pod,) = allocate(kubelet, CHIP, chips(6))
    assert pod.envs["TPU_VISIBLE_CHIPS"] == "6"


def test_registers_again_when_only_kubelet_sock_is_recreated(cluster):
    _, kubelet, _ = cluster
    before = len(kubelet.registrations)
    kubelet.stop(remove_plugin_sockets=False)
    kubelet.start()
    kubelet.wait(lambda k: set(k.registered(before)) == {CHIP, SHARE},
                 what="both resources registering again")


def test_restarts_its_server_when_its_socket_is_removed(cluster):
    _, kubelet, _ = cluster
    before = len(kubelet.registrations)
    endpoint = kubelet.registered()[SHARE].endpoint
    os.unlink(os.path.join(kubelet.dir, endpoint))
    kubelet.wait(lambda k: SHARE in k.registered(before), what="chip-share registering again")
    assert os.path.exists(os.path.join(kubelet.dir, endpoint))
    (pod,) = allocate(kubelet, SHARE, ["chip-7-share-3"])
    assert pod.envs["TPU_VISIBLE_CHIPS"] == "7"


# --- whole chips and shares on one node ------------------------------------------


class Cluster:
    """A v6e-8 tpud, a stub kubelet and the device plugin, registered."""

    def __init__(self, api, tpud_flags=()):
        self.daemon = Daemon(hbm="256MiB", extra_flags=["--topology=v6e-8", *tpud_flags])
        self.dir = tempfile.mkdtemp(prefix="kdp.", dir="/tmp")
        self.kubelet = StubKubelet(api, self.dir)
        self.plugin = Plugin(self.daemon, self.dir)
        try:
            self.kubelet.wait(lambda k: {CHIP, SHARE} <= set(k.devices),
                              what="both resources' devices")
        except BaseException:
            self.close()
            raise

    def restart_plugin(self):
        before = len(self.kubelet.registrations)
        self.plugin.stop()
        self.plugin = Plugin(self.daemon, self.dir)
        self.kubelet.wait(lambda k: set(k.registered(before)) == {CHIP, SHARE},
                          what="the restarted plugin registering")

    def close(self):
        self.plugin.stop()
        self.kubelet.stop()
        self.daemon.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fresh(api):
    c = Cluster(api)
    yield c
    c.close()


def health(kubelet, resource, ids):
    with kubelet.cond:
        return {d: kubelet.devices[resource][d] for d in ids}


def shares_of(chip):
    return [f"chip-{chip}-share-{s}" for s in range(SHARES)]


def allocation_names(daemon):
    doc = json.loads(tpuctl(daemon, "allocations", "--json").stdout)
    return [a["name"] for a in doc["allocations"]]


def test_a_chip_given_whole_is_not_offered_as_shares_and_back(fresh):
    daemon, kubelet = fresh.daemon, fresh.kubelet
    allocate(kubelet, CHIP, chips(3), pod="whole")
    # Its shares turn Unhealthy at once (the claim), the chip itself stays.
    kubelet.wait(lambda k: all(k.devices[SHARE][d] == "Unhealthy" for d in shares_of(3)),
                 what="chip 3's shares withdrawn")
    assert health(kubelet, CHIP, ["chip-3"]) == {"chip-3": "Healthy"}
    assert set(health(kubelet, SHARE, shares_of(2)).values()) == {"Healthy"}
    # A kubelet that raced the update is refused, with the reason.
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, SHARE, ["chip-3-share-0"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "chip 3 is in use as tpud.io/chip" in e.value.details()
    assert f"{SHARE}: chip-3-share-0" not in allocation_names(daemon)

    # The other way round: a share on chip 0 withdraws chip-0 whole.
    allocate(kubelet, SHARE, ["chip-0-share-1"], pod="share")
    kubelet.wait(lambda k: k.devices[CHIP]["chip-0"] == "Unhealthy", what="chip-0 withdrawn")
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, CHIP, chips(0, 1))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "chip 0 is in use as tpud.io/chip-share" in e.value.details()
    # Other shares of chip 0 are still offered and allocate.
    assert health(kubelet, SHARE, ["chip-0-share-2"]) == {"chip-0-share-2": "Healthy"}
    (second,) = allocate(kubelet, SHARE, ["chip-0-share-2"], pod="share-2")
    assert second.envs["TPU_VISIBLE_CHIPS"] == "0"

    # The whole-chip pod ends: the kubelet no longer lists it, the plugin
    # releases its allocation and offers chip 3's shares again.
    assert f"{CHIP}: chip-3" in allocation_names(daemon)
    t0 = time.time()
    kubelet.end_pod("whole")
    kubelet.wait(lambda k: all(k.devices[SHARE][d] == "Healthy" for d in shares_of(3)),
                 timeout=RELEASE_GRACE + 10, what="chip 3's shares offered again")
    freed_after = time.time() - t0
    assert f"{CHIP}: chip-3" not in allocation_names(daemon)
    (pod,) = allocate(kubelet, SHARE, ["chip-3-share-0"])
    assert pod.envs["TPU_VISIBLE_CHIPS"] == "3"
    # Both share pods on chip 0 end: chip-0 is offered whole again.
    kubelet.end_pod("share")
    assert health(kubelet, CHIP, ["chip-0"]) == {"chip-0": "Unhealthy"}  # share-2 holds it
    kubelet.end_pod("share-2")
    kubelet.wait(lambda k: k.devices[CHIP]["chip-0"] == "Healthy",
                 timeout=RELEASE_GRACE + 10, what="chip-0 offered again")
    (pod,) = allocate(kubelet, CHIP, chips(0))
    assert pod.envs["TPU_VISIBLE_CHIPS"] == "0"
    print(f"chip 3's shares offered again {freed_after:.2f} s after its pod ended "
          f"(--release_grace={RELEASE_GRACE}s, --pod_resources_interval=100ms)")


def test_a_restarted_plugin_keeps_chips_apart_from_the_kubelets_view(fresh):
    kubelet = fresh.kubelet
    allocate(kubelet, SHARE, ["chip-5-share-0"], pod="share")
    allocate(kubelet, CHIP, chips(6), pod="whole")
    fresh.restart_plugin()  # it remembers nothing of its own
    kubelet.wait(lambda k: k.devices[CHIP]["chip-5"] == "Unhealthy"
                 and all(k.devices[SHARE][d] == "Unhealthy" for d in shares_of(6)),
                 what="the kubelet's view applied")
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, CHIP, chips(5))
    assert "chip 5 is in use as tpud.io/chip-share" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, SHARE, ["chip-6-share-1"])
    assert "chip 6 is in use as tpud.io/chip" in e.value.details()
    # The pod that held the share ends: the restarted plugin does not know
    # its allocation's token, so it releases it in tpud by id.
    daemon = fresh.daemon
    assert f"{SHARE}: chip-5-share-0" in allocation_names(daemon)
    kubelet.end_pod("share")
    kubelet.wait(lambda k: k.devices[CHIP]["chip-5"] == "Healthy", what="chip 5 free")
    deadline = time.time() + RELEASE_GRACE + 10
    while f"{SHARE}: chip-5-share-0" in allocation_names(daemon):
        assert time.time() < deadline, allocation_names(daemon)
        time.sleep(0.1)
    assert f"{CHIP}: chip-6" in allocation_names(daemon)  # its pod still runs


def test_tpuctl_releases_an_allocation_by_id(fresh):
    daemon, kubelet = fresh.daemon, fresh.kubelet
    (pod,) = allocate(kubelet, CHIP, chips(7), pod="p")
    doc = json.loads(tpuctl(daemon, "allocations", "--json").stdout)
    (a,) = [a for a in doc["allocations"] if a["name"] == f"{CHIP}: chip-7"]
    r = tpuctl(daemon, "release", str(a["id"]))
    assert f"released allocation {a['id']}" in r.stdout
    assert f"{CHIP}: chip-7" not in allocation_names(daemon)
    r = run_job(job_env(pod), "import torch, torch_tpu; torch.ones(1, device='tpu')")
    assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr, r.stderr[-2000:]
    r = tpuctl(daemon, "release", str(a["id"]), check=False)
    assert r.returncode != 0 and f"no allocation {a['id']}" in r.stderr, r.stderr


def test_without_the_pod_resources_api_chips_still_never_overlap(fresh):
    kubelet = fresh.kubelet
    kubelet.server.stop(grace=None).wait()  # no kubelet answers any more
    allocate(kubelet, CHIP, chips(2), pod="whole")  # the channel is the plugin's
    with pytest.raises(grpc.RpcError) as e:
        allocate(kubelet, SHARE, ["chip-2-share-0"])
    assert "chip 2 is in use as tpud.io/chip" in e.value.details()
    kubelet.start()


# --- a tpud restart under allocated pods -------------------------------------------


def test_pods_keep_their_tokens_across_a_tpud_restart(api, tmp_path):
    state = tmp_path / "state" / "allocations.state"
    c = Cluster(api, tpud_flags=[f"--allocation_state={state}"])
    daemon, kubelet = c.daemon, c.kubelet
    holder = None
    try:
        (pod_a,) = allocate(kubelet, CHIP, chips(1, 3), pod="a")
        (pod_b,) = allocate(kubelet, SHARE, ["chip-4-share-0"], pod="b")
        before = json.loads(tpuctl(daemon, "allocations", "--json").stdout)["allocations"]
        assert oct(state.stat().st_mode & 0o777) == "0o600"  # it holds the tokens

        # Pod B's long-lived process, busy inside its share when tpud dies
        # (SIGKILL: a crash; the state file was written whole before).
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(RESTART_HOLDER)],
                                  env=job_env(pod_b), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        time.sleep(0.3)
        killed = time.time()
        daemon.proc.kill()
        daemon.proc.wait(10)
        out, err = holder.communicate(timeout=60)
        assert "ERROR" in out and "UNAVAILABLE" in out, (out, err[-2000:])
        told = float(out.split()[1]) - killed
        assert told < 1.0, out  # the restart-to-UNAVAILABLE promise (test_sharing.py)
        t1 = time.time()
        daemon.start()
        restarted = time.time() - t1

        # Both allocations are back, with their ids, chips and quotas.
        after = json.loads(tpuctl(daemon, "allocations", "--json").stdout)["allocations"]
        strip = lambda allocs: [{k: a[k] for k in ("id", "name", "chips")} for a in allocs]
        assert strip(after) == strip(before)
        # The pods' tokens open sessions held to what they were given.
        r = run_job(job_env(pod_a), """
            import torch, torch_tpu
            assert torch.tpu.device_count() == 2, torch.tpu.device_count()
            x = torch.ones(64, device="tpu:1") * 2
            print(x.sum().item())
        """)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "128.0"
        r = run_job(job_env(pod_b), GREEDY)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "REFUSED:" in r.stdout and "64.00 MiB" in r.stdout, r.stdout
        # A forged token is still refused; new allocations continue the ids.
        env = job_env(pod_b)
        env["TPUD_TOKEN"] = "f" * 32
        r = run_job(env, "import torch, torch_tpu; torch.ones(1, device='tpu')")
        assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr
        kubelet.wait(lambda k: all(h == "Healthy" for d, h in k.devices[CHIP].items()
                                   if d not in ("chip-4",)),
                     what="devices healthy again after the restart")
        (pod_c,) = allocate(kubelet, CHIP, chips(6), pod="c")
        ids = {a["id"] for a in before}
        new = [a for a in json.loads(tpuctl(daemon, "allocations", "--json").stdout)
               ["allocations"] if a["id"] not in ids]
        assert len(new) == 1 and new[0]["id"] > max(ids)
        print(f"pod B's process told UNAVAILABLE {told:.2f} s after tpud was killed; tpud "
              f"served again {restarted:.2f} s after its start; the pods' tokens worked at once")

        # A damaged state file stops tpud with a clear error, and nothing is
        # applied; the good file starts it again.
        daemon.stop_process()
        good = state.read_bytes()
        state.write_bytes(good.replace(b"chip-6", b"chip-7"))
        with pytest.raises(RuntimeError, match="tpud exited with 1"):
            daemon.start()
        r = subprocess.run([daemon.binary, f"--socket={daemon.socket}",
                            f"--admin_socket={daemon.admin_socket}", "--hbm_bytes=256MiB",
                            "--topology=v6e-8", f"--allocation_state={state}"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0
        assert f"{state}: the file is damaged" in r.stderr, r.stderr
        assert "move the file aside" in r.stderr
        # The good file, on another host (a v6e-4 tpud), is refused too.
        state.write_bytes(good)
        r = subprocess.run([daemon.binary, f"--socket={daemon.socket}",
                            f"--admin_socket={daemon.admin_socket}", "--hbm_bytes=256MiB",
                            "--topology=v6e-4", f"--allocation_state={state}"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "written for a v6e-8 host" in r.stderr, r.stderr
        assert state.read_bytes() == good  # a refused file is left as it was
        daemon.start()
        assert strip(json.loads(tpuctl(daemon, "allocations", "--json").stdout)
                     ["allocations"]) == strip(before) + strip(new)
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        c.close()


RESTART_HOLDER = """
    import time, torch, torch_tpu
    x = torch.ones(1024, 1024, device="tpu")
    (x * 2).sum().item()
    print("ready", flush=True)
    try:
        while True:
            (x * 2).sum().item()
    except RuntimeError as e:
        print("ERROR", time.time(), e, flush=True)
"""
