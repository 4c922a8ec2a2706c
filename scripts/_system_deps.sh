# Sourced by test.sh: the system programs some tests need, installed where this machine lets us.
#   bwrap     bubblewrap, the operating-system sandbox of pass@k code execution (eval/sandbox/)
#   chromium  Debian's Chromium, driven by Playwright in the dashboard browser test
# Installed with apt-get as root or through passwordless sudo. Where that is impossible (no apt-get, no
# root, no network), the tests that need a missing program are skipped and say what to install; a machine
# that has them already is left alone.
_lmforge_missing=()
command -v bwrap >/dev/null 2>&1 || _lmforge_missing+=(bubblewrap)
{ [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; } || _lmforge_missing+=(chromium)
if [ "${#_lmforge_missing[@]}" -gt 0 ]; then
  _lmforge_apt=()
  if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
      _lmforge_apt=(apt-get)
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      _lmforge_apt=(sudo -n apt-get)
    fi
  fi
  if [ "${#_lmforge_apt[@]}" -gt 0 ]; then
    echo "[lmforge] installing ${_lmforge_missing[*]} (apt-get) for the tests that need them"
    export DEBIAN_FRONTEND=noninteractive
    _lmforge_updated=0
    for _lmforge_pkg in "${_lmforge_missing[@]}"; do  # one at a time: one that fails leaves the other
      "${_lmforge_apt[@]}" install -y -qq "$_lmforge_pkg" >/dev/null 2>&1 && continue
      if [ "$_lmforge_updated" -eq 0 ]; then  # stale package lists: read them once, then try again
        "${_lmforge_apt[@]}" update -qq >/dev/null 2>&1
        _lmforge_updated=1
        "${_lmforge_apt[@]}" install -y -qq "$_lmforge_pkg" >/dev/null 2>&1 && continue
      fi
      echo "[lmforge] could not install $_lmforge_pkg: the tests that need it are skipped" >&2
    done
    unset _lmforge_updated _lmforge_pkg
  else
    echo "[lmforge] ${_lmforge_missing[*]} missing and no root or passwordless sudo with apt-get to install" \
         "them: the tests that need them are skipped (install: apt-get install ${_lmforge_missing[*]})" >&2
  fi
fi
unset _lmforge_missing _lmforge_apt
