"""The C++ tree is formatted (Google style, .clang-format), as CI checks it."""
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_cc_and_h_file_is_clang_formatted():
    r = subprocess.run([str(ROOT / "tools" / "format.sh"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
