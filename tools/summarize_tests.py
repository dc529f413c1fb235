#!/usr/bin/env python3
"""Counts test cases across Bazel's Catch2 logs and pytest's JUnit XML.

usage: summarize_tests.py [--bazel OUTPUT_FILE TESTLOGS_DIR LABEL]... [PYTEST_JUNIT_XML...]
Prints per-suite lines, then the last line: "N passed, N failed".
"""
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

TARGET_LINE = re.compile(
    r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED|TIMEOUT|FLAKY|NO STATUS|FAILED TO BUILD|SKIPPED)")
CATCH_ALL_PASSED = re.compile(r"All tests passed \((\d+) assertions? in (\d+) test cases?\)")
CATCH_SUMMARY = re.compile(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed")


def bazel_counts(output_file, testlogs, label=""):
    passed = failed = 0
    targets = {}
    for line in pathlib.Path(output_file).read_text(errors="replace").splitlines():
        m = TARGET_LINE.match(line.strip())
        if m:
            targets[m.group(1)] = m.group(2)
    for target, status in sorted(targets.items()):
        pkg, name = target[2:].split(":")
        log = pathlib.Path(testlogs) / pkg / name / "test.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        p = f = 0
        m = CATCH_ALL_PASSED.search(text)
        s = CATCH_SUMMARY.search(text)
        if status == "PASSED" and m:
            p = int(m.group(2))
        elif s:
            p, f = int(s.group(2)), int(s.group(3))
            if status != "PASSED" and f == 0:
                f = 1
        elif status == "PASSED":
            p = 1
        else:
            f = 1  # did not build, timed out or crashed before a summary
        print(f"  {label}{target}: {status} ({p} passed, {f} failed)")
        passed += p
        failed += f
    if not targets:
        print("  bazel: no test targets ran")
        failed += 1
    return passed, failed


def junit_counts(path):
    p = pathlib.Path(path)
    if not p.exists():
        print(f"  {path}: missing (pytest did not run)")
        return 0, 1
    root = ET.parse(p).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failures = errors = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failures += int(s.get("failures", 0))
        errors += int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    failed = failures + errors
    passed = tests - failed - skipped
    print(f"  pytest {p.name}: {passed} passed, {failed} failed, {skipped} skipped")
    return passed, failed


def main(argv):
    passed = failed = 0
    args = argv[1:]
    while args and args[0] == "--bazel":
        p, f = bazel_counts(args[1], args[2], args[3])
        passed += p
        failed += f
        args = args[4:]
    for xml in args:
        p, f = junit_counts(xml)
        passed += p
        failed += f
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
