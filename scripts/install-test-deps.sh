#!/usr/bin/env bash
# Install the servers the test suite runs as local processes (Debian 12):
#   redis-server + redis-tools, rabbitmq-server, PostgreSQL 15 server binaries (apt),
#   @vercel/cosmosdb-server (npm ci, pinned in package-lock.json), Node.js if absent, and a
#   Java runtime for PySpark (OpenJDK 17) if absent. `install-test-deps.sh java` installs
#   only the Java runtime (what `make demo` needs).
# moto_server comes with the Python dev dependencies (moto[server]).
# Idempotent, and quick when everything is present. As non-root, only reports what is
# missing and exits non-zero.
set -euo pipefail

PG_MAJOR=15
COSMOS_PACKAGE=@vercel/cosmosdb-server
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf 'install-test-deps: %s\n' "$*" >&2; }

pg_bindir() {
    local bindir
    if command -v pg_config >/dev/null 2>&1 && bindir="$(pg_config --bindir 2>/dev/null)" \
        && [[ -x "$bindir/initdb" ]]; then
        printf '%s\n' "$bindir"
    else
        printf '/usr/lib/postgresql/%s/bin\n' "$PG_MAJOR"
    fi
}

missing_apt_packages() {
    command -v java >/dev/null 2>&1 || echo openjdk-17-jre-headless
    if [[ "${ONLY_JAVA:-}" == 1 ]]; then
        return 0
    fi
    command -v redis-server >/dev/null 2>&1 || echo redis-server
    command -v redis-cli >/dev/null 2>&1 || echo redis-tools
    [[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || command -v rabbitmq-server \
        >/dev/null 2>&1 || echo rabbitmq-server
    local bindir
    bindir="$(pg_bindir)"
    [[ -x "$bindir/initdb" && -x "$bindir/postgres" && -x "$bindir/pg_isready" ]] \
        || echo "postgresql-$PG_MAJOR"
    command -v node >/dev/null 2>&1 || echo nodejs
    command -v npm >/dev/null 2>&1 || echo npm
    return 0
}

if [[ "${1:-}" == java ]]; then
    ONLY_JAVA=1
fi

mapfile -t missing < <(missing_apt_packages)
if ((${#missing[@]})); then
    if [[ $EUID -ne 0 ]]; then
        log "missing system packages: ${missing[*]}"
        log "install them with: sudo apt-get update && sudo apt-get install -y ${missing[*]}"
        exit 1
    fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Package scripts may try to start the system services (rabbitmq-server, redis-server,
    # postgresql); the tests run their own instances on free ports and do not use them.
    # Unless a policy is already in place (Docker images have one), forbid starting any
    # service for the duration of the install (invoke-rc.d exit code 101: action forbidden).
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    mapfile -t still_missing < <(missing_apt_packages)
    if ((${#still_missing[@]})); then
        log "still missing after apt-get install: ${still_missing[*]}"
        exit 1
    fi
fi

if [[ "${ONLY_JAVA:-}" == 1 ]]; then
    exit 0
fi

node_major="$(node -p 'process.versions.node.split(".")[0]')"
if ((node_major < 20)); then
    log "warning: Node.js $(node --version) is older than the v20 $COSMOS_PACKAGE declares"
fi

cd "$REPO_ROOT"
wanted="$(node -p "require('./package.json').dependencies['$COSMOS_PACKAGE']")"
installed="$(node -p "require('./node_modules/$COSMOS_PACKAGE/package.json').version" \
    2>/dev/null || true)"
if [[ "$installed" != "$wanted" ]]; then
    log "npm ci ($COSMOS_PACKAGE $wanted)"
    npm ci --no-audit --no-fund --loglevel=error >/dev/null
fi
