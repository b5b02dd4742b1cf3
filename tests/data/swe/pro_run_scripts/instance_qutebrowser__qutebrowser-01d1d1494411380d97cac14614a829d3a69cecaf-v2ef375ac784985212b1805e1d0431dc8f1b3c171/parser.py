"""In the shape of SWE-bench Pro's run_scripts/<instance_id>/parser.py: reads a `pytest -v`
run and writes the harness's report.

    python parser.py STDOUT_LOG STDERR_LOG OUTPUT_JSON

OUTPUT_JSON: {"tests": [{"name": "<file>::<test>", "status": "PASSED|FAILED|SKIPPED|ERROR"}]};
an expected failure that failed counts as PASSED, one that passed as FAILED; a test
reported twice keeps its last status.
"""

import json
import re
import sys

RESULT = re.compile(r"^(\S+\.py::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
ERROR_AT_SETUP = re.compile(r"^ERROR (\S+\.py::\S+)")
STATUS = {"PASSED": "PASSED", "XFAIL": "PASSED", "FAILED": "FAILED", "XPASS": "FAILED"}


def parse(stdout: str, stderr: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        match = RESULT.match(line.strip())
        if match:
            name, word = match.groups()
            found[name] = STATUS.get(word, word)
    for line in stderr.splitlines():
        match = ERROR_AT_SETUP.match(line.strip())
        if match and match.group(1) not in found:
            found[match.group(1)] = "ERROR"
    return found


def main(stdout_path: str, stderr_path: str, output_path: str) -> None:
    with open(stdout_path) as stdout, open(stderr_path) as stderr:
        found = parse(stdout.read(), stderr.read())
    tests = [{"name": name, "status": status} for name, status in found.items()]
    with open(output_path, "w") as output:
        json.dump({"tests": tests}, output, indent=2)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python parser.py STDOUT_LOG STDERR_LOG OUTPUT_JSON")
    main(*sys.argv[1:])
