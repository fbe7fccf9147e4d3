#!/usr/bin/env bash
# Runs the README's test command inside a Debian 13 ("trixie") root, so every change is
# built and tested against Debian 13's LibTorch 2.6 exactly as a new Debian 13 user would.
#
#   bash scripts/check-debian13.sh            # the README's test command (scripts/test.sh)
#   bash scripts/check-debian13.sh -- CMD...  # any command in the exported checkout instead
#
# The root is made once with debootstrap (minbase) in $TESSERA_DEBIAN13_CACHE (default
# /var/cache/tessera) and reused; packages installed in it by scripts/install-deps.sh stay
# there. Each run copies a clean export of this checkout (tracked and untracked, not
# ignored, files) to /work/tessera inside the root, so nothing built here leaks in. A ccache
# folder beside the root is bind-mounted, so a warm run recompiles nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${TESSERA_DEBIAN13_CACHE:-/var/cache/tessera}
ROOT=$CACHE/debian13
source scripts/lib/debian-root.sh

cmd=(bash scripts/test.sh)
if [ "${1:-}" = "--" ]; then
  shift
  cmd=("$@")
fi

root_lock check-debian13
root_create "$ROOT" ca-certificates
root_mount "$ROOT" "$CACHE/ccache-debian13"
root_export "$ROOT"
echo "check-debian13: running '${cmd[*]}' in Debian $(cat "$ROOT/etc/debian_version")"
in_root "$ROOT" "${cmd[@]}"
