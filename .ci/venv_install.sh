#!/usr/bin/env bash
# Install packages into a virtual environment with uv, falling back to pip.
#   bash .ci/venv_install.sh PYTHON VENV PIP_INSTALL_ARGS...
# Creates VENV with PYTHON when it has no interpreter yet, then runs `pip install PIP_INSTALL_ARGS`
# through uv (pip-installed into VENV on first use). uv resolves and downloads in parallel and
# compiles bytecode on every core; pip downloads one wheel at a time (the project's install:
# ~150 packages, 2.7 GB, 5-6 minutes through pip on the CI box; figures in docs/ci.md).
# --compile-bytecode: pip writes .pyc files at install and uv by default does not; without them
# every server and worker process the tests start would compile jax and torch from source
# (PYTHONDONTWRITEBYTECODE is set on the CI box).
# uv does not read pip's configuration, so the index URLs, find-links and constraints pip is
# configured with (files or PIP_* variables, `pip config list`) are passed on, and uv picks the
# best version across all of them as pip does (--index-strategy unsafe-best-match) rather than
# stopping at the first index that lists a name. Where uv cannot be installed, or fails, the same
# arguments go to pip (JKV_INSTALLER=pip forces that).
set -euo pipefail
python="$1" venv="$2"
shift 2
test -x "$venv/bin/python" || "$python" -m venv "$venv"
py="$venv/bin/python"

# pip's status, not grep's (grep fails when pip printed nothing but the filtered warnings).
pip_install() {
    "$py" -m pip install -q --upgrade pip 2>&1 | { grep -v "is ignored" || true; } || true
    "$py" -m pip install -q "$@" 2>&1 | { grep -v "is ignored" || true; }
}

# pip's configured package sources as uv options (one per line of `pip config list`,
# e.g. global.extra-index-url='file:///a file:///b' or :env:.find-links='/opt/wheels').
uv_sources() {
    local key value item
    while IFS= read -r line; do
        key="${line%%=*}"; key="${key##*.}"
        value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
        case "$key" in
            index-url) echo "--index-url=$value" ;;
            extra-index-url|find-links|constraint)
                for item in $value; do echo "--$key=$item"; done ;;
        esac
    done < <("$py" -m pip config list 2>/dev/null)
}

if [ "${JKV_INSTALLER:-uv}" = "uv" ] && { test -x "$venv/bin/uv" || "$py" -m pip install -q uv 2>&1 | grep -v "is ignored" >&2; test -x "$venv/bin/uv"; }; then
    mapfile -t sources < <(uv_sources)
    # uv gives up on a file whose bytecode takes over 60 s to compile (and then the whole install):
    # on a loaded box at nice 10 (.ci/run's gpu stage, load average 65) orbax hit that.
    export UV_COMPILE_BYTECODE_TIMEOUT="${UV_COMPILE_BYTECODE_TIMEOUT:-1800}"
    if "$venv/bin/uv" pip install -q --python "$py" --compile-bytecode --index-strategy unsafe-best-match "${sources[@]}" "$@"; then
        exit 0
    fi
    echo "venv_install: uv pip install $* failed; retrying with pip" >&2
fi
pip_install "$@"
