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
SRC=$PWD

CACHE=${TESSERA_DEBIAN13_CACHE:-/var/cache/tessera}
ROOT=$CACHE/debian13
CCACHE_HOST=$CACHE/ccache-debian13
MIRROR=${TESSERA_DEBIAN_MIRROR:-http://deb.debian.org/debian}

cmd=(bash scripts/test.sh)
if [ "${1:-}" = "--" ]; then
  shift
  cmd=("$@")
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

# One run at a time: runs share the root's mounts and its /work/tessera.
$SUDO mkdir -p "$CACHE"
exec 9>"$CACHE/.check-debian13.lock"
flock 9

# --- the root, made once
if [ ! -f "$ROOT/.tessera-root-ready" ]; then
  if ! command -v debootstrap >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends debootstrap
  fi
  echo "check-debian13: creating the Debian 13 root in $ROOT (once)"
  $SUDO rm -rf "$ROOT.partial"
  $SUDO mkdir -p "$CACHE"
  $SUDO debootstrap --variant=minbase --include=ca-certificates trixie "$ROOT.partial" "$MIRROR"
  $SUDO rm -rf "$ROOT"
  $SUDO mv "$ROOT.partial" "$ROOT"
  $SUDO touch "$ROOT/.tessera-root-ready"
fi
$SUDO mkdir -p "$CCACHE_HOST"

# --- mounts, undone on any exit
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    $SUDO umount -l "${mounted[$i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT
bind() {  # bind <host path> <path inside the root>
  $SUDO mkdir -p "$ROOT$2"
  $SUDO mount --bind "$1" "$ROOT$2"
  mounted+=("$ROOT$2")
}
$SUDO mkdir -p "$ROOT/proc"
$SUDO mount -t proc proc "$ROOT/proc"
mounted+=("$ROOT/proc")
bind /dev /dev
bind /dev/pts /dev/pts
bind /sys /sys
bind "$CCACHE_HOST" /ccache
$SUDO mkdir -p "$ROOT/dev/shm" "$ROOT/tmp"
$SUDO chmod 1777 "$ROOT/tmp"
$SUDO cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true

# --- a clean export of the checkout
$SUDO rm -rf "$ROOT/work/tessera"
$SUDO mkdir -p "$ROOT/work/tessera"
if command -v git >/dev/null && git rev-parse --git-dir >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard |
    (while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) |
    tar --null -T - -cf - | $SUDO tar -xf - -C "$ROOT/work/tessera"
else  # not a git checkout: everything but build folders
  tar --exclude='./build*' --exclude='./.git' -cf - . | $SUDO tar -xf - -C "$ROOT/work/tessera"
fi
# shared/ beside the checkout (reference material some benchmarks read), if present
if [ -d "$SRC/../shared" ]; then
  $SUDO rm -rf "$ROOT/work/shared"
  $SUDO cp -r "$SRC/../shared" "$ROOT/work/shared" 2>/dev/null || true
fi

echo "check-debian13: running '${cmd[*]}' in Debian $(cat "$ROOT/etc/debian_version")"
$SUDO chroot "$ROOT" /usr/bin/env -i \
  HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  LANG=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}" \
  CCACHE_DIR=/ccache CCACHE_MAXSIZE=5G JOBS="${JOBS:-}" \
  bash -c 'cd /work/tessera && exec "$@"' bash "${cmd[@]}"
