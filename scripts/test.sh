#!/usr/bin/env bash
# Run the test suite in the project's venv (created or reused). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" "test"
source "$(dirname "${BASH_SOURCE[0]}")/_system_deps.sh"
python -m pytest "$@"
