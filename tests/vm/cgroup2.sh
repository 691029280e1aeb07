#!/usr/bin/env bash
# The sandbox's tests on a machine whose kernel has cgroup v2 alone (the development machine has
# v1): boots Debian's kernel under qemu with this machine's root, read-only over 9p, and runs
# tests/test_sandbox.py there as root (`root`, the default) or as an ordinary user with a delegated
# subtree (`user`). Needs Debian's qemu-system-x86, linux-image-amd64 and initramfs-tools, root,
# and `make install` done. Software emulation (no KVM needed), on 2 cores: about 7 minutes as
# root, 5 as the user. The hostile snippets a cgroup changes, with their timeouts x10.
#   tests/vm/cgroup2.sh [root|user]    # prints the log; exit status 0 if pytest passed
# VM_TIMEOUT_S (default 2400) stops a VM that never reaches the tests; its console's tail is shown.
set -euo pipefail
who=${1:-root}
repo=$(cd "$(dirname "$0")/../.." && pwd)
kernel=$(ls /boot/vmlinuz-* | sort -V | tail -1)
version=${kernel#/boot/vmlinuz-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Debian's initramfs with the 9p modules, to mount the root over 9p
cp -r /etc/initramfs-tools "$work/conf"
printf '9p\n9pnet\n9pnet_virtio\n' >> "$work/conf/modules"
mkinitramfs -d "$work/conf" -o "$work/initrd" "$version"
mkdir "$work/out"
cmdline="console=ttyS0 quiet root=host0 rootfstype=9p ro panic=-1"
cmdline+=" rootflags=trans=virtio,version=9p2000.L,msize=262144"
cmdline+=" init=$repo/tests/vm/cgroup2_init.sh repo=$repo who=$who"
# software emulation (tcg): KVM nested in this machine hangs before the kernel prints anything;
# a VM that never reaches the tests (a shell or login prompt waits on its console) is stopped
timeout "${VM_TIMEOUT_S:-2400}" qemu-system-x86_64 -accel tcg -m 4096 -smp 2 -nographic \
    -no-reboot \
    -kernel "$kernel" -initrd "$work/initrd" \
    -virtfs local,path=/,mount_tag=host0,security_model=passthrough,readonly=on,multidevs=remap \
    -virtfs local,path="$work/out",mount_tag=out,security_model=passthrough \
    -append "$cmdline" < /dev/null > "$work/console" 2>&1 || true
if [ ! -s "$work/out/log" ]; then  # the VM did not reach the tests: its console says why
    tail -30 "$work/console"
    exit 1
fi
cat "$work/out/log"
tail -1 "$work/out/log" | grep -qx "rc=0"
