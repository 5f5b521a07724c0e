#!/bin/sh
# Print "<fstype> <source> <same|other>" for a container's scratch host path: its file system
# type, its source, and whether it lies on the storage that holds the container's rootfs.
#   scratch_storage.sh SCRATCH_PATH STORAGE_KIND STORAGE_REF
# STORAGE_KIND: path (a directory on the rootfs storage: dir, btrfs, nfs ... storages and the
# lxc backend's container dir), zfspool (STORAGE_REF is the pool), lvm (STORAGE_REF is the VG),
# none (no rootfs storage to compare with).
set -eu
scratch=$1 kind=$2 ref=${3:-}
existing() { p=$1; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; printf '%s' "$p"; }
set -- $(findmnt -n -o FSTYPE,SOURCE --target "$(existing "$scratch")")
fstype=$1 source=$2
same=other
case $kind in
  path)
    [ "$(findmnt -n -o SOURCE --target "$(existing "$ref")")" = "$source" ] && same=same ;;
  zfspool)
    case $source in "$ref"|"$ref"/*) same=same ;; esac ;;
  lvm)
    vg=$(lvs --noheadings -o vg_name "$source" 2>/dev/null | tr -d ' ' || true)
    [ "$vg" = "$ref" ] && same=same ;;
  none) ;;
  *) echo "unknown storage kind $kind" >&2; exit 2 ;;
esac
echo "$fstype $source $same"
