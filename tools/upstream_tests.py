#!/usr/bin/env python3
"""Runs PyTorch's own device-generic test files on "tpu" and on the CPU.

PyTorch's test/test_*.py files build their tests with common_device_type's
instantiate_device_type_tests, which, with torch_tpu installed (autoloaded),
also makes a PrivateUse1 class per generic class: TestFooPRIVATEUSE1 (or
TestFooTPU) with test_x_tpu_float32 beside TestFooCPU's test_x_cpu_float32.
Each file runs in pytest (cwd --tests-dir) once per device, tpu first, with
PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1 or =cpu. Tests are matched across
devices by their names with the device swapped. A new process must be able to
compute on tpu before anything runs.

The daemon: --socket PATH uses a running tpud; else --tpud PATH starts one of
our own; else, when TPUD_SOCKET is set, that daemon is used; else the tool
starts bazel-bin/daemon/tpud. Ours is restarted when it dies; one that is not
ours ends the tpu runs when it goes. The report says either way.

Supervision: a pytest plugin (this module, loaded with -p) writes a JSON line
before and after every test. A test that kills the interpreter is `crashed`
(signal or exit code); one without progress for --timeout seconds is `hung`,
its process group killed. Either way pytest starts again on that file and
device with every recorded test deselected, up to --max-restarts times.
Without expecttest installed, a stand-in makes its inline expects skip.

Report (stdout table; JSON with --report), per file and in total: tests
instantiated for tpu, run (got an outcome), passed, failed (failures and
errors), crashed, hung, skipped, xfailed, xpassed, the same for the CPU;
cpu_passed; pass_rate: of the tests that pass on the CPU and are not skipped on
tpu, the share that pass on tpu; the CPU-passing tests skipped on tpu and why;
wall seconds per device; the tpu-only failures, their causes (exception type
and first message line, with numbers, shapes, dtypes and quoted names blanked)
grouped, most frequent first.

  .venv/bin/python tools/upstream_tests.py --tests-dir ~/pytorch/test \\
      --files test_view_ops.py --max-tests 200 --report view.json

Exit status: 0 when the run completed (failing tests included), 2 on usage
errors, 1 when the tool failed (or no process could use tpu).
"""
import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
from tpud_process import TpudProcess, can_connect  # noqa: E402
DEFAULT_TPUD = ROOT / "bazel-bin" / "daemon" / "tpud"
DEFAULT_FILES = ("test_binary_ufuncs.py,test_unary_ufuncs.py,test_reductions.py,"
                 "test_view_ops.py,test_indexing.py,test_shape_ops.py,test_ops.py,test_nn.py,"
                 "test_sort_and_select.py,test_tensor_creation_ops.py")
ONLY_FOR = {"tpu": "privateuse1", "cpu": "cpu"}
COLLECT_TIMEOUT_S = 600

# --- names and causes -------------------------------------------------------


def spread(items, n):
    """n of `items` spread evenly over the whole list (all of them when n is 0
    or more than there are): a file's tests come grouped by class and
    decorator, so its first n would be one corner of it (test_ops' first
    hundreds are CUDA-only)."""
    if not n or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def for_device(nodeid, device):
    """`nodeid` as the run on `device` names it: the device suffix of the class
    (TestFooCPU) and the last device token of the test (test_x_cpu_float32)."""
    parts = nodeid.split("::")
    if len(parts) >= 3:
        parts[-2] = re.sub(r"(CPU|TPU|PRIVATEUSE1)$", device.upper(), parts[-2])
    if len(parts) >= 2:
        parts[-1] = re.sub(r"^(.*)_(?:cpu|tpu|privateuse1)(?=_|\[|$)", rf"\1_{device}", parts[-1])
    return "::".join(parts)


_DTYPE = (r"\b(?:torch\.)?(?:b?float\d+(?:_e\d+m\d+(?:fnuz|fn)?)?|q?u?int\d+|complex\d+|bool"
          r"|half|double|cfloat|cdouble|long|short)\b|\b(?:BFloat16|ComplexFloat|ComplexDouble"
          r"|ComplexHalf|Float|Double|Half|Long|Int|Short|Char|Byte|Bool|Q?U?Int\d+)\b")
_NORMALIZE = [
    (re.compile(r"(?<!\w)(?:'[^']*'|\"[^\"]*\"|`[^`]*`)(?!\w)"), "<name>"),
    (re.compile(r"torch\.Size\(\[[^\]]*\]\)"), "<shape>"),
    (re.compile(r"[\[(]\s*-?\d+(?:\s*,\s*-?\d+)*\s*,?\s*[\])]"), "<shape>"),
    (re.compile(_DTYPE), "<dtype>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<n>"),
    (re.compile(r"(?<![\w.<])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w>])"), "<n>"),
    (re.compile(r"\s+"), " "),
]


def normalize_text(text):
    """`text` with numbers, shapes, dtypes and quoted names replaced by placeholders."""
    text = (text or "").strip()
    for pattern, repl in _NORMALIZE:
        text = pattern.sub(repl, text)
    return text.strip()[:200]


def normalize_cause(exc_type, message):
    """`ExcType: first message line`, normalized, so that one cause groups many tests."""
    text = normalize_text(message)
    return f"{exc_type}: {text}" if text else str(exc_type)


# --- the pytest plugin (runs inside each pytest process) --------------------


def _stub_expecttest():
    try:
        import expecttest  # noqa: F401
        return False
    except ImportError:
        import types
        import unittest

        class TestCase(unittest.TestCase):
            def assertExpectedInline(self, *args, **kwargs):
                raise unittest.SkipTest("expecttest is not installed")

            assertExpectedRaisesInline = assertExpectedInline

        mod = types.ModuleType("expecttest")
        mod.TestCase, mod.ACCEPT = TestCase, False
        sys.modules["expecttest"] = mod
        return True


def _read_lines(path):
    return set(filter(None, pathlib.Path(path).read_text().splitlines())) if path else set()


def _first_line(text):
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:500]
    return ""


def make_recorder():
    import pytest

    env = os.environ

    class Recorder:
        def __init__(self):
            self.out = open(env["UPSTREAM_TESTS_RECORDS"], "a", buffering=1)
            self.done = _read_lines(env.get("UPSTREAM_TESTS_DONE"))
            select = env.get("UPSTREAM_TESTS_SELECT")
            self.select = {for_device(n, "cpu") for n in _read_lines(select)} if select else None
            self.max_tests = int(env.get("UPSTREAM_TESTS_MAX") or 0)
            self.failures = {}
            self.result = {}
            self.write(event="session", expecttest_stub=_stub_expecttest(), pid=os.getpid())

        def write(self, **record):
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, config, items):
            collected = [item.nodeid for item in items]
            if self.select is not None:
                keep = [i for i in items if for_device(i.nodeid, "cpu") in self.select]
            else:
                keep = spread(items, self.max_tests)
            self.write(event="collected", nodeids=collected,
                       selected=[item.nodeid for item in keep])
            run = [item for item in keep if item.nodeid not in self.done]
            kept = {id(item) for item in run}
            deselected = [item for item in items if id(item) not in kept]
            if deselected:
                config.hook.pytest_deselected(items=deselected)
            items[:] = run

        def pytest_collectreport(self, report):
            if report.failed:
                text = str(report.longrepr).strip().splitlines()
                errors = [line for line in text if line.startswith("E ")]
                self.write(event="collect_error", nodeid=report.nodeid,
                           message=(errors or text or ["?"])[-1][:500],
                           detail="\n".join(text[-30:]))

        def pytest_runtest_logstart(self, nodeid, location):
            self.result = {"outcome": "passed", "duration": 0.0}
            self.write(event="started", nodeid=nodeid, t=time.time())

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            outcome = yield
            report = outcome.get_result()
            if report.failed and call.excinfo is not None:
                where = ""
                try:
                    for entry in reversed(call.excinfo.traceback):
                        if str(entry.path) == str(item.path):
                            where = _first_line(entry.statement)
                            break
                except Exception:
                    pass
                self.failures.setdefault(item.nodeid, {
                    "exc_type": call.excinfo.typename, "where": where,
                    "message": _first_line(call.excinfo.value), "when": call.when})

        def pytest_runtest_logreport(self, report):
            r = self.result
            r["duration"] += report.duration
            xfail = hasattr(report, "wasxfail")
            if report.skipped and r["outcome"] == "passed":
                r["outcome"] = "xfailed" if xfail else "skipped"
                reason = report.wasxfail if xfail else report.longrepr
                if isinstance(reason, tuple):
                    reason = reason[2]
                r["reason"] = _first_line(str(reason)).removeprefix("Skipped: ")
            elif report.failed and r["outcome"] in ("passed", "xpassed"):
                r["outcome"] = "failed" if report.when == "call" else "error"
            elif report.when == "call" and report.passed and xfail:
                r["outcome"] = "xpassed"

        def pytest_runtest_logfinish(self, nodeid, location):
            record = dict(self.result, event="finished", nodeid=nodeid)
            record.update(self.failures.pop(nodeid, {}))
            self.write(**record)

    return Recorder()


def pytest_configure(config):
    if os.environ.get("UPSTREAM_TESTS_RECORDS"):
        config.pluginmanager.register(make_recorder(), "upstream_tests_recorder")


# --- the daemon -------------------------------------------------------------


class Daemon:
    """The tpud the tpu runs talk to: our own (restarted when found dead) or
    the one at a socket given to us."""

    def __init__(self, binary=None, flags=(), hbm="4GiB", socket=None):
        self.binary, self.flags, self.hbm, self.socket = binary, list(flags), hbm, socket
        self.proc = None
        self.events = []

    def start(self):
        if self.binary:
            self.proc = TpudProcess(self.binary, self.hbm, self.flags,
                                    prefix="tpud-upstream.", log_to_file=True)
            self.proc.start(timeout=30)
            self.socket = self.proc.socket

    def env(self, base):
        if self.proc:
            return self.proc.env(base)
        base["TPUD_SOCKET"] = self.socket
        return base

    def gone(self):
        """None while it serves, else what happened to it."""
        if self.proc:
            if self.proc.alive():
                return None
            tail = self.proc.log_tail(3)
            return f"tpud exited with {self.proc.proc.returncode}" + (f": {tail}" if tail else "")
        return None if can_connect(self.socket) else f"tpud at {self.socket} does not answer"

    def check(self, where):
        """Records a death; restarts our own. Whether it serves now."""
        what = self.gone()
        if what is None:
            return True
        event = {"during": where, "what": what, "restarted": False}
        self.events.append(event)
        if self.proc:
            self.proc.close()
            self.start()
            event["restarted"] = True
        return event["restarted"]

    def close(self):
        if self.proc:
            self.proc.close()


def check_tpu(env):
    """Fails the run early when a new process cannot compute on tpu (no daemon,
    or one that torch_tpu cannot talk to): else every tpu test would fail."""
    code = "import torch; t = torch.ones(2, device='tpu'); assert (t + t).sum().item() == 4"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines() or [f"exit code {r.returncode}"]
        raise RuntimeError(f"the tpu device does not work: {lines[-1]}")


# --- the supervisor ---------------------------------------------------------


def _signal_text(rc):
    if rc is not None and rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def _tail(path, n=8):
    """The end of a pytest log; from faulthandler's last stack dump (a crash, or
    pytest's faulthandler_timeout) its first lines, the innermost frames."""
    try:
        lines = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    dumps = [i for i, line in enumerate(lines)
             if line.startswith(("Fatal Python error", "Timeout ("))]
    return "\n".join(lines[dumps[-1]:dumps[-1] + n] if dumps else lines[-n:])


def run_pytest(args, file, device, env, work, attempt, daemon):
    """One pytest process; returns the records it wrote and how it ended."""
    records = work / f"{file}.{device}.{attempt}.jsonl"
    log = work / f"{file}.{device}.{attempt}.log"
    cmd = [sys.executable, "-m", "pytest", "-p", "upstream_tests", "-p", "no:cacheprovider",
           "-q", "--tb=short", "-c", str(work / "pytest.ini"), "--rootdir", str(args.tests_dir),
           "-o", f"faulthandler_timeout={max(1, int(args.timeout * 0.9))}", file]
    if args.k:
        cmd += ["-k", args.k]
    env = dict(env, UPSTREAM_TESTS_RECORDS=str(records))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=args.tests_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    result = {"records": [], "current": None, "hung": False, "tpud": None, "log": log}
    try:
        return watch(proc, records, args.timeout, daemon, result)
    finally:
        kill_group(proc)


def kill_group(proc):
    """Kills pytest and whatever it started that is still in its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def watch(proc, records, timeout, daemon, result):
    """Follows the records until pytest exits; kills it when it makes no
    progress for `timeout` seconds (longer while collecting) or tpud dies."""
    offset, polls, last_progress = 0, 0, time.time()
    limit = max(timeout, COLLECT_TIMEOUT_S)
    while True:
        exited = proc.poll() is not None
        with open(records, "ab+") as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.decode().splitlines():
            rec = json.loads(line)
            result["records"].append(rec)
            if rec["event"] != "session":
                last_progress = time.time()
            if rec["event"] in ("started", "collected"):
                limit = timeout
            if rec["event"] in ("started", "finished"):
                result["current"] = rec["nodeid"] if rec["event"] == "started" else None
        if exited:
            break
        polls += 1
        if time.time() - last_progress > limit:
            result["hung"] = True
        elif daemon is not None and polls % 10 == 0:
            result["tpud"] = daemon.gone()
        if result["hung"] or result["tpud"]:
            kill_group(proc)
            continue
        time.sleep(0.1)
    result["rc"] = proc.returncode
    return result


def run_file(args, file, device, daemon, work, select):
    """Every test of `file` on `device` (those matching `select`, when given)
    across as many pytest processes as crashes and hangs need."""
    run = {"results": {}, "collected": None, "selected": None, "restarts": 0,
           "gave_up": None, "collection_error": None, "events": [], "expecttest_stub": False}
    (work / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTORCH_TESTING_DEVICE_ONLY_FOR=ONLY_FOR[device])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOOLS), env.get("PYTHONPATH")]))
    env.pop("PYTEST_ADDOPTS", None)
    env["UPSTREAM_TESTS_DONE"] = str(work / "done.txt")
    if select is not None:
        (work / "select.txt").write_text("".join(n + "\n" for n in select))
        env["UPSTREAM_TESTS_SELECT"] = str(work / "select.txt")
    elif args.max_tests:
        env["UPSTREAM_TESTS_MAX"] = str(args.max_tests)
    start = time.time()
    for attempt in range(args.max_restarts + 1):
        run["restarts"] = attempt
        where = f"before {file}" if attempt == 0 else f"{file}, before restart {attempt}"
        if daemon is not None and not daemon.check(where):
            run["gave_up"] = f"tpud is gone: {daemon.events[-1]['what']}"
            break
        (work / "done.txt").write_text("".join(n + "\n" for n in run["results"]))
        res = run_pytest(args, file, device, daemon.env(env) if daemon else env, work, attempt,
                         daemon)
        for rec in res["records"]:
            if rec["event"] == "finished":
                run["results"][rec["nodeid"]] = rec
            elif rec["event"] == "session":
                run["expecttest_stub"] |= rec["expecttest_stub"]
            elif rec["event"] == "collected" and run["collected"] is None:
                run["collected"], run["selected"] = rec["nodeids"], rec["selected"]
                if select is None:
                    select = rec["selected"]
                    (work / "select.txt").write_text("".join(n + "\n" for n in select))
                    env["UPSTREAM_TESTS_SELECT"] = str(work / "select.txt")
            elif rec["event"] == "collect_error":
                run["collection_error"] = {"message": rec["message"], "detail": rec["detail"]}
        if run["collection_error"]:
            break
        current = res["current"]
        if res["hung"]:
            how = "hung"
            detail = f"no progress in {args.timeout:g} s" if current else "hung while collecting"
        elif res["tpud"]:
            how, detail = "crashed", res["tpud"]
            run["events"].append(f"tpud died during {current or 'no test'}: {res['tpud']}")
        else:
            how, detail = "crashed", _signal_text(res["rc"])
        if run["collected"] is None:
            run["collection_error"] = {"message": f"pytest {how} while collecting ({detail})",
                                       "detail": _tail(res["log"], 30)}
            break
        if current is not None:
            run["results"][current] = {"nodeid": current, "outcome": how, "detail": detail,
                                       "log_tail": _tail(res["log"])}
        elif res["rc"] not in (0, 1, 5):
            run["events"].append(f"pytest ended with {_signal_text(res['rc'])} outside a test")
        remaining = set(run["selected"]) - set(run["results"])
        if not remaining:
            break
        if current is None and not res["tpud"]:
            run["events"].append(f"pytest {'hung' if res['hung'] else 'ended'} outside a test, "
                                 f"leaving {len(remaining)} tests unrun")
            break
    else:
        run["gave_up"] = f"gave up after {args.max_restarts} restarts"
    run["wall_s"] = round(time.time() - start, 2)
    return run


# --- the report -------------------------------------------------------------


def device_counts(run):
    outcomes = collections.Counter(r["outcome"] for r in run["results"].values())
    counts = {"instantiated": len(run["collected"] or []), "selected": len(run["selected"] or []),
              "run": len(run["results"]), "failed": outcomes["failed"] + outcomes["error"]}
    for key in ("passed", "crashed", "hung", "skipped", "xfailed", "xpassed"):
        counts[key] = outcomes[key]
    for key in ("wall_s", "restarts", "gave_up", "collection_error", "events"):
        counts[key] = run[key]
    return counts


def merge(runs):
    """One run of every file's tests (their nodeids name the file)."""
    out = {"results": {}, "collected": [], "selected": [], "wall_s": 0.0, "restarts": 0,
           "gave_up": None, "collection_error": None, "events": []}
    for run in runs:
        out["results"].update(run["results"])
        out["collected"] += run["collected"] or []
        out["selected"] += run["selected"] or []
        out["wall_s"] = round(out["wall_s"] + run["wall_s"], 2)
        out["restarts"] += run["restarts"]
    return out


def cause_of(record):
    if record["outcome"] in ("crashed", "hung"):
        return f"{record['outcome']}: {normalize_text(record['detail'])}"
    return normalize_cause(record.get("exc_type", "?"), record.get("message", ""))


def top_causes(failures, examples=3):
    groups = collections.defaultdict(list)
    for f in failures:
        groups[f["cause"]].append(f["test"])
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return [{"cause": c, "count": len(t), "examples": t[:examples]} for c, t in ranked]


def compare(tpu, cpu):
    """The tpu results against the CPU's: pass rate, skips and tpu-only failures."""
    if tpu is None or cpu is None:
        return {}
    cpu_passing = [n for n, r in cpu["results"].items() if r["outcome"] == "passed"]
    on_tpu = {for_device(n, "cpu"): n for n in tpu["collected"] or []}
    compared, passed, skipped, failures = 0, 0, [], []
    for nodeid in filter(None, (on_tpu.get(n) for n in cpu_passing)):
        rec = tpu["results"].get(nodeid, {"outcome": "not run"})
        if rec["outcome"] == "skipped":
            skipped.append({"test": nodeid, "reason": rec.get("reason", "")})
            continue
        compared += 1
        passed += rec["outcome"] == "passed"
        if rec["outcome"] in ("failed", "error", "crashed", "hung"):
            failures.append({"test": nodeid, "outcome": rec["outcome"], "cause": cause_of(rec),
                             **{k: rec.get(k, "") for k in ("message", "where", "detail")}})
    share = round(len(skipped) / len(cpu_passing), 4) if cpu_passing else None
    ratio = round(tpu["wall_s"] / cpu["wall_s"], 2) if cpu["wall_s"] else None
    return {"cpu_passed": len(cpu_passing), "compared": compared,
            "tpu_passed_of_compared": passed,
            "pass_rate": round(passed / compared, 4) if compared else None,
            "skipped_on_tpu_passing_on_cpu": {"count": len(skipped), "share": share,
                                              "tests": skipped},
            "wall_ratio_tpu_cpu": ratio,
            "top_causes": top_causes(failures), "tpu_only_failures": failures}


TABLE = (("inst", "instantiated"), ("run", "run"), ("pass", "passed"), ("fail", "failed"),
         ("crash", "crashed"), ("hung", "hung"), ("skip", "skipped"), ("xfail", "xfailed"),
         ("xpass", "xpassed"))


def print_report(report):
    print("tpu counts | CPU instantiated, passed | rate: tpu passes of the CPU-passing tests "
          "not skipped on tpu | skip*: CPU-passing tests skipped on tpu | wall seconds")
    print(f"{'file':28} " + " ".join(f"{h:>5}" for h, _ in TABLE)
          + f" | {'inst':>5} {'pass':>5} | {'rate':>6} {'skip*':>5} | tpu/cpu")
    for name, e in list(report["files"].items()) + [("total", report["total"])]:
        t, c, cmp = e.get("tpu") or {}, e.get("cpu") or {}, e.get("compare") or {}
        rate = "" if cmp.get("pass_rate") is None else f"{100 * cmp['pass_rate']:.1f}%"
        skip = (cmp.get("skipped_on_tpu_passing_on_cpu") or {}).get("count", "")
        ratio = f" ({cmp['wall_ratio_tpu_cpu']}x)" if cmp.get("wall_ratio_tpu_cpu") else ""
        if any((e.get(d) or {}).get("collection_error") for d in ("tpu", "cpu")):
            print(f"{name[:28]:28} collection failed (below)")
            continue
        print(f"{name[:28]:28} " + " ".join(f"{t.get(k, ''):>5}" for _, k in TABLE)
              + f" | {c.get('instantiated', ''):>5} {c.get('passed', ''):>5} | {rate:>6} "
              f"{skip:>5} | {t.get('wall_s', '-')}/{c.get('wall_s', '-')}{ratio}")
    for name, e in report["files"].items():
        if e.get("missing"):
            print(f"{name}: not found in the tests folder")
        for device, d in ((k, e[k]) for k in ("tpu", "cpu") if e.get(k)):
            notes = d["events"] + [d["gave_up"]] * bool(d["gave_up"])
            if d["collection_error"]:
                notes.append(f"collection failed: {d['collection_error']['message']}")
            for note in notes:
                print(f"{name} ({device}): {note}")
    for event in report["tpud"]["events"]:
        print(f"tpud: {event['what']} (noticed {event['during']}; "
              f"{'restarted' if event['restarted'] else 'not restarted'})")
    causes = (report["total"].get("compare") or {}).get("top_causes")
    if causes:
        print("top causes of tpu-only failures:")
        for c in causes[:15]:
            print(f"  {c['count']:5}  {c['cause']}\n         e.g. {', '.join(c['examples'])}")


# --- main -------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tests-dir", required=True, type=pathlib.Path,
                   help="folder of PyTorch's test files (pytest runs there)")
    p.add_argument("--files", default=DEFAULT_FILES, help="comma-separated test files")
    p.add_argument("--devices", default="cpu,tpu", help="cpu, tpu or both (default)")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("--max-tests", type=int, default=0,
                   help="run only N tests per file, spread evenly over the collected ones "
                   "(the tpu run picks them)")
    p.add_argument("--timeout", type=float, default=300, help="seconds without progress: hung")
    p.add_argument("--max-restarts", type=int, default=50,
                   help="pytest restarts per file and device before giving up (50)")
    p.add_argument("--report", type=pathlib.Path, help="JSON report")
    p.add_argument("--logs", type=pathlib.Path, help="keep pytest's output and records here")
    p.add_argument("--tpud", help=f"tpud binary to start (default {DEFAULT_TPUD})")
    p.add_argument("--tpud-flag", action="append", default=[], help="extra tpud flag (repeatable)")
    p.add_argument("--hbm", default="4GiB", help="--hbm_bytes of our tpud (4GiB)")
    p.add_argument("--socket", help="use the tpud serving at this socket")
    args = p.parse_args(argv)
    args.files = [f.strip() for f in args.files.split(",") if f.strip()]
    devices = {d.strip() for d in args.devices.split(",") if d.strip()}
    if not devices or devices - set(ONLY_FOR):
        p.error(f"--devices: cpu and/or tpu, not {args.devices!r}")
    args.devices = [d for d in ("tpu", "cpu") if d in devices]
    if not args.tests_dir.is_dir():
        p.error(f"--tests-dir {args.tests_dir}: not a folder")
    args.tests_dir = args.tests_dir.resolve()
    if args.socket and args.tpud:
        p.error("--socket and --tpud exclude each other")
    if not args.socket and not args.tpud and os.environ.get("TPUD_SOCKET"):
        args.socket = os.environ["TPUD_SOCKET"]
    if "tpu" in args.devices and not args.socket:
        args.tpud = args.tpud or str(DEFAULT_TPUD)
        if not os.access(args.tpud, os.X_OK):
            p.error(f"--tpud {args.tpud}: not an executable (build //daemon:tpud)")
    if args.max_tests < 0 or args.timeout <= 0 or args.max_restarts < 0:
        p.error("--max-tests, --timeout and --max-restarts must not be negative")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    daemon = None
    if "tpu" in args.devices:
        daemon = Daemon(None if args.socket else args.tpud, args.tpud_flag, args.hbm, args.socket)
        try:
            daemon.start()
            check_tpu(daemon.env(dict(os.environ)))
        except (RuntimeError, subprocess.SubprocessError) as e:
            daemon.close()
            raise SystemExit(f"upstream_tests: {e}")
    work = pathlib.Path(tempfile.mkdtemp(prefix="upstream-tests."))
    report = {"tests_dir": str(args.tests_dir), "devices": args.devices, "k": args.k,
              "max_tests": args.max_tests, "timeout_s": args.timeout,
              "tpud": {"socket": daemon.socket if daemon else None,
                       "own": bool(daemon and daemon.proc), "events": []},
              "files": {}}
    all_runs = {device: [] for device in args.devices}
    try:
        for file in args.files:
            entry = report["files"][file] = {}
            if not (args.tests_dir / file).is_file():
                entry["missing"] = True
                continue
            runs, select = {}, None
            for device in args.devices:
                fwork = work / f"{file}.{device}"
                fwork.mkdir()
                run = runs[device] = run_file(args, file, device,
                                              daemon if device == "tpu" else None, fwork, select)
                if args.max_tests and run["selected"] and not run["collection_error"]:
                    select = run["selected"]
                all_runs[device].append(run)
                entry[device] = device_counts(run)
                print(f"{file} ({device}): {len(run['results'])} tests in {run['wall_s']} s",
                      flush=True)
            entry["compare"] = compare(runs.get("tpu"), runs.get("cpu"))
            entry["results"] = {d: r["results"] for d, r in runs.items()}
    finally:
        if daemon:
            report["tpud"]["events"] = daemon.events
            daemon.close()
        if args.logs:
            shutil.copytree(work, args.logs, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    merged = {device: merge(runs) for device, runs in all_runs.items()}
    report["expecttest_stub"] = any(r["expecttest_stub"] for rs in all_runs.values() for r in rs)
    report["total"] = {device: device_counts(run) for device, run in merged.items()}
    report["total"]["compare"] = compare(merged.get("tpu"), merged.get("cpu"))
    report["total"]["compare"].pop("tpu_only_failures", None)
    report["total"]["compare"].get("skipped_on_tpu_passing_on_cpu", {}).pop("tests", None)
    print_report(report)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
