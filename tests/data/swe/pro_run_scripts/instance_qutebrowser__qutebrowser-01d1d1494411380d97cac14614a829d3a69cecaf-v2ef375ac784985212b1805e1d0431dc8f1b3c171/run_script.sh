#!/bin/bash
# In the shape of SWE-bench Pro's run_scripts/<instance_id>/run_script.sh: no argument runs
# the whole suite; one comma-separated argument (or several) runs those test files. The
# harness sends stdout and stderr to separate files, then hands both to parser.py.
set -e

export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

run_all_tests() {
  echo "Running all tests..."
  python -m pytest -v --disable-warnings -p no:cacheprovider tests/ 2>&1
}

run_selected_tests() {
  local test_files=("$@")
  echo "Running selected tests: ${test_files[*]}"
  python -m pytest -v --disable-warnings -p no:cacheprovider "${test_files[@]}" 2>&1
}

if [ $# -eq 0 ]; then
  run_all_tests
  exit $?
fi

if [[ "$1" == *","* ]]; then
  IFS=',' read -r -a TEST_FILES <<< "$1"
else
  TEST_FILES=("$@")
fi

run_selected_tests "${TEST_FILES[@]}"
