# Sourced by scripts/check-debian13.sh and scripts/check-nccl-build.sh: a Debian 13 root made
# once with debootstrap and reused, mounted for one run (undone on exit), with a clean export
# of the checkout copied in. The caller sets CACHE (the cache folder) and is in the checkout.

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
MIRROR=${TESSERA_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# root_lock NAME: one run at a time per root (runs share its mounts and /work/tessera).
root_lock() {
  $SUDO mkdir -p "$CACHE"
  exec 9>"$CACHE/.$1.lock"
  flock 9
}

# root_create ROOT INCLUDE: debootstrap (minbase, trixie) into ROOT unless it exists.
root_create() {
  local root=$1 include=$2
  [ -f "$root/etc/debian_version" ] && return 0
  if ! command -v debootstrap >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends debootstrap
  fi
  echo "debian-root: creating a Debian 13 root in $root (once)"
  $SUDO rm -rf "$root.partial"
  $SUDO debootstrap --variant=minbase --include="$include" trixie "$root.partial" "$MIRROR"
  $SUDO mv "$root.partial" "$root"
}

_root_mounts=()
_root_unmount() {
  local i
  for ((i = ${#_root_mounts[@]} - 1; i >= 0; i--)); do
    $SUDO umount -l "${_root_mounts[$i]}" 2>/dev/null || true
  done
}

# root_mount ROOT CCACHE_HOST: proc, /dev, /dev/pts, /sys and a ccache folder at /ccache.
root_mount() {
  local root=$1 ccache_host=$2 d
  trap _root_unmount EXIT
  $SUDO mkdir -p "$root/proc" "$ccache_host"
  $SUDO mount -t proc proc "$root/proc" && _root_mounts+=("$root/proc")
  for d in /dev /dev/pts /sys; do
    $SUDO mkdir -p "$root$d"
    $SUDO mount --bind "$d" "$root$d" && _root_mounts+=("$root$d")
  done
  $SUDO mkdir -p "$root/ccache"
  $SUDO mount --bind "$ccache_host" "$root/ccache" && _root_mounts+=("$root/ccache")
  $SUDO mkdir -p "$root/dev/shm" "$root/tmp"
  $SUDO chmod 1777 "$root/tmp"
  $SUDO cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}

# root_export ROOT: the checkout's tracked and untracked, not ignored, files to
# ROOT/work/tessera (everything but build folders where this is not a git checkout).
root_export() {
  local dest=$1/work/tessera
  $SUDO rm -rf "$dest"
  $SUDO mkdir -p "$dest"
  if command -v git >/dev/null && git rev-parse --git-dir >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard |
      (while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) |
      tar --null -T - -cf - | $SUDO tar -xf - -C "$dest"
  else
    tar --exclude='./build*' --exclude='./.git' -cf - . | $SUDO tar -xf - -C "$dest"
  fi
}

# in_root ROOT CMD...: CMD in ROOT's /work/tessera, with a clean environment.
in_root() {
  local root=$1
  shift
  $SUDO chroot "$root" /usr/bin/env -i \
    HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}" DEBIAN_FRONTEND=noninteractive \
    CCACHE_DIR=/ccache CCACHE_MAXSIZE=5G JOBS="${JOBS:-}" TESSERA_CMAKE_ARGS="${TESSERA_CMAKE_ARGS:-}" \
    bash -c 'cd /work/tessera 2>/dev/null || cd /; exec "$@"' bash "$@"
}
