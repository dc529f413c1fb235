"""tools/upstream_tests.py on a small suite written in PyTorch's style.

test_mini.py instantiates its tests through common_device_type, as PyTorch's
own test files do, so the PrivateUse1 (tpu) class comes from the same path; a
few of its tests crash, hang or fail on tpu only. One run of the tool over it
(and over a file that fails at import, and one that is missing) with a tpud
started here gives the report the tests below check.
"""
import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, Daemon

import upstream_tests
from upstream_tests import for_device, normalize_cause

HANG_TIMEOUT_S = 20
# One instantiate_device_type_tests call: the class keeps PrivateUse1's name
# (later calls in a file see the backend's, "TPU").
TPU_CLASS = "test_mini.py::TestMiniPRIVATEUSE1"

MINI = '''
import os
import time

import torch
from torch.testing._internal.common_device_type import (
    dtypes, instantiate_device_type_tests, onlyCPU, skipPRIVATEUSE1If)
from torch.testing._internal.common_utils import TestCase, run_tests


class TestMini(TestCase):
    @dtypes(torch.float32, torch.int64)
    def test_binary(self, device, dtype):
        a = torch.arange(4, device=device, dtype=dtype)
        self.assertEqual(a + a, torch.arange(0, 8, 2, dtype=dtype))
        self.assertEqual(a * a, torch.tensor([0, 1, 4, 9], dtype=dtype))

    def test_sum(self, device):
        self.assertEqual(torch.ones(2, 3, device=device).sum(1), torch.full((2,), 3.0))

    def test_view(self, device):
        a = torch.arange(6, device=device)
        self.assertEqual(a.view(2, 3)[1], torch.tensor([3, 4, 5]))

    def test_index(self, device):
        a = torch.arange(5, device=device)
        self.assertEqual(a[torch.tensor([0, 2], device=device)], torch.tensor([0, 2]))
        self.assertEqual(a[a > 2], torch.tensor([3, 4]))

    def test_shape_error(self, device):
        with self.assertRaisesRegex(RuntimeError, "must match the size"):
            torch.add(torch.ones(2, device=device), torch.ones(3, device=device))

    @onlyCPU
    def test_cpu_only(self, device):
        pass

    @skipPRIVATEUSE1If(True, "mini: not for privateuse1")
    def test_skip_tpu(self, device):
        pass

    def test_crash(self, device):
        if device.startswith("tpu"):
            os.abort()

    def test_exit(self, device):
        if device.startswith("tpu"):
            os._exit(3)

    def test_hang(self, device):
        if device.startswith("tpu"):
            time.sleep(3600)

    def test_is_cpu(self, device):
        self.assertEqual(torch.ones(1, device=device).device.type, "cpu")


instantiate_device_type_tests(TestMini, globals())

if __name__ == "__main__":
    run_tests()
'''

BROKEN = '''
import torch
import no_such_module_for_upstream_tests  # noqa: F401
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tests = tmp_path_factory.mktemp("upstream")
    (tests / "test_mini.py").write_text(textwrap.dedent(MINI))
    (tests / "test_broken.py").write_text(textwrap.dedent(BROKEN))
    path = tests / "report.json"
    d = Daemon()
    try:
        r = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "upstream_tests.py"), "--tests-dir", str(tests),
             "--files", "test_mini.py,test_broken.py,test_absent.py", "--socket", d.socket,
             "--timeout", str(HANG_TIMEOUT_S), "--report", str(path)],
            capture_output=True, text=True, timeout=300)
    finally:
        d.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(path.read_text())
    rep["stdout"] = r.stdout
    return rep


def outcomes(rep, device):
    results = rep["files"]["test_mini.py"]["results"][device]
    return {nodeid.split("::")[-1]: rec["outcome"] for nodeid, rec in results.items()}


def test_counts_per_device(report):
    mini = report["files"]["test_mini.py"]
    tpu, cpu = mini["tpu"], mini["cpu"]
    assert {k: tpu[k] for k in ("instantiated", "run", "passed", "failed", "crashed", "hung",
                                "skipped", "xfailed", "xpassed")} == {
        "instantiated": 12, "run": 12, "passed": 6, "failed": 1, "crashed": 2, "hung": 1,
        "skipped": 2, "xfailed": 0, "xpassed": 0}
    assert cpu["instantiated"] == 12 and cpu["passed"] == 12 and cpu["run"] == 12
    assert tpu["restarts"] == 3 and tpu["gave_up"] is None and cpu["restarts"] == 0
    assert tpu["wall_s"] > HANG_TIMEOUT_S and cpu["wall_s"] > 0


def test_crash_and_hang_do_not_stop_the_run(report):
    tpu = outcomes(report, "tpu")
    assert tpu["test_crash_tpu"] == "crashed" and tpu["test_exit_tpu"] == "crashed"
    assert tpu["test_hang_tpu"] == "hung"
    # Run after the crashes and the hang (unittest order is by name).
    assert tpu["test_index_tpu"] == tpu["test_shape_error_tpu"] == "passed"
    assert tpu["test_sum_tpu"] == tpu["test_view_tpu"] == "passed"
    assert tpu["test_is_cpu_tpu"] == "failed"
    results = report["files"]["test_mini.py"]["results"]["tpu"]
    details = {k.split("::")[-1]: r.get("detail") for k, r in results.items()}
    assert details["test_crash_tpu"] == "signal SIGABRT"
    assert details["test_exit_tpu"] == "exit code 3"
    assert details["test_hang_tpu"] == f"no progress in {HANG_TIMEOUT_S} s"
    assert set(outcomes(report, "cpu").values()) == {"passed"}
    assert report["tpud"]["events"] == []


def test_comparison(report):
    cmp = report["files"]["test_mini.py"]["compare"]
    assert cmp["cpu_passed"] == 12
    # 12 pass on the CPU, 2 of them are skipped on tpu, 6 of the other 10 pass.
    assert cmp["compared"] == 10 and cmp["pass_rate"] == 0.6
    skipped = cmp["skipped_on_tpu_passing_on_cpu"]
    assert skipped["count"] == 2 and skipped["share"] == round(2 / 12, 4)
    reasons = {s["test"]: s["reason"] for s in skipped["tests"]}
    assert reasons == {f"{TPU_CLASS}::test_cpu_only_tpu": "Only runs on cpu",
                       f"{TPU_CLASS}::test_skip_tpu_tpu": "mini: not for privateuse1"}
    causes = {c["cause"]: c for c in cmp["top_causes"]}
    assert causes["AssertionError: String comparison failed: <name> != <name>"]["examples"] == [
        f"{TPU_CLASS}::test_is_cpu_tpu"]
    assert {"crashed: signal SIGABRT", "crashed: exit code <n>",
            "hung: no progress in <n> s"} < set(causes)
    assert sum(c["count"] for c in cmp["top_causes"]) == 4 == len(cmp["tpu_only_failures"])
    total = report["total"]["compare"]
    assert total["pass_rate"] == 0.6 and total["compared"] == 10
    assert len(total["top_causes"]) == 4 and report["total"]["tpu"]["crashed"] == 2
    assert "test_mini.py" in report["stdout"] and "60.0%" in report["stdout"]


def test_broken_and_missing_files(report):
    broken = report["files"]["test_broken.py"]
    for device in ("tpu", "cpu"):
        err = broken[device]["collection_error"]
        assert "No module named 'no_such_module_for_upstream_tests'" in err["message"]
        assert broken[device]["instantiated"] == 0
    assert report["files"]["test_absent.py"] == {"missing": True}
    assert "test_broken.py (tpu): collection failed" in report["stdout"]


def test_for_device():
    cpu = "test_x.py::TestFooCPU::test_cpu_tensor_cpu_float32"
    tpu = "test_x.py::TestFooPRIVATEUSE1::test_cpu_tensor_tpu_float32"
    assert for_device(tpu, "cpu") == cpu
    assert for_device(cpu, "tpu") == "test_x.py::TestFooTPU::test_cpu_tensor_tpu_float32"
    assert for_device(for_device(cpu, "tpu"), "cpu") == cpu
    assert for_device("t.py::TestBarTPU::test_y_tpu", "cpu") == "t.py::TestBarCPU::test_y_cpu"
    assert for_device("t.py::TestBarTPU::test_y_tpu_int64_float32", "cpu") == \
        "t.py::TestBarCPU::test_y_cpu_int64_float32"
    assert for_device("t.py::TestCPUish::test_tpux", "cpu") == "t.py::TestCPUish::test_tpux"
    assert for_device("t.py::test_plain_tpu", "cpu") == "t.py::test_plain_cpu"


def test_normalize_cause():
    assert normalize_cause("NotImplementedError",
                           "Could not run 'aten::_foo' with arguments from the 'tpu' backend.") == \
        "NotImplementedError: Could not run <name> with arguments from the <name> backend."
    assert normalize_cause("RuntimeError", "expected scalar type Float but found BFloat16") == \
        "RuntimeError: expected scalar type <dtype> but found <dtype>"
    assert normalize_cause("RuntimeError", "shape '[2, 3]' is invalid for input of size 7") == \
        "RuntimeError: shape <name> is invalid for input of size <n>"
    assert normalize_cause("RuntimeError", "got torch.Size([4, 5]) and torch.float16, 1e-05") == \
        "RuntimeError: got <shape> and <dtype>, <n>"
    assert normalize_cause("ValueError", "") == "ValueError"
    assert normalize_cause("E", "got QUInt8 and torch.quint8, not int64 or uint8") == \
        "E: got <dtype> and <dtype>, not <dtype> or <dtype>"
    a = normalize_cause("RuntimeError", "The size of tensor a (2) must match the size of "
                        "tensor b (3) at non-singleton dimension 0")
    b = normalize_cause("RuntimeError", "The size of tensor a (7) must match the size of "
                        "tensor b (9) at non-singleton dimension 1")
    assert a == b and "conv2d" in normalize_cause("E", "conv2d at 0x7f00a1")
    assert upstream_tests.normalize_text("tpu:0 vs [1, 2] ") == "tpu:<n> vs <shape>"


def test_reduced_runs_spread_over_the_file():
    assert upstream_tests.spread(list(range(10)), 3) == [0, 3, 6]
    assert upstream_tests.spread(list(range(3)), 5) == [0, 1, 2]
    assert upstream_tests.spread(list(range(4)), 0) == [0, 1, 2, 3]
