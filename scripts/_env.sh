# shellcheck shell=bash
# Shared set-up for the scripts in this folder; source it, do not run it.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
#   laneserve_env        # .venv with the project installed (editable)
#   laneserve_env dev    # ... with the dev extra (pytest, mypy, ruff, protoc)
#
# Needs only Python 3.11+ ($LANESERVE_PYTHON, default python3; an existing .venv of
# another major.minor than $LANESERVE_PYTHON is rebuilt with it). The install is redone
# only when pyproject.toml changes: .venv/.laneserve-installed-<extra> holds the
# SHA-256 of the pyproject.toml it was made from, so a re-run costs a hash (and, with
# LANESERVE_PYTHON set, three interpreter starts to compare versions).
#
# Sets ROOT (the repository root) and VENV (ROOT/.venv), and cd's to ROOT.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
cd "$ROOT"

_laneserve_say() {
    printf 'laneserve: %s\n' "$*" >&2
}

_laneserve_pyproject_hash() {
    "$VENV/bin/python" -c '
import hashlib, sys
with open(sys.argv[1], "rb") as f:
    print(hashlib.sha256(f.read()).hexdigest())
' "$ROOT/pyproject.toml"
}

# _laneserve_check_python PYTHON: fails, saying why, unless PYTHON runs and is 3.11+.
# (Its version is read back, not only an exit status: `/bin/true` passed a bare
# `sys.exit(...)` check, and the venv was removed before `true -m venv` made nothing.)
_laneserve_check_python() {
    local base="$1"
    if ! command -v "$base" >/dev/null 2>&1; then
        _laneserve_say "'$base' not found; install Python 3.11+ or set LANESERVE_PYTHON"
        return 1
    fi
    local version
    version="$(_laneserve_python_version "$base")"
    if [[ ! "$version" =~ ^([0-9]+)\.([0-9]+)$ ]]; then
        _laneserve_say "'$base' is not a Python interpreter (it did not report a version);" \
            "install Python 3.11+ or set LANESERVE_PYTHON"
        return 1
    fi
    if ((BASH_REMATCH[1] < 3 || (BASH_REMATCH[1] == 3 && BASH_REMATCH[2] < 11))); then
        _laneserve_say "'$base' is Python $version, too old; laneserve needs Python 3.11+" \
            "(set LANESERVE_PYTHON)"
        return 1
    fi
}

# _laneserve_python_version PYTHON: its major.minor (3.12), or nothing if it does not run.
_laneserve_python_version() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

_laneserve_make_venv() {
    local base="${LANESERVE_PYTHON:-python3}"
    _laneserve_check_python "$base" || return 1
    _laneserve_say "creating $VENV with $("$base" --version 2>&1)"
    rm -rf "$VENV"
    if ! "$base" -m venv "$VENV"; then
        rm -rf "$VENV"
        _laneserve_say "could not create $VENV; on Debian/Ubuntu install python3-venv"
        return 1
    fi
}

# laneserve_env [EXTRA]: make sure .venv exists and holds the project (editable), with
# EXTRA's dependencies when given.
# shellcheck disable=SC2120  # EXTRA is optional
laneserve_env() {
    local extra="${1:-}"
    local name="${extra:-base}"
    # A venv whose interpreter is gone (Python upgraded or moved) is rebuilt, and so is
    # one of another Python than LANESERVE_PYTHON names (it was read only to make one, so
    # an existing venv silently kept the Python it was made with).
    if ! "$VENV/bin/python" -c '' >/dev/null 2>&1; then
        _laneserve_make_venv || return 1
    elif [[ -n "${LANESERVE_PYTHON:-}" ]]; then
        _laneserve_check_python "$LANESERVE_PYTHON" || return 1
        local have asked
        have="$(_laneserve_python_version "$VENV/bin/python")"
        asked="$(_laneserve_python_version "$LANESERVE_PYTHON")"
        if [[ "$have" != "$asked" ]]; then
            _laneserve_say "$VENV has Python $have, LANESERVE_PYTHON ($LANESERVE_PYTHON)" \
                "is Python $asked: rebuilding it"
            _laneserve_make_venv || return 1
        fi
    fi
    local want
    want="$(_laneserve_pyproject_hash)"
    local stamp
    for stamp in "$VENV/.laneserve-installed-$name" "$VENV/.laneserve-installed-dev"; do
        if [[ -f "$stamp" && "$(<"$stamp")" == "$want" ]]; then
            return 0
        fi
        # Only the dev install also satisfies a plain one.
        if [[ -n "$extra" ]]; then
            break
        fi
    done
    local spec="$ROOT"
    if [[ -n "$extra" ]]; then
        spec="${ROOT}[${extra}]"
    fi
    _laneserve_say "installing $spec into $VENV (pyproject.toml changed or first run)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --editable "$spec"
    rm -f "$VENV"/.laneserve-installed-*
    printf '%s\n' "$want" >"$VENV/.laneserve-installed-$name"
}
