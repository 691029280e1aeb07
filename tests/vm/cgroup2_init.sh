#!/bin/sh
# PID 1 of the VM that tests/vm/cgroup2.sh boots: the host's root, read-only over 9p, with the
# cgroup v2 hierarchy alone (memory and pids controllers). Runs tests/test_sandbox.py as root or
# (who=user) as an ordinary user in a delegated subtree, as systemd would give one; the log goes
# to the writable share, then the VM powers off.
set -u
mount -t proc proc /proc 2>/dev/null
mount -t sysfs sys /sys 2>/dev/null
mount -t tmpfs -o mode=1777 tmp /tmp
mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
mount -t devpts devpts /dev/pts
mkdir /tmp/out
mount -t 9p -o trans=virtio,version=9p2000.L out /tmp/out
log=/tmp/out/log
repo=$(sed -n 's/.* repo=\([^ ]*\).*/\1/p' /proc/cmdline)
who=$(sed -n 's/.* who=\([^ ]*\).*/\1/p' /proc/cmdline)
# the interpreter may be under /root (mode 700): cover /root, bind the interpreter's folder back
python=$(readlink -f "$repo/.venv/bin/python")
case "$python" in /root/*)
    top=/root/$(echo "${python#/root/}" | cut -d/ -f1)
    mkdir /tmp/held && mount --bind "$top" /tmp/held
    mount -t tmpfs -o mode=0755 rootcover /root
    mkdir "$top" && mount --bind /tmp/held "$top" ;;
esac
cg=/sys/fs/cgroup
mount -t cgroup2 none $cg
echo "kernel $(uname -r), controllers: $(cat $cg/cgroup.controllers)" > $log
echo "+memory +pids" > $cg/cgroup.subtree_control
mkdir $cg/test.slice
echo "+memory +pids" > $cg/test.slice/cgroup.subtree_control
run() {  # $1: the tests' own cgroup; the rest: what runs them (setpriv, env)
    leaf=$1; shift
    mkdir -p "$leaf"
    (echo 0 > "$leaf/cgroup.procs"; cd "$repo" && exec "$@" "$repo/.venv/bin/python" -m pytest \
        -q -p no:cacheprovider tests/test_sandbox.py -k "hostile_snippet or cgroup or uid_0") \
        >> $log 2>&1
    echo "rc=$?" >> $log
}
# what a cgroup changes: the hostile snippets that read it or that it bounds, the killed trainer's
# leftovers, uid 0's threads; timeouts x10 (software emulation is ~10x slower)
cases=cgroup,memory_cgroup,threads,memory_threads,memory_fork,concurrent,refused_calls
env="PYTHONDONTWRITEBYTECODE=1 TMPDIR=/tmp LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin"
env="$env SANDBOX_TEST_CGROUP=1 SANDBOX_TEST_CASES=$cases SANDBOX_TEST_SLOW=10"
if [ "$who" = root ]; then
    # root: the parent of its own cgroup gives memory and pids to children
    echo "== as root, in test.slice/root" >> $log
    run $cg/test.slice/root env $env HOME=/tmp
else
    # an ordinary user (uid 1000) with a delegated subtree: test.slice/user is its own, with
    # memory and pids given to its children; the user's shell runs in its leaf `session`
    d=$cg/test.slice/user
    mkdir -p $d/session /tmp/home
    echo "+memory +pids" > $d/cgroup.subtree_control
    chown 1000:1000 $d $d/cgroup.procs $d/cgroup.subtree_control $d/cgroup.threads \
        $d/session $d/session/cgroup.procs /tmp/home
    echo "== as uid 1000, in a delegated test.slice/user" >> $log
    run $d/session setpriv --reuid 1000 --regid 1000 --clear-groups --inh-caps=-all \
        env $env HOME=/tmp/home
fi
sync
echo o > /proc/sysrq-trigger
sleep 10
