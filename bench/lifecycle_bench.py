"""What a new tpu process pays against a new CPU process (issue 32).

JSON lines, each tpu figure against CPU eager measured in the same run:

  first_ops_1    one new process: its first 100 ops after its first tensor
                 (x = x * 0.5 + 1, then x.sum().item()); median of --rounds
                 processes per device. Target: tpu <= 5x CPU and < 20 ms.
  first_ops_16   16 processes that have imported torch (and torch_tpu),
                 released together by one signal: the median process's
                 first 100 ops, over --rounds batches per device (taken in
                 turn). Target: tpu <= 10x CPU.
  import_overhead  `import torch` with torch_tpu autoloaded against
                 TORCH_DEVICE_BACKEND_AUTOLOAD=0: wall time and peak RSS.
  short_jobs_64  64 short jobs started at once, as a test farm starts them
                 (no barrier): each a new process that imports torch, runs
                 the first 100 ops and .item(), checks the value and exits.
                 Wall time from the first start to the last exit; also the
                 median process's import and first ops (after the import up
                 to the .item()), and how long the last exit trails the last
                 job done. Target: tpu <= 1.25x CPU.
  test_suite_8   a generated pytest suite of 200 small tests (elementwise ops,
                 reductions, views, indexing, matmul, each checked with .item(),
                 .tolist() or torch.equal against values worked out here; every
                 10th a Linear + backward + SGD step checked against the CPU),
                 run as 8 plain pytest processes started together, a shard each.
                 Wall time from their start to the last exit. Target: tpu <=
                 1.5x CPU.

Each tpu process talks to one tpud started here (-c opt build by default).
  session_cost   16 processes (4 with --reduced) that made a tensor and read
                 it, held open: what a tpu process holds beyond a CPU one
                 (descriptors, threads, resident bytes; medians) and what
                 tpud grows by per session (private bytes, per-session shared
                 memory, descriptors, threads; CPU seconds from open to
                 close). No target: the figures to state and to watch.
The CPU processes run the same code in the same environment (torch_tpu, being
installed, autoloads in them too) on device "cpu". --reduced runs fewer
processes (what CI runs: first_ops_2, short_jobs_4, and test_suite_2 of 40
tests); the figures are then only a smoke test. Run it on a quiet machine for
figures worth comparing.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402

# One job: imports, signals ready, waits for the go file, runs the first 100
# ops, prints their seconds.
JOB = r"""
import os, sys, time
t0 = time.perf_counter()
import torch
dev = sys.argv[1]
if dev == "tpu":
    import torch_tpu  # noqa: F401 (also autoloaded)
x = torch.ones(64, 64, device=dev)
x.sum().item()
ready, go = sys.argv[2], sys.argv[3]
open(ready, "w").close()
while go and not os.path.exists(go):
    time.sleep(0.001)
t = time.perf_counter()
for _ in range(100):
    x = x * 0.5 + 1
v = x.sum().item()
print(time.perf_counter() - t, v)
"""


def run_batch(device, n, env, timeout=600):
    """n processes of JOB, released together; their first-100-ops seconds."""
    with tempfile.TemporaryDirectory(prefix="lifecycle.") as d:
        go = os.path.join(d, "go")
        procs = []
        for i in range(n):
            ready = os.path.join(d, f"ready{i}")
            procs.append((ready, subprocess.Popen(
                [sys.executable, "-c", JOB, device, ready, go], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        deadline = time.time() + timeout
        while not all(os.path.exists(r) for r, _ in procs):
            if time.time() > deadline or any(p.poll() not in (None, 0) for _, p in procs):
                for _, p in procs:
                    p.kill()
                errs = [p.communicate()[1][-1500:] for _, p in procs if p.returncode]
                sys.exit(f"lifecycle_bench: a {device} job failed: {errs[:1]}")
            time.sleep(0.01)
        open(go, "w").close()
        seconds = []
        for _, p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                sys.exit(f"lifecycle_bench: a {device} job failed: {err[-1500:]}")
            secs, value = out.split()
            # 64*64 elements, each 2 - 2**-100 after 100 steps from 1.
            if abs(float(value) - 8192.0) > 1e-2:
                sys.exit(f"lifecycle_bench: a {device} job computed {value}, not 8192")
            seconds.append(float(secs))
        return seconds


# A short job as a test farm runs one: a new interpreter imports torch, does a
# little work, checks it and exits. It prints its clock (time.time()) at its
# start, after `import torch` and after the .item(), then the value.
SHORT_JOB = r"""
import sys, time
t0 = time.time()
import torch
t1 = time.time()
x = torch.ones(64, 64, device=sys.argv[1])
for _ in range(100):
    x = x * 0.5 + 1
v = x.sum().item()
print(t0, t1, time.time(), v, flush=True)
"""


def start_together(cmds, envs, cwd, timeout):
    """Starts every command at once (no barrier), command i in envs[i], and
    waits for them all. Returns the clock before the first start and per
    command (its exit clock, return code, stdout, stderr); None if they ran
    past `timeout` (then all are killed)."""
    procs, ends, waiters = [], [None] * len(cmds), []

    def wait(i, p):
        p.wait()  # a blocking waitpid: the clock is read as it returns
        ends[i] = time.time()

    start = time.time()
    for i, (cmd, env) in enumerate(zip(cmds, envs)):
        # Files, not pipes: no process stalls on a pipe nobody reads yet.
        out = open(os.path.join(cwd, f"stdout{i}"), "w+")
        err = open(os.path.join(cwd, f"stderr{i}"), "w+")
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                             stdout=out, stderr=err)
        procs.append((p, out, err))
        waiters.append(threading.Thread(target=wait, args=(i, p), daemon=True))
        waiters[-1].start()
    deadline = start + timeout
    for w in waiters:
        w.join(max(0.0, deadline - time.time()))
    timed_out = any(w.is_alive() for w in waiters)
    if timed_out:
        for p, _, _ in procs:
            if p.returncode is None:
                p.kill()
        for w in waiters:
            w.join()
    results = []
    for end, (p, out, err) in zip(ends, procs):
        out.seek(0)
        err.seek(0)
        results.append((end, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return None if timed_out else (start, results)


def short_jobs(device, n, env, timeout=1200):
    """n SHORT_JOBs started at once: wall seconds from the first start to the
    last exit; the median import and first ops; last job done -> last exit."""
    with tempfile.TemporaryDirectory(prefix="lifecycle.") as d:
        ran = start_together([[sys.executable, "-c", SHORT_JOB, device]] * n,
                             [env] * n, d, timeout)
    if ran is None:
        sys.exit(f"lifecycle_bench: {n} short {device} jobs ran past {timeout} s")
    start, results = ran
    imports, ops, dones = [], [], []
    for _, rc, out, err in results:
        if rc != 0:
            sys.exit(f"lifecycle_bench: a short {device} job exited {rc}: {err[-1500:]}")
        t0, t1, t2, value = map(float, out.split())
        # 64*64 elements, each 2 - 2**-100 after 100 steps from 1.
        if abs(value - 8192.0) > 1e-2:
            sys.exit(f"lifecycle_bench: a short {device} job computed {value}, not 8192")
        imports.append(t1 - t0)
        ops.append(t2 - t1)
        dones.append(t2)
    last_exit = max(end for end, _, _, _ in results)
    return {"seconds": last_exit - start, "import": statistics.median(imports),
            "first_ops": statistics.median(ops), "last_done_to_last_exit": last_exit - max(dones)}


# The generated suite's conftest: the device, a parameter taken from the
# environment (one file runs on either), and this worker's shard of the items.
SUITE_CONFTEST = r"""
import os


def pytest_generate_tests(metafunc):
    if "dev" in metafunc.fixturenames:
        metafunc.parametrize("dev", [os.environ["LIFECYCLE_DEVICE"]])


def pytest_collection_modifyitems(config, items):
    shard = int(os.environ["LIFECYCLE_SHARD"])
    shards = int(os.environ["LIFECYCLE_SHARDS"])
    drop = [item for i, item in enumerate(items) if i % shards != shard]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for i, item in enumerate(items) if i % shards == shard]
"""


def suite_test(i):
    """The source of the suite's test i. Expected values are worked out here in
    plain Python: small integers, exact in float32."""
    n = 16 * (1 + i % 4)  # 16 to 64 elements, 4 rows of `col`
    col, k, c = n // 4, 2 + i % 7, i % 5 - 2
    if i % 10 == 9:
        return f"""
def test_{i:03d}_linear_sgd_step(dev):
    torch.manual_seed({i})
    model = torch.nn.Linear(16, 16)
    ref = copy.deepcopy(model)
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.mse_loss(model(x.to(dev)), target.to(dev))
    loss.backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = F.mse_loss(ref(x), target)
    ref_loss.backward()
    ref_opt.step()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert torch.allclose(model.weight.detach().cpu(), ref.weight.detach(), atol=1e-5)
    assert torch.allclose(model.bias.detach().cpu(), ref.bias.detach(), atol=1e-5)
"""
    kind = (i - i // 10) % 6  # the other nine of every ten, in turn
    if kind == 0:
        return f"""
def test_{i:03d}_elementwise(dev):
    x = torch.arange({n}, dtype=torch.float32, device=dev)
    y = x * {k} + {c}
    assert y.sum().item() == {sum(j * k + c for j in range(n))}
    assert (y - x).max().item() == {(n - 1) * (k - 1) + c}
    assert torch.equal(((y - {c}) / {k}).cpu(), torch.arange({n}, dtype=torch.float32))
"""
    if kind == 1:
        rows = [[(r * col + j - c) * k for j in range(col)] for r in range(4)]
        return f"""
def test_{i:03d}_equal(dev):
    x = torch.arange({n}, device=dev).reshape(4, -1)
    y = (x - {c}) * {k}
    assert torch.equal(y.cpu(), torch.tensor({rows}))
    assert not torch.equal(y.cpu(), torch.tensor({rows}) + 1)
"""
    if kind == 2:
        sums = [float(sum(range(r * col, (r + 1) * col))) for r in range(4)]
        return f"""
def test_{i:03d}_reduction(dev):
    x = torch.arange({n}, dtype=torch.float32, device=dev).reshape(4, -1)
    assert x.sum(dim=1).tolist() == {sums}
    assert x.amax(dim=0).tolist() == {[float(3 * col + j) for j in range(col)]}
    assert x.mean().item() == {(n - 1) / 2}
    assert x.argmax().item() == {n - 1}
"""
    if kind == 3:
        a, b, step = i % col, i % 4, 2 + i % 3
        return f"""
def test_{i:03d}_view(dev):
    x = torch.arange({n}, dtype=torch.float32, device=dev)
    v = x.view(4, -1).t()
    assert v.shape == ({col}, 4)
    assert v[{a}, {b}].item() == {float(b * col + a)}
    assert v.contiguous().view(-1)[{b}].item() == {float(b * col)}
    assert x[1::{step}].sum().item() == {float(sum(range(1, n, step)))}
"""
    if kind == 4:
        j = i % n
        picked = [-float(k) if v == j else float(v) for v in (0, n - 1, j)]
        return f"""
def test_{i:03d}_indexing(dev):
    x = torch.arange({n}, dtype=torch.float32, device=dev)
    x[{j}] = -{k}
    assert x.min().item() == -{k}
    assert x[torch.tensor([0, {n - 1}, {j}], device=dev)].tolist() == {picked}
    y = torch.where(x > {n // 2}, x, torch.zeros_like(x))
    assert y.sum().item() == {float(sum(v for v in range(n // 2 + 1, n) if v != j))}
"""
    return f"""
def test_{i:03d}_matmul(dev):
    a = torch.arange(16, dtype=torch.float32, device=dev).reshape(4, 4)
    b = torch.eye(4, device=dev) * {k}
    assert torch.equal((a @ b).cpu(), (a * {k}).cpu())
    assert torch.cat([a, a]).sum().item() == {float(2 * sum(range(16)))}
"""


def run_test_suite(device, tests, workers, env, timeout=1200):
    """The generated suite of `tests` tests in `workers` plain pytest processes
    started together, shard i the tests whose index % workers == i: wall
    seconds from their start to the last exit."""
    with tempfile.TemporaryDirectory(prefix="lifecycle-suite.") as d:
        # An ini file here: none of this repository's configuration applies,
        # and conftest.py files are looked for no further up than this folder.
        ini = os.path.join(d, "pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
        with open(os.path.join(d, "conftest.py"), "w") as f:
            f.write(SUITE_CONFTEST)
        with open(os.path.join(d, "test_generated.py"), "w") as f:
            f.write("import copy\n\nimport torch\nimport torch.nn.functional as F\n")
            f.write("".join(suite_test(i) for i in range(tests)))
        base = {k: v for k, v in env.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
        envs = [dict(base, LIFECYCLE_DEVICE=device, LIFECYCLE_SHARD=str(i),
                     LIFECYCLE_SHARDS=str(workers)) for i in range(workers)]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-c", ini, "--rootdir", d, "test_generated.py"]
        ran = start_together([cmd] * workers, envs, d, timeout)
    if ran is None:
        sys.exit(f"lifecycle_bench: the {device} test suite ran past {timeout} s")
    start, results = ran
    passed = 0
    for _, rc, out, err in results:
        if rc != 0:
            sys.exit(f"lifecycle_bench: a {device} test suite shard exited {rc}: "
                     f"{out[-3000:]}{err[-1500:]}")
        m = re.search(r"(\d+) passed", out)
        passed += int(m.group(1)) if m else 0
    if passed != tests:  # every test run once, by one shard
        sys.exit(f"lifecycle_bench: {passed} {device} tests passed, not {tests}: "
                 f"{results[0][2][-1500:]}")
    return max(end for end, _, _, _ in results) - start


# A process that has used its device: it reports what it holds (descriptors,
# threads, resident bytes), then idles until told to exit.
HOLDER = r"""
import os, sys
import torch
x = torch.ones(64, 64, device=sys.argv[1])
x.sum().item()
rss = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
           if l.startswith("VmRSS:"))
print(len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss,
      flush=True)
sys.stdin.readline()
"""


def tree_usage(pid):
    """tpud and its executor processes: private dirty bytes (outside the
    shared memory it makes; clean pages are of files every process maps), resident bytes of its per-session shared memory
    (rings, staging, state: each mapping counted once, at its largest),
    descriptors, threads, CPU seconds. HBM is left out: sessions pay for it
    by quota."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    private = fds = threads = 0
    cpu = 0.0
    shared = {}  # per-session mapping -> its largest resident size
    for p in pids:
        try:
            name = ""
            with open(f"/proc/{p}/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=6)
                    if "-" in head[0] and not head[0].endswith(":"):
                        name = head[5].strip() if len(head) > 5 else ""
                    elif name.startswith(("/memfd:tpud-session-", "/memfd:tpud-state-")):
                        if head[0] == "Rss:":
                            shared[name] = max(shared.get(name, 0), int(head[1]) * 1024)
                    elif name.startswith("/memfd:"):
                        continue  # HBM, owner tables, executor slots: not per session
                    elif head[0] == "Private_Dirty:":  # clean pages: shared files
                        private += int(head[1]) * 1024
            fds += len(os.listdir(f"/proc/{p}/fd"))
            threads += len(os.listdir(f"/proc/{p}/task"))
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return {"private": private, "shared": sum(shared.values()), "fds": fds,
            "threads": threads, "cpu": cpu}


def session_cost(daemon_pid, env, n, timeout=600):
    """n processes that used `tpu` (then n that used `cpu`) held open: what
    a tpu process holds beyond a CPU one, and what tpud grows by per session
    while they are open (and its CPU seconds per session, open to close)."""
    held, grown = {}, None
    for dev in ("cpu", "tpu"):
        before = tree_usage(daemon_pid)
        procs = [subprocess.Popen([sys.executable, "-c", HOLDER, dev], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for _ in range(n)]
        try:
            reports = [p.stdout.readline().split() for p in procs]
            if any(len(r) != 3 for r in reports):
                sys.exit(f"lifecycle_bench: a {dev} holder failed")
            time.sleep(0.5)  # tpud's own bookkeeping of the new sessions
            during = tree_usage(daemon_pid)
        finally:
            for p in procs:
                p.communicate("go\n", timeout=timeout)
        time.sleep(0.5)
        after = tree_usage(daemon_pid)
        held[dev] = [statistics.median(int(r[i]) for r in reports) for i in range(3)]
        if dev == "tpu":
            grown = {k: (during[k] - before[k]) / n
                     for k in ("private", "shared", "fds", "threads")}
            grown["cpu"] = (after["cpu"] - before["cpu"]) / n
    return held, grown


def import_cost(env, autoload, rounds):
    code = ("import resource, time; t = time.perf_counter(); import torch; "
            "print(time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    e = dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    secs, rss = [], []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", code], env=e, check=True,
                             capture_output=True, text=True, timeout=300).stdout.split()
        secs.append(float(out[0]))
        rss.append(int(out[1]) * 1024)
    return statistics.median(secs), statistics.median(rss)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reduced", action="store_true",
                   help="2 processes for first_ops_16 and 2 rounds, 4 short jobs, "
                   "40 tests in 2 workers (CI)")
    args = p.parse_args()
    many = 2 if args.reduced else 16
    rounds = 2 if args.reduced else args.rounds
    jobs = 4 if args.reduced else 64
    tests, workers = (40, 2) if args.reduced else (200, 8)
    daemon = TpudProcess(args.tpud, "4GiB", [], prefix="tpud-lifecycle.")
    daemon.start(timeout=30)
    try:
        env = dict(os.environ, TPUD_SOCKET=daemon.socket)
        one = {dev: statistics.median(
            [run_batch(dev, 1, env)[0] for _ in range(rounds)]) for dev in ("cpu", "tpu")}
        print(json.dumps({
            "name": "first_ops_1", "tpu_seconds": round(one["tpu"], 6),
            "cpu_seconds": round(one["cpu"], 6),
            "tpu_over_cpu": round(one["tpu"] / one["cpu"], 2),
            "target": "tpu <= 5x cpu and < 0.020 s",
            "work": "a new process's first 100 x = x * 0.5 + 1 and .item()"}), flush=True)
        # One batch's median swings 2x from batch to batch on 2 cores: the
        # median process of --rounds batches per device, taken in turn.
        pooled = {"cpu": [], "tpu": []}
        for _ in range(rounds):
            for dev in ("cpu", "tpu"):
                pooled[dev] += run_batch(dev, many, env)
        batch = {dev: statistics.median(pooled[dev]) for dev in ("cpu", "tpu")}
        print(json.dumps({
            "name": f"first_ops_{many}", "tpu_seconds": round(batch["tpu"], 6),
            "cpu_seconds": round(batch["cpu"], 6),
            "tpu_over_cpu": round(batch["tpu"] / batch["cpu"], 2),
            "target": "tpu <= 10x cpu" if many == 16 else None,
            "batches": rounds,
            "work": f"{many} imported processes released together: median first 100 ops"}),
            flush=True)
        with_tpu = import_cost(env, True, rounds)
        without = import_cost(env, False, rounds)
        print(json.dumps({
            "name": "import_overhead", "seconds_with": round(with_tpu[0], 4),
            "seconds_without": round(without[0], 4),
            "rss_with_bytes": with_tpu[1], "rss_without_bytes": without[1],
            "work": "import torch, torch_tpu autoloaded against not"}), flush=True)
        short = {dev: short_jobs(dev, jobs, env) for dev in ("cpu", "tpu")}
        print(json.dumps({
            "name": f"short_jobs_{jobs}", "tpu_seconds": round(short["tpu"]["seconds"], 3),
            "cpu_seconds": round(short["cpu"]["seconds"], 3),
            "tpu_over_cpu": round(short["tpu"]["seconds"] / short["cpu"]["seconds"], 2),
            "target": "tpu <= 1.25x cpu" if jobs == 64 else None,
            **{f"{dev}_{what}_median_seconds": round(short[dev][what], 4)
               for dev in ("tpu", "cpu") for what in ("import", "first_ops")},
            **{f"{dev}_last_done_to_last_exit_seconds":
               round(short[dev]["last_done_to_last_exit"], 4) for dev in ("tpu", "cpu")},
            "processes": jobs,
            "work": f"{jobs} new processes started at once, each import torch, 100 ops, "
                    ".item(), exit: first start to last exit"}), flush=True)
        suite = {dev: run_test_suite(dev, tests, workers, env) for dev in ("cpu", "tpu")}
        print(json.dumps({
            "name": f"test_suite_{workers}", "tpu_seconds": round(suite["tpu"], 3),
            "cpu_seconds": round(suite["cpu"], 3),
            "tpu_over_cpu": round(suite["tpu"] / suite["cpu"], 2),
            "target": "tpu <= 1.5x cpu" if workers == 8 else None,
            "tests": tests, "workers": workers,
            "work": f"a generated suite of {tests} small tests in {workers} pytest processes "
                    "started together, a shard each: start to last exit"}), flush=True)
        n = 4 if args.reduced else 16
        held, grown = session_cost(daemon.proc.pid, env, n)
        print(json.dumps({
            "name": "session_cost",
            "client_fds_added": held["tpu"][0] - held["cpu"][0],
            "client_threads_added": held["tpu"][1] - held["cpu"][1],
            "client_rss_added_bytes": held["tpu"][2] - held["cpu"][2],
            "daemon_private_bytes_per_session": round(grown["private"]),
            "daemon_session_memory_bytes_per_session": round(grown["shared"]),
            "daemon_fds_per_session": grown["fds"],
            "daemon_threads_per_session": grown["threads"],
            "daemon_cpu_seconds_per_session": round(grown["cpu"], 4),
            "sessions": n,
            "work": f"{n} processes that made a tensor and read it, held open: a tpu "
                    "process's descriptors, threads and resident bytes beyond a CPU "
                    "one's (medians), and tpud's growth per session (its CPU time "
                    "from open to close)"}), flush=True)
    finally:
        daemon.close()


if __name__ == "__main__":
    main()
