"""tpuctl against a real daemon: tables and the stable --json schema."""
import json
import subprocess
import time

from conftest import bazel_bin


def tpuctl(daemon, *args, check=True):
    r = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), *args], env=daemon.env(),
                       capture_output=True, text=True, timeout=30)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def hold(daemon, chip, size, segments=1, seconds=30):
    """Starts hello_tpud holding HBM and waits until the daemon shows it."""
    p = subprocess.Popen([bazel_bin("examples/cpp/hello_tpud"), f"--chip={chip}",
                          f"--bytes={size}", f"--segments={segments}",
                          f"--hold_seconds={seconds}"],
                         env=daemon.env(), stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("holding"):
            return p
    raise AssertionError("hello_tpud did not start holding")


def test_status_json_schema(daemon):
    holder = hold(daemon, 1, "64MiB", segments=2)
    try:
        doc = json.loads(tpuctl(daemon, "status", "--json").stdout)
        assert doc["schema_version"] == 1
        topo = doc["topology"]
        assert topo["name"] == "v6e-4"
        assert topo["generation"] == "v6e"
        assert topo["shape"] == [2, 2]
        assert topo["simulated"] is True
        assert len(doc["chips"]) == 4
        for i, chip in enumerate(doc["chips"]):
            assert chip["id"] == i
            assert set(chip) >= {"id", "coords", "hbm_total_bytes", "hbm_used_bytes",
                                 "healthy", "drained"}
            assert chip["hbm_total_bytes"] == 256 << 20
            assert chip["healthy"] is True and chip["drained"] is False
        assert doc["chips"][1]["hbm_used_bytes"] == 64 << 20
        assert doc["chips"][0]["hbm_used_bytes"] == 0
        assert doc["chips"][3]["coords"] == [1, 1]
        (session,) = doc["sessions"]
        assert session["pid"] == holder.pid
        assert "hello_tpud" in session["command"]
        assert session["hbm_bytes"] == 64 << 20
        assert session["hbm_bytes_per_chip"] == {"1": 64 << 20}
        assert session["segment_count"] == 2
        assert session["quota_bytes_per_chip"] is None
        assert session["allocation_id"] is None
        assert abs(session["opened_unix_seconds"] - time.time()) < 60
    finally:
        holder.kill()
        holder.wait()


def test_sessions_json_and_kill(daemon):
    holder = hold(daemon, 0, "16MiB")
    try:
        doc = json.loads(tpuctl(daemon, "sessions", "--json").stdout)
        (s,) = doc["sessions"]
        assert set(s) >= {"id", "pid", "uid", "command", "hbm_bytes"}
        out = tpuctl(daemon, "kill", str(s["id"])).stdout
        assert "reclaimed 16.00 MiB" in out
        assert json.loads(tpuctl(daemon, "sessions", "--json").stdout)["sessions"] == []
        # The killed client notices: its process is still alive but the session is gone.
        r = tpuctl(daemon, "kill", str(s["id"]), check=False)
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_status_table_reads_like_nvidia_smi(daemon):
    holder = hold(daemon, 2, "128MiB")
    try:
        out = tpuctl(daemon, "status").stdout
        assert "v6e-4 (simulated)" in out
        chip2 = next(l for l in out.splitlines() if l.split()[:2] == ["2", "(0,1)"])
        assert chip2.split()[2:7] == ["128.00", "MiB", "256.00", "MiB", "50%"], chip2
        assert "hello_tpud" in out
        assert "CHIP" in out and "SESSION" in out
    finally:
        holder.kill()
        holder.wait()
    # The kill -9 above returns the memory: the table shows it.
    deadline = time.time() + 5
    while time.time() < deadline:
        if "No sessions." in tpuctl(daemon, "status").stdout:
            break
        time.sleep(0.02)
    assert "No sessions." in tpuctl(daemon, "status").stdout


def test_topology_and_health(daemon):
    doc = json.loads(tpuctl(daemon, "topology", "--json").stdout)
    assert doc["topology"]["shape"] == [2, 2]
    assert doc["chips"][0]["neighbors"] == [1, 2]
    h = json.loads(tpuctl(daemon, "health", "--json").stdout)
    assert h["serving"] is True and len(h["chips"]) == 4
    text = tpuctl(daemon, "topology").stdout
    assert "ICI NEIGHBOURS" in text, text
    # the 2x2 torus drawn: two rows of two chips, joined across and down
    rows = [r for r in text.splitlines() if r.startswith("[")]
    assert len(rows) == 2 and "[ 1" in rows[0] and "[ 3" in rows[1] and "--0 B--" in rows[0], text


def test_quota_and_drain(daemon):
    tpuctl(daemon, "quota", "--default", "32MiB")
    r = subprocess.run([bazel_bin("examples/cpp/hello_tpud"), "--bytes=64MiB"],
                       env=daemon.env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "quota" in r.stderr and "RESOURCE_EXHAUSTED" in r.stderr
    tpuctl(daemon, "quota", "--default", "none")
    tpuctl(daemon, "drain", "3")
    doc = json.loads(tpuctl(daemon, "status", "--json").stdout)
    assert doc["chips"][3]["drained"] is True
    r = subprocess.run([bazel_bin("examples/cpp/hello_tpud"), "--chip=3", "--bytes=1MiB"],
                       env=daemon.env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr
    tpuctl(daemon, "undrain", "3")
    r = subprocess.run([bazel_bin("examples/cpp/hello_tpud"), "--chip=3", "--bytes=1MiB"],
                       env=daemon.env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_no_daemon_is_a_clear_error(tmp_path):
    r = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), "status"],
                       env={"TPUD_ADMIN_SOCKET": str(tmp_path / "admin.sock")},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert str(tmp_path / "admin.sock") in r.stderr
    assert "is tpud running" in r.stderr


def test_bad_usage(daemon):
    r = tpuctl(daemon, "frobnicate", check=False)
    assert r.returncode == 2
    r = tpuctl(daemon, "quota", "1", "lots", check=False)
    assert r.returncode == 1 and "size" in r.stderr


def test_activity_figures_after_streaming(daemon):
    holder = subprocess.Popen([bazel_bin("examples/cpp/stream_add"), "--iterations=2000",
                               "--forever"], env=daemon.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("round 1")
        doc = json.loads(tpuctl(daemon, "status", "--json").stdout)
        (s,) = doc["sessions"]
        assert s["ops_executed"] >= 2000
        assert s["busy_seconds"] > 0
        assert doc["chips"][0]["ops_executed"] >= 2000
        assert 0.0 <= doc["chips"][0]["duty_cycle"] <= 1.0
        assert "DUTY" in tpuctl(daemon, "status").stdout
    finally:
        holder.kill()
        holder.wait()


def _columns_line_up(text, header_start, right_aligned):
    """Rows of the table whose header line starts with `header_start`: every
    right-aligned column's cells end where its heading ends."""
    lines = text.splitlines()
    i = next(n for n, l in enumerate(lines) if l.startswith(header_start))
    header = lines[i]
    rows = []
    for l in lines[i + 1:]:
        if not l.strip():
            break
        rows.append(l)
    assert rows, text
    for name in right_aligned:
        end = header.index(name) + len(name)
        for row in rows:
            assert row[end - 1] != " " and (end == len(row) or row[end] == " "), \
                f"column {name} does not line up:\n{header}\n{row}"


def test_status_columns_line_up_whatever_the_values(daemon):
    holder = subprocess.Popen([bazel_bin("examples/cpp/stream_add"), "--iterations=2000",
                               "--forever"], env=daemon.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("round 1")
        out = tpuctl(daemon, "status").stdout
        # Chips with and without memory in use, two-digit percentages.
        _columns_line_up(out, "CHIP", ["CHIP", "HBM USED", "HBM TOTAL", "HBM%", "SESSIONS",
                                       "DUTY", "OPS"])
        _columns_line_up(out, "SESSION ", ["SESSION", "PID", "HBM", "BUSY", "OPS"])
        _columns_line_up(tpuctl(daemon, "executors").stdout, "EXECUTOR",
                         ["EXECUTOR", "PID", "RESTARTS", "DUTY", "OPS", "BUSY",
                          "THREADS"])
    finally:
        holder.kill()
        holder.wait()


def test_watch_streams_json_lines_and_top_redraws_while_a_job_runs(daemon):
    holder = subprocess.Popen([bazel_bin("examples/cpp/stream_add"), "--iterations=2000",
                               "--forever"], env=daemon.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("round 1")
        # watch --json: one status document per line, every interval
        r = tpuctl(daemon, "watch", "--json", "--count", "3", "--interval", "0.3")
        docs = [json.loads(l) for l in r.stdout.splitlines()]
        assert len(docs) == 3 and all(d["schema_version"] == 1 for d in docs), r.stdout[:500]
        up = [d["daemon"]["uptime_seconds"] for d in docs]
        assert up == sorted(up) and up[2] - up[0] >= 0.5, up
        ops = [d["chips"][0]["ops_executed"] for d in docs]
        assert ops[2] > ops[0], ops
        assert any(s["pid"] == holder.pid for s in docs[-1]["sessions"]), docs[-1]["sessions"]
        # watch: a line per chip per update, with ops/s from the second on
        lines = tpuctl(daemon, "watch", "--count", "2", "--interval", "0.3").stdout.splitlines()
        assert lines[0].startswith("#") and "ops/s" in lines[0] and len(lines) == 1 + 2 * 4, lines
        # chip 0, second update: ops/s is the next-to-last column ("32.00 KiB"
        # in hbm_used splits in two, so counting from the left lands on duty%,
        # which stays 0 until the daemon's first 1 s activity window ends)
        assert float(lines[5].split()[-2]) > 0, lines
        # top: two frames (not a terminal: one after the other), the job's
        # session with its rate of ops in the second
        out = tpuctl(daemon, "top", "--count", "2", "--interval", "0.3").stdout
        frames = [f for f in out.split("\ntpud ") if f.strip()]
        assert len(frames) == 2, out
        last = "tpud " + frames[1].lstrip("tpud ")
        _columns_line_up(last, "CHIP", ["CHIP", "HBM USED", "HBM%", "DUTY", "OPS/S", "SESSIONS"])
        _columns_line_up(last, "SESSION ", ["SESSION", "PID", "HBM", "BUSY", "OPS/S"])
        (row,) = [l for l in last.splitlines() if l.split()[1:2] == [str(holder.pid)]]
        (header,) = [l for l in last.splitlines() if l.startswith("SESSION ")]
        end = header.index("OPS/S") + len("OPS/S")   # a right-aligned column ends there
        assert float(row[:end].split()[-1]) > 0, last
    finally:
        holder.kill()
        holder.wait()
    bad = tpuctl(daemon, "watch", "--interval", "0.01", "--count", "1", check=False)
    assert bad.returncode != 0 and "0.1 to 3600" in bad.stderr, bad.stderr
