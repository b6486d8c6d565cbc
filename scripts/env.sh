# Sourced by the scripts in this folder and by benchmarks/slow_network.sh: sets PYTHON to the
# interpreter that gradsparse is installed into and run with, and GRADSPARSE_VENV to the virtual
# environment to create (or ""); and defines the helpers below it.
#
# PYTHON (default python3) is used as it is when pip may install into it: a virtual
# environment's, conda's, pyenv's, a user's own build. An externally managed interpreter (PEP 668:
# Debian's and Ubuntu's own /usr/bin/python3, outside a virtual environment) is not: a virtual
# environment made from it at GRADSPARSE_VENV (default .venv in the repository) is used instead;
# scripts/setup.sh creates it.
#
# Sourced before the scripts change to the repository's root: a relative PYTHON (one with a /) or
# GRADSPARSE_VENV names a path from the caller's directory, and is made absolute here. (Not
# resolved through symlinks: a venv's python is one.)
_base_python="${PYTHON:-python3}"
[[ $_base_python != */* || $_base_python == /* ]] || _base_python="$PWD/$_base_python"
if [ -n "${GRADSPARSE_VENV:-}" ] && [[ $GRADSPARSE_VENV != /* ]]; then GRADSPARSE_VENV="$PWD/$GRADSPARSE_VENV"; fi
if "$_base_python" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.isfile(marker) else 1)' 2> /dev/null; then
  GRADSPARSE_VENV="${GRADSPARSE_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}"
  GRADSPARSE_BASE_PYTHON="$_base_python"
  PYTHON="$GRADSPARSE_VENV/bin/python"
else
  GRADSPARSE_VENV=""
  PYTHON="$_base_python"
fi
unset _base_python
export PYTHON
# Where the interpreter's console scripts (torchrun, ruff, clang-format) are installed.
python_bin() { "$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'; }
# Stops the calling script (named $1) where PYTHON is missing: a virtual environment that
# scripts/setup.sh has not made yet, or a PYTHON that names nothing.
require_python() {
  command -v "$PYTHON" > /dev/null && return
  echo "$1: no interpreter $PYTHON${GRADSPARSE_VENV:+ (the virtual environment for the externally managed $GRADSPARSE_BASE_PYTHON)};" \
    "run bash scripts/setup.sh test first, or set PYTHON to an interpreter that has torch" >&2
  exit 2
}
# Installs the Debian packages named, quietly, where this runs as root with apt-get (the package
# lists are updated only when the install fails without); returns 1 elsewhere, installing nothing.
apt_install_as_root() {
  [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null || return 1
  _apt_get_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"; }
  _apt_get_install "$@" > /dev/null 2>&1 || { apt-get update -qq && _apt_get_install "$@" > /dev/null; }
}
