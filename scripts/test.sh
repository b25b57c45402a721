#!/usr/bin/env bash
# Ferry's test command: the one the README names and .ci/run calls.
#
#   ./scripts/test.sh
#
# 1. ./scripts/setup.sh installs what the tests need when it is missing (Mosquitto, moto and
#    grpcio-tools in .venv, buf in .tools, PostgreSQL, cargo-nextest);
# 2. the protos: `buf lint` (STANDARD rules, proto/buf.yaml), and a Python client generated with
#    `-I proto` alone, then imported;
# 3. cargo fmt --check, cargo clippy -D warnings, and a build of every binary (the end-to-end
#    tests run them) and test;
# 4. one moto server for the whole run (FERRY_TEST_MOTO_URL), stopped at the end;
# 5. the whole test suite with cargo-nextest (profile `ci` when CI=true), then doctests if the
#    crates have any.
#
# Every step runs even after a failure; the script exits non-zero if any failed.
# Environment: FERRY_TEST_PG (libpq key=value, default host=127.0.0.1 port=5432 user=postgres),
# FERRY_VENV (default .venv), CARGO_TARGET_DIR as usual, CI=true for the ci nextest profile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=lib/common.sh
source scripts/lib/common.sh

command -v cargo >/dev/null 2>&1 || die "cargo is not installed: install Rust with rustup (https://rustup.rs)"

started=$SECONDS
failed=()

# step NAME CMD...: run CMD under a header, remembering a failure without stopping.
step() {
    local name=$1
    shift
    section "$name"
    local begin=$SECONDS
    if "$@"; then
        info "ok ($((SECONDS - begin)) s)"
    else
        failed+=("$name")
        printf '\033[31m    FAILED: %s\033[0m\n' "$name"
    fi
}

MOTO_PID=""
stop_moto() {
    if [ -n "$MOTO_PID" ]; then
        kill "$MOTO_PID" 2>/dev/null || true
        wait "$MOTO_PID" 2>/dev/null || true
        MOTO_PID=""
    fi
}
trap stop_moto EXIT

# One moto server for every test process of the run (each nextest test is a process of its own).
start_moto() {
    mkdir -p .ferry-test
    local log=.ferry-test/moto.log
    local attempt port deadline
    for attempt in 1 2 3; do
        port="$("$FERRY_VENV/bin/python" -c \
            'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        # tests/moto_server.py: moto with DynamoDB requests served one at a time.
        "$FERRY_VENV/bin/python" tests/moto_server.py -H 127.0.0.1 -p "$port" >"$log" 2>&1 &
        MOTO_PID=$!
        deadline=$((SECONDS + 30))
        while kill -0 "$MOTO_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
            if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
                export FERRY_TEST_MOTO_URL="http://127.0.0.1:$port"
                info "moto on $FERRY_TEST_MOTO_URL (log: $log)"
                return 0
            fi
            sleep 0.1
        done
        info "moto did not start on port $port (attempt $attempt):"
        tail -n 5 "$log" >&2 || true
        stop_moto
    done
    return 1
}

# Another language's generator needs `-I proto` and nothing else: generate the Python messages and
# gRPC stubs of every proto, then import each stub (which imports the messages it depends on).
python_client() {
    local out=.ferry-test/python-client
    rm -rf "$out"
    mkdir -p "$out"
    "$FERRY_VENV/bin/python" -m grpc_tools.protoc -I proto --python_out="$out" \
        --grpc_python_out="$out" proto/ferry/v1/*.proto || return 1
    PYTHONPATH="$out" "$FERRY_VENV/bin/python" - <<'PY'
import glob
import importlib
import os

stubs = sorted(glob.glob(os.path.join(os.environ["PYTHONPATH"], "ferry/v1/*_pb2_grpc.py")))
assert stubs, "no stubs generated"
for path in stubs:
    importlib.import_module("ferry.v1." + os.path.basename(path)[: -len(".py")])
from ferry.v1 import dlq_pb2

assert dlq_pb2.DlqReason.Name(4) == "DLQ_REASON_OVERSIZED"
print(f"    {len(stubs)} stub modules import: {', '.join(os.path.basename(p) for p in stubs)}")
PY
}

run_tests() {
    local profile=default
    [ "${CI:-}" = "true" ] && profile=ci
    cargo nextest run --workspace --profile "$profile"
}

has_doctests() {
    local dirs=()
    local dir
    for dir in shared/src agent/src control-plane/src tests/src; do
        [ -d "$dir" ] && dirs+=("$dir")
    done
    [ "${#dirs[@]}" -gt 0 ] && grep -rqE '^\s*//[/!].*```' --include='*.rs' "${dirs[@]}"
}

section "Setup (scripts/setup.sh)"
./scripts/setup.sh
export FERRY_VENV="${FERRY_VENV:-$PWD/.venv}"
export FERRY_TEST_PG="${FERRY_TEST_PG:-host=127.0.0.1 port=5432 user=postgres}"

step "buf lint (proto/)" "$BUF" lint proto
step "Python client from proto/ (grpc_tools.protoc -I proto)" python_client
step "cargo fmt --check" cargo fmt --all --check
step "cargo clippy" cargo clippy --workspace --all-targets --quiet -- -D warnings
# The binaries are built with the tests in one invocation, so both share one feature resolution
# (dev-dependencies included) and nothing is compiled twice; the end-to-end tests run them.
step "build (binaries and tests)" cargo build --workspace --bins --tests --quiet
step "start moto (SQS, DynamoDB)" start_moto
step "tests (cargo nextest)" run_tests
if has_doctests; then
    step "doctests" cargo test --workspace --doc --quiet
fi
stop_moto

section "Summary"
elapsed=$((SECONDS - started))
if [ "${#failed[@]}" -eq 0 ]; then
    info "all checks passed in $((elapsed / 60)) min $((elapsed % 60)) s"
else
    info "failed: $(IFS=,; echo "${failed[*]}" | sed 's/,/, /g')"
    info "after $((elapsed / 60)) min $((elapsed % 60)) s"
    exit 1
fi
