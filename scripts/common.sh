# Shared by the set-up scripts: find or explain the tools a fresh machine needs.
# shellcheck shell=bash

die() { echo "error: $*" >&2; exit 1; }

need_cargo() {
    if ! command -v cargo >/dev/null 2>&1; then
        [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || die "cargo not found. Install the Rust toolchain (rustup, stable >= 1.85) and re-run."
    local v
    v=$(rustc --version | awk '{print $2}')
    case "$v" in
        1.[0-7][0-9].*|1.8[0-4].*) die "rustc $v is too old: Ibex needs >= 1.85 (edition 2024). Run 'rustup update stable'." ;;
    esac
}

# apt_need PKG...: installs Debian packages that are missing (needs root or sudo).
apt_need() {
    local missing=()
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    command -v apt-get >/dev/null 2>&1 || die "missing packages ${missing[*]} and no apt-get here: install them by hand."
    echo "installing ${missing[*]} ..." >&2
    $sudo apt-get update -qq || die "apt-get update failed; install ${missing[*]} by hand."
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed; install them by hand."
}
