# Shared helpers for scripts/*.sh. Source it from the repository root; it defines functions and
# the paths of the tools scripts/setup.sh installs.

# buf (protobuf lint), installed with npm into a project-local, git-ignored folder.
BUF_VERSION=1.75.0
BUF_PREFIX=.tools/buf
BUF=$BUF_PREFIX/node_modules/.bin/buf

# section TITLE: a visible header between the steps of a script.
section() {
    printf '\n\033[1m==> %s\033[0m\n' "$*"
}

# info MESSAGE: one line of progress.
info() {
    printf '    %s\n' "$*"
}

# die MESSAGE: print to stderr and exit non-zero.
die() {
    printf '\033[31merror:\033[0m %s\n' "$*" >&2
    exit 1
}

# as_root CMD...: run CMD as root (directly when we are root, else with sudo).
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "'$*' needs root and sudo is not available"
    fi
}

# deb_installed PKG: true when the Debian package PKG is installed.
deb_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

# apt_install PKG...: install the Debian packages that are missing, quietly.
# Runs `apt-get update` only when the package lists are empty or the first try fails.
apt_install() {
    local missing=()
    local pkg
    for pkg in "$@"; do
        deb_installed "$pkg" || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 ||
        die "missing packages ${missing[*]} and no apt-get to install them; install them by hand"
    info "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
        as_root apt-get update -qq >/dev/null
    fi
    if ! as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
        as_root apt-get update -qq >/dev/null
        as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
            die "apt-get could not install ${missing[*]}"
    fi
}
