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

# workspace_tests PACKAGE:TEST...: one line "EXECUTABLE PACKAGE_DIR" per named integration
# test, taken from the build `cargo test --workspace` makes, so a suite run again (with
# another environment, or round after round) is the binary that already passed, with no
# rebuild. Building some packages alone resolves their dependencies' features apart from
# the workspace's: `cargo test -p ibex-transport --test ...` after a workspace build
# compiled about 70 crates again. Run each binary from its package's directory, as cargo
# test does.
workspace_tests() {
    local json
    json=$(cargo test --workspace --locked --no-run --message-format=json 2>/dev/null) \
        || die "the workspace's tests do not build: run 'cargo test --workspace --no-run' to see why."
    python3 -c '
import json, os, sys
want = sys.argv[1:]
for w in want:
    if ":" not in w or not all(w.split(":", 1)):
        sys.exit(f"a test is PACKAGE:TEST (e.g. ibex-transport:conn), not {w!r}")
def package(m):
    # "path+file:///dir/ps-server#ibex-ps@0.1.0", or "...#0.1.0" when the directory is
    # named as the package.
    url, _, frag = m["package_id"].partition("#")
    return frag.split("@")[0] if "@" in frag else url.rstrip("/").rsplit("/", 1)[-1]
found = {}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        found[package(m) + ":" + m["target"]["name"]] = (m["executable"], os.path.dirname(m["manifest_path"]))
missing = [w for w in want if w not in found]
if missing:
    sys.exit("cargo test --workspace built no test " + ", ".join(missing))
for w in want:
    print(*found[w])
' "$@" <<< "$json" || die "workspace_tests: see above."
}
