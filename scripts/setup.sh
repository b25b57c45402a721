#!/usr/bin/env bash
# Installs what Ferry's tests need when it is missing; idempotent and quiet when all is there.
#
#   - Mosquitto and its command-line clients (apt-get): the tests start their own brokers on
#     free loopback ports, they never use a system broker on 1883;
#   - a Python venv at .venv (or $FERRY_VENV) with moto[server] pinned, for SQS and DynamoDB, and
#     grpcio-tools pinned, to check that a Python client generates from proto/ alone;
#   - buf (npm @bufbuild/buf, pinned) in .tools/buf, for `buf lint proto`;
#   - PostgreSQL reachable as $FERRY_TEST_PG (default: host=127.0.0.1 port=5432 user=postgres,
#     trust auth): the running server is used, a stopped local cluster is started, and on a
#     machine without PostgreSQL it is installed;
#   - cargo-nextest, the test runner.
#
# Usage: ./scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=lib/common.sh
source scripts/lib/common.sh

MOTO_VERSION=5.2.5
GRPCIO_TOOLS_VERSION=1.85.1
VENV="${FERRY_VENV:-$PWD/.venv}"
PG="${FERRY_TEST_PG:-host=127.0.0.1 port=5432 user=postgres}"

setup_mosquitto() {
    if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
        apt_install mosquitto
    fi
    if ! command -v mosquitto_pub >/dev/null 2>&1; then
        apt_install mosquitto-clients
    fi
    info "mosquitto: $({ mosquitto -h 2>/dev/null || /usr/sbin/mosquitto -h 2>/dev/null || true; } | head -n 1)"
}

venv_ok() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$MOTO_VERSION" "$GRPCIO_TOOLS_VERSION" >/dev/null 2>&1 <<'PY'
import importlib.metadata as metadata
import sys

import flask  # noqa: F401  (moto's [server] extra)
import grpc_tools.protoc  # noqa: F401
import moto.server  # noqa: F401

wanted = {"moto": sys.argv[1], "grpcio-tools": sys.argv[2]}
sys.exit(0 if all(metadata.version(p) == v for p, v in wanted.items()) else 1)
PY
}

setup_venv() {
    local packages=("moto[server]==$MOTO_VERSION" "grpcio-tools==$GRPCIO_TOOLS_VERSION")
    if venv_ok; then
        info "${packages[*]} in $VENV"
        return 0
    fi
    command -v python3 >/dev/null 2>&1 || apt_install python3 python3-venv
    if [ ! -x "$VENV/bin/python" ]; then
        info "creating the Python venv $VENV"
        if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
            rm -rf "$VENV"
            apt_install python3-venv
            python3 -m venv "$VENV" || die "could not create the Python venv $VENV"
        fi
    fi
    info "installing ${packages[*]} into $VENV (pip)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}" ||
        die "pip could not install ${packages[*]}"
    venv_ok || die "${packages[*]} are installed in $VENV but do not import"
    info "${packages[*]} in $VENV"
}

setup_buf() {
    if [ -x "$BUF" ] && [ "$("$BUF" --version 2>/dev/null)" = "$BUF_VERSION" ]; then
        info "buf $BUF_VERSION in $BUF_PREFIX"
        return 0
    fi
    command -v npm >/dev/null 2>&1 || apt_install nodejs npm
    info "installing @bufbuild/buf@$BUF_VERSION into $BUF_PREFIX (npm)"
    npm install --prefix "$BUF_PREFIX" --no-save --no-audit --no-fund --loglevel=error \
        "@bufbuild/buf@$BUF_VERSION" >/dev/null || die "npm could not install @bufbuild/buf@$BUF_VERSION"
    [ "$("$BUF" --version 2>/dev/null)" = "$BUF_VERSION" ] ||
        die "@bufbuild/buf@$BUF_VERSION is installed in $BUF_PREFIX but $BUF does not run"
    info "buf $BUF_VERSION in $BUF_PREFIX"
}

pg_ok() {
    psql "$PG dbname=postgres connect_timeout=3" -Atqc 'select 1' >/dev/null 2>&1
}

pg_is_local() {
    case " $PG " in
        *" host=127.0.0.1 "* | *" host=localhost "* | *" host=::1 "*) return 0 ;;
        *) return 1 ;;
    esac
}

setup_postgres() {
    command -v psql >/dev/null 2>&1 || apt_install postgresql-client
    if pg_ok; then
        info "PostgreSQL reachable ($PG)"
        return 0
    fi
    pg_is_local || die "PostgreSQL is not reachable with FERRY_TEST_PG='$PG'"
    local installed_now=false
    if ! compgen -G '/etc/postgresql/*/main' >/dev/null; then
        apt_install postgresql
        installed_now=true
    fi
    local version
    version="$(find /etc/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)"
    if $installed_now; then
        # A cluster we just installed: let the tests connect over loopback without a password,
        # as on the development machines.
        local hba="/etc/postgresql/$version/main/pg_hba.conf"
        info "allowing trust auth on loopback in $hba"
        as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    fi
    info "starting the PostgreSQL $version cluster"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start >/dev/null 2>&1 || true
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload >/dev/null 2>&1 || true
    local deadline=$((SECONDS + 30))
    until pg_ok; do
        [ "$SECONDS" -lt "$deadline" ] ||
            die "PostgreSQL is not reachable with '$PG' (the tests need a superuser with trust auth on 127.0.0.1:5432; set FERRY_TEST_PG to use another server)"
        sleep 0.5
    done
    info "PostgreSQL reachable ($PG)"
}

setup_nextest() {
    if ! cargo nextest --version >/dev/null 2>&1; then
        info "installing cargo-nextest (cargo install)"
        cargo install --locked --quiet cargo-nextest || die "could not install cargo-nextest"
    fi
    info "$(cargo nextest --version 2>/dev/null | head -n 1)"
}

setup_mosquitto
setup_venv
setup_buf
setup_postgres
setup_nextest
