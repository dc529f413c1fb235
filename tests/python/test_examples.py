"""examples/train_tpu.py against a real tpud: same losses as on CPU, and two at once."""
import math
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = str(ROOT / "examples" / "train_tpu.py")
STEPS = 30
LINE = re.compile(r"^step (\d+)/(\d+) loss ([0-9.]+) acc ([0-9.]+)$")


def _args(device, seed=0):
    return [sys.executable, SCRIPT, "--device", device, "--steps", str(STEPS),
            "--log-every", "5", "--seed", str(seed)]


def _losses(out):
    """[(step, loss, acc)] from the progress lines; the final line is checked too."""
    rows = [(int(m[1]), float(m[3]), float(m[4]))
            for m in map(LINE.match, out.splitlines()) if m]
    assert [r[0] for r in rows] == list(range(5, STEPS + 1, 5)), out
    final = out.strip().splitlines()[-1]
    assert final.startswith(f"final step {STEPS}/{STEPS} loss "), out
    return rows


def _run(tpud, device, seed=0):
    r = subprocess.run(_args(device, seed), env=tpud.env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _assert_same(cpu_rows, tpu_rows, what):
    for (step, lc, ac), (_, lt, at) in zip(cpu_rows, tpu_rows):
        # Printed with 4 decimals: allow ~1e-4 relative plus one unit in the last place.
        assert math.isclose(lc, lt, rel_tol=1e-4, abs_tol=1.01e-4), (what, step, cpu_rows, tpu_rows)
        assert abs(ac - at) <= 0.0101, (what, step, cpu_rows, tpu_rows)


def test_train_example_matches_cpu(tpud):
    cpu = _losses(_run(tpud, "cpu"))
    tpu = _losses(_run(tpud, "tpu"))
    assert cpu[-1][1] < cpu[0][1], cpu   # it learns something
    _assert_same(cpu, tpu, "tpu")


@pytest.mark.slow
def test_two_train_examples_at_once(tpud):
    cpu = _losses(_run(tpud, "cpu", seed=1))
    procs = [subprocess.Popen(_args(dev, seed=1), env=tpud.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for dev in ("tpu:0", "tpu:1")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
        outs.append(out)
    for dev, out in zip(("tpu:0", "tpu:1"), outs):
        assert f"device {dev}" in out.strip().splitlines()[-1], out
        _assert_same(cpu, _losses(out), dev)
