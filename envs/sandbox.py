"""A python sandbox for tool calls (ARPO's `<python>` tool; the authors' code runs `python -c`,
no limits).

Every call runs in its own process:

    trainer thread ──► unshare (net, pid, mount, ipc namespaces; root or a user namespace)
                         └─► runner (pid 1 of the pid namespace:
                             mounts, watches, stops, reaps, reports)
                               └─► child: rlimits, privileges dropped, chdir(fresh temp dir),
                                   Landlock, seccomp, python-level guard,
                                   exec(code) with the last expression printed
The trainer reads the code's output on a pipe and stops a call by closing the runner's stdin; the
runner kills and reaps the code and reports on a pipe the code does not hold (`_execute`, `RUNNER`).

The three set-ups: (A) root with namespaces, (B) an ordinary user with user namespaces,
(C) no namespaces (`SandboxLimits(namespaces=False)` forces C, for tests).
Layers, each one independent of the others:
- wall-clock timeout, RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (any file), output past
  `file_size_mb` stops the call, RLIMIT_NOFILE, no core files; the working directory is bounded to
  `disk_mb` and `max_files`: with namespaces it is a tmpfs of that size (the kernel counts every
  block and entry, unlinked and O_TMPFILE files too), in C the runner walks it every 50 ms through
  folder fds (never a path a symlink could redirect), each file once, and adds the files the code
  holds open or mapped once unlinked (not a library it holds open); past the bound the call stops;
- one process per call: seccomp (x86-64 numbers; elsewhere reported missing) refuses fork,
  vfork, clone but of a thread that shares the file table (CLONE_THREAD | CLONE_FILES) and clone3
  (threads still work), so RLIMIT_AS, RLIMIT_CPU and RLIMIT_NOFILE hold for the call as a whole
  without a cgroup and nothing can leave the process group;
- a cgroup per call where the trainer may make one (v1 memory and pids hierarchies: as root; v2: a
  cgroup, its own at the root or its parent, that gives memory and pids to children, e.g. a
  delegated systemd slice): the code's process alone, memory (kernel memory and the tmpfs pages of
  its working directory too; memsw or swap 0 where there is swap accounting) the call's limit,
  pids.max its thread limit; "memory" and the thread-limit verdict come from the cgroup's own
  counts (oom_kill, pids' max events), and it is removed after the call (one a trainer killed
  mid-call left, named by its creator, at the next trainer's set-up). Without one the seccomp
  refusals and rlimits above are the bound, and `isolation()["note"]` says so;
- the rest of the seccomp filter (the runner's `seccomp()` gives the reason for each): signals,
  priorities, CPU affinity and rlimits of itself only; no setsid/setpgid, pidfd, ptrace,
  process_vm_*, io_uring, mount/unshare/setns, sockets, AIO, inotify, SysV IPC, POSIX message
  queues, memfd, xattr writes, file locks or leases, F_GETLK, F_SETOWN, file flags by ioctl or
  page-cache eviction; fallocate "not supported"; in C also no chmod, chown, file times, mkdir or
  umask without rwx for the owner, and with Landlock ABI < 3 no truncate(path);
- privileges dropped after the mounts are set up: as root (A) an unused uid per call, every
  capability and the bounding set gone; in a user namespace (B) a nested user namespace maps the
  code to uid 1000 and every capability is dropped, so the code is not root and cannot unmount
  or remount anything; in C as root an unused uid too, which must reach the interpreter (not
  under /root): where it cannot, the code is not run (uid 0 may chmod, utime and truncate the
  host's files by name and is not bound by RLIMIT_NPROC); PR_SET_NO_NEW_PRIVS always. The child
  checks /proc/self/status before it runs;
- Landlock (Linux >= 5.13, unprivileged): reads only of what python needs (`LIBRARY`, a few /etc
  files, some of /proc/self, the cpu topology) and the working directory; writes only to the
  working directory and /dev/null; no TCP bind/connect (ABI >= 4); no signals or abstract unix
  sockets out of the domain (ABI >= 6). Kernel-enforced whatever path the code builds (dir_fd,
  /proc/self/root, ctypes);
- a fresh temporary working directory (also HOME and TMPDIR), a scrubbed environment; it is removed
  without recursion and without following symlinks, whatever the code left in it (deep trees,
  chmod 000 folders, the top one too), by a background thread (`wait_for_cleanup`), so a call
  takes its timeout plus a small constant;
- namespaces where the OS allows them: no network (a new network namespace has only a loopback
  device that is down, so even 127.0.0.1 is unreachable), a private pid namespace (when the
  runner exits the kernel kills every process left in it), a private mount namespace in which
  home directories and the trainer's working directory are covered by an empty tmpfs (the python
  installation is bound back), so is /dev/pts (the trainer's terminals), and every mount the code
  reaches (/sys too) is read-only except the sandbox's own directory, the call's own tmpfs (nosuid,
  nodev), and its own /proc: nothing the code writes reaches the host's disk. A mount with flags a
  user namespace may not clear (nosuid, nodev: Ubuntu's /dev/shm) is remounted with them kept,
  else covered by an empty read-only tmpfs, else the call is not run;
- a python audit hook (`sys.addaudithook`) that refuses reads outside the working directory
  and the python installation (dir_fd included), writes outside the working directory,
  sockets and new processes. It is not a security boundary (ctypes goes around it);
  it gives the model clear messages.
Where the kernel gives no file isolation (no mount namespace, no Landlock), no process
isolation (no namespaces, no seccomp) or, as root, no spare uid, `run_python` refuses
to run code unless `SandboxLimits(unsafe=True)` accepts the risk. `isolation()` reports
which layers this machine provides.
Nothing here raises on bad code: the caller gets the output,
or an error string that says what happened.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import os
import platform
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

MB = 1024 * 1024
# after the trainer asks the runner to stop the code: its time to do so and report
STOP_GRACE_S = 2.0
UID_BASE, UID_SPAN = 40000, 20000  # per-call uids (A): no two calls share files or signals
# offset by pid: trainer processes (ranks) rarely collide
_uid_counter = itertools.count(os.getpid() * 101)
_uid_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10
    # RLIMIT_AS of the call's only process: a little above what the code really uses
    memory_mb: int = 1024
    nproc: int = 32  # threads (RLIMIT_NPROC; new processes are refused anyway)
    file_size_mb: int = 8  # any file written, stdout included
    disk_mb: int = 64  # everything in the working directory together (checked every 50 ms)
    max_files: int = 1000  # files and folders in the working directory (bounds the clean-up too)
    open_files: int = 64
    max_output_chars: int = 4000
    max_code_chars: int = 100_000
    guard: bool = True  # the python audit hook (tests turn it off to check the OS layers alone)
    # False: set-up C, no namespaces (tests use it to exercise the fallback)
    namespaces: bool = True
    unsafe: bool = False  # run even where the kernel isolates nothing (only the guard and rlimits)


@dataclass
class SandboxResult:
    output: str  # what the model sees: stdout+stderr, truncated, or an error line first
    # None, "timeout", "cpu", "memory", "output_limit", "disk", "killed",
    # "exit", "rejected", "refused"
    error: str | None
    seconds: float


# The runner is passed with -c; its config as argv[1]; the user's code arrives on stdin (its length
# first); stdin then stays open: its end (or a byte) asks the runner to stop the code. The runner's
# verdict (the code's exit status or signal, CPU used, disk over) goes to the trainer on a pipe of
# its own, closed in the code's process, so no exit status the code chooses reads as a verdict.
RUNNER = r'''
import ast, ctypes, json, linecache, os, posix, re, resource, select, signal, stat, struct, sys, \
    traceback
cfg = json.loads(sys.argv[1])

def read_exactly(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(0)  # the trainer stopped the call before the code arrived
        data += chunk
    return data

code = read_exactly(int.from_bytes(read_exactly(8), "little")).decode("utf-8", errors="replace")
wd = cfg["wd"]
MB = 1024 * 1024
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long

def need(ok, what):
    # a layer that was asked for and did not apply stops the call:
    # the code never runs half-protected
    if not ok:
        err = ctypes.get_errno()
        why = os.strerror(err) if err else "failed"
        print(f"Error: the sandbox could not set up {what} ({why}).", flush=True)
        os._exit(70)

def private_mounts():
    # The module docstring's private mount namespace (none of it is visible outside): homes
    # covered (the python installation and the working dir bound back), the working dir a tmpfs of
    # its own, /dev/pts covered, then every mount read-only but the working dir.
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = (
        1, 2, 4, 8, 32, 4096, 16384)
    COVER = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=0755"  # an empty tmpfs
    keep = [wd] + [os.path.realpath(p) for p in cfg["keep"]]
    for hidden in cfg["hide"]:
        if not os.path.isdir(hidden):
            continue
        inside = [p for p in keep if p.startswith(hidden.rstrip("/") + "/") and os.path.exists(p)]
        fds = [os.open(p, os.O_PATH) for p in inside]
        if libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", 0, b"mode=0755,size=1m") == 0:
            for p, fd in zip(inside, fds):
                os.makedirs(p, exist_ok=True)
                libc.mount(f"/proc/self/fd/{fd}".encode(), p.encode(), None, MS_BIND | MS_REC, None)
        for fd in fds:  # not left open: a way under the cover (openat "..") had they been inherited
            os.close(fd)
    opts = f"size={cfg['disk_mb'] * MB + 65536},nr_inodes={cfg['max_files'] + 2},mode=0700"
    opts += f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
    need(libc.mount(b"tmpfs", wd.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) == 0,
         "the working directory's tmpfs")
    if os.path.isdir("/dev/pts"):
        need(libc.mount(b"tmpfs", b"/dev/pts", b"tmpfs", *COVER) == 0, "a cover over /dev/pts")
    # Every mount the code can reach but its working dir and its /proc is made read-only: remounted
    # with the flags it has (a user namespace may not clear nosuid, nodev, noexec or atime flags set
    # outside it: Ubuntu's /dev/shm, /run/user/N), else covered by an empty read-only tmpfs, else
    # the call is not run. A mount under a cover, or under another mount, is out of reach.
    flag = {b"ro": MS_RDONLY, b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC,
            b"noatime": 1024, b"nodiratime": 2048, b"relatime": 4096, b"nosymfollow": 256}

    def mounts():  # {mount id: (mount point, flags)}; mountinfo writes " " as \040
        return {f[0]: (re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), f[4]),
                       sum(flag.get(o, 0) for o in f[5].split(b",")))
                for f in map(bytes.split, open("/proc/self/mountinfo", "rb").read().splitlines())}

    def mount_id(t):  # of the mount the path t reaches (None: out of reach)
        try:
            fd = os.open(t, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)  # no automount
        except OSError:
            return None
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            mid = re.search(rb"mnt_id:\s*(\d+)", f.read())[1]
        os.close(fd)
        return mid

    reached = []
    for mid, (t, flags) in mounts().items():
        if t == wd.encode() or t == b"/proc" or t.startswith(b"/proc/") or mount_id(t) != mid:
            continue
        reached.append((mid, t))
        if not flags & MS_RDONLY:
            libc.mount(b"none", t, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)
    now = mounts()
    for mid, t in reached:
        if not now[mid][1] & MS_RDONLY:
            libc.mount(b"tmpfs", t, b"tmpfs", *COVER)
            need(mounts().get(mount_id(t), (t, 0))[1] & MS_RDONLY,
                 f"a read-only {os.fsdecode(t)} (remounted or covered)")

def drop_privileges():
    PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_SET_NO_NEW_PRIVS = 24, 28, 47, 38
    root = os.geteuid() == 0
    if root:
        if cfg["userns"]:
            # B: a nested user namespace maps the code to uid 1000; the runner stays root of the
            # outer one, which owns the mounts, so nothing the code does in its own can undo them
            need(libc.unshare(0x10000000) == 0, "a nested user namespace")
            for name, text in (("setgroups", "deny"), ("uid_map", "1000 0 1"),
                               ("gid_map", "1000 0 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
        for cap in range(last + 1):
            need(libc.prctl(PR_CAPBSET_DROP, L(cap), L(0), L(0), L(0)) == 0,
                 "the capability bounding set")
        if cfg["uid"] is not None:  # A: an unused uid; the switch from root clears every capability
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        else:  # root's special cases off and locked: no capabilities come back at exec or setuid
            need(libc.prctl(PR_SET_SECUREBITS, L(0x2F), L(0), L(0), L(0)) == 0, "securebits")
        # effective, permitted, inheritable: empty (2 x 32 bits)
        none = ctypes.create_string_buffer(24)
        need(libc.capset(ctypes.c_char_p(struct.pack("Ii", 0x20080522, 0)), none) == 0,
             "capabilities")
        need(libc.prctl(PR_CAP_AMBIENT, L(4), L(0), L(0), L(0)) == 0, "ambient capabilities")
    need(libc.prctl(PR_SET_NO_NEW_PRIVS, L(1), L(0), L(0), L(0)) == 0, "no_new_privs")
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
                  if ":\t" in line)
    held = [k for k in ("CapEff", "CapPrm", "CapAmb") + (("CapBnd",) if root else ())
            if int(status[k], 16)]
    need(not held and status["NoNewPrivs"].strip() == "1", f"privilege drop (still held: {held})")
    need(os.geteuid() != 0 or cfg["unsafe"], "privilege drop (still uid 0)")

ETC = ["/etc/localtime", "/etc/timezone", "/etc/ld.so.cache", "/etc/ld.so.conf",
       "/etc/ld.so.conf.d", "/etc/os-release", "/etc/mime.types", "/etc/passwd", "/etc/group",
       "/etc/nsswitch.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates", "/etc/fonts",
       "/etc/matplotlibrc", "/etc/alternatives"]
# of /proc/self not net (without a network namespace: the host's sockets) nor task (task/N/net);
# not /proc/stat (its fork counter: a channel from one call to the next)
PROC_SELF = ["/proc/self/" + name for name in (
    "fd", "fdinfo", "status", "stat", "statm", "maps", "smaps", "cmdline", "exe", "environ",
    "limits", "auxv", "comm", "cgroup", "mounts", "mountinfo", "io")]
# what python reads: its executable, stdlib and import path, its prefixes' lib folders (libpython,
# conda's libraries), the system's library folders (extension modules load libssl, libffi, ...
# when imported) and time zones. Not all of /usr: a trainer's working directory may be there
# (/usr/src/app); never a folder that is or holds a home or the trainer's working directory (an
# editable install may put the project on sys.path).
LIBRARY = [os.path.realpath(p) for p in [
    sys.executable, os.path.dirname(os.__file__), *filter(None, sys.path),
    *(os.path.join(p, "lib") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)),
    "/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib",
    "/usr/share/zoneinfo"]]
LIBRARY = [p for p in LIBRARY if p != "/" and not any(
    (h + "/").startswith(p.rstrip("/") + "/") for h in cfg["protect"])]
SYSTEM = LIBRARY + ["/proc/cpuinfo", "/proc/meminfo", "/sys/devices/system/cpu", "/dev/urandom",
                    "/dev/random", "/dev/zero"] + PROC_SELF + ETC

def landlock():
    # reads: the python installation and system files; writes: the working dir and /dev/null
    abi = cfg["landlock"]
    # every file-system right this ABI knows
    fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
    attr = struct.pack("QQQ", fs, 3, 3)[:8 if abi < 4 else 16 if abi < 6 else 24]  # + TCP, + scopes
    ruleset = libc.syscall(L(444), ctypes.c_char_p(attr), L(len(attr)), L(0))
    need(ruleset >= 0, "Landlock")
    EXECUTE, WRITE, READ, READ_DIR, TRUNCATE, IOCTL_DEV = 1, 2, 4, 8, 1 << 14, 1 << 15
    rules = [(p, READ | READ_DIR | EXECUTE) for p in SYSTEM]
    rules += [("/dev/null", READ | WRITE | TRUNCATE | IOCTL_DEV), (wd, fs)]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # not on this machine
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= EXECUTE | WRITE | READ | TRUNCATE | IOCTL_DEV  # the rights a file can have
        rule = ctypes.c_char_p(struct.pack("=Qi", access & fs, fd))
        need(libc.syscall(L(445), L(ruleset), L(1), rule, L(0)) == 0, f"a Landlock rule for {path}")
        os.close(fd)
    need(libc.syscall(L(446), L(ruleset), L(0)) == 0, "Landlock")
    os.close(ruleset)

# classic BPF over seccomp_data (nr at 0, arch at 4, args at 16 + 8 i; the low 32 bits suffice:
# pids, flags and address families are ints); an instruction is (opcode, jump if true, if false, k)
ALLOW, KILL, DENY, NOSYS = (0x7FFF0000, 0x80000000,
                            0x50000 | 1, 0x50000 | 38)  # ERRNO: EPERM, ENOSYS

def ld(offset):
    return (0x20, 0, 0, offset)

def arg(i):
    return ld(16 + 8 * i)

def jeq(k, jt, jf):
    return (0x15, jt, jf, k)

def jset(k, jt, jf):
    return (0x45, jt, jf, k)

def ret(k):
    return (0x06, 0, 0, k)

def only(nr, *body):
    # body for syscall nr; any other jumps past it
    return [jeq(nr, 0, len(body)), *body]

def refuse(nr, i, values):
    # syscall nr with argument i equal to one of values: EPERM
    equal = [jeq(v, len(values) - j, 0) for j, v in enumerate(values)]
    return only(nr, arg(i), *equal, ret(ALLOW), ret(DENY))

def seccomp():
    # x86-64 numbers
    me = os.getpid()
    prog = [ld(4), jeq(0xC000003E, 1, 0), ret(KILL),
            ld(0), (0x35, 0, 1, 0x40000000), ret(DENY)]  # x32: no
    # kill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo: to itself only
    for nr in (62, 234, 129, 297):
        prog += only(nr, arg(0), jeq(me, 0, 1), ret(ALLOW), ret(DENY))
    # prlimit64, sched_setparam/setscheduler/setaffinity/setattr, migrate_pages, move_pages: itself
    # (0 or its pid) only -- the trainer's limits, priority and CPUs are not the code's to change
    for nr in (302, 142, 144, 203, 314, 256, 279):
        prog += only(nr, arg(0), jeq(0, 1, 0), jeq(me, 0, 1), ret(ALLOW), ret(DENY))
    # setpriority (nice): PRIO_PROCESS of itself only
    prog += only(141, arg(0), jeq(0, 0, 4), arg(1), jeq(0, 1, 0), jeq(me, 0, 1),
                 ret(ALLOW), ret(DENY))
    # clone: threads only (CLONE_THREAD, no CLONE_NEW* flag) that share the file table
    # (CLONE_FILES: a table of its own held fds past RLIMIT_NOFILE, files no /proc/PID/fd shows);
    # clone3 hides its flags: ENOSYS, libc falls back
    prog += only(56, arg(0), jset(0x7E020080, 3, 0), (0x54, 0, 0, 0x10400), jeq(0x10400, 0, 1),
                 ret(ALLOW), ret(DENY))
    prog += only(435, ret(NOSYS))
    denied = [57, 58,  # fork, vfork
              200, 424, 434, 438,  # tkill, pidfd_send_signal, pidfd_open, pidfd_getfd
              112, 109,  # setsid, setpgid: the process group is how the call is ended
              101, 310, 311, 312,  # ptrace, process_vm_readv/writev, kcmp
              425, 426, 427,  # io_uring (its requests are not seen by this filter)
              # sockets, socketpair: host unix sockets, fds in flight (held past RLIMIT_NOFILE,
              # hidden from the disk count), buffers outside RLIMIT_AS; io_setup: AIO contexts
              # (a host-wide count); inotify: watches on the host's files (a channel)
              41, 53, 206, 253, 294,
              # namespaces and mounts
              272, 308, 165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442,
              # bpf ... by_handle
              321, 298, 323, 250, 248, 249, 175, 313, 176, 246, 320, 172, 173, 304, 303,
              # ioprio_set, process_madvise/mrelease, fanotify, syslog
              251, 440, 448, 300, 301, 103]
    # the host's SysV IPC and POSIX message queues (set-up C has no ipc namespace),
    # memfd: memory outside RLIMIT_AS; xattr writes: Landlock does not cover them
    # (a note one call leaves for the next)
    denied += [29, 30, 31, 64, 65, 66, 67, 68, 69, 70, 71, 220,
               240, 241, 242, 243, 244, 245, 319, 447,
               188, 189, 190, 197, 198, 199, 463, 466,
               73]  # flock: a lock on a readable host file is a channel between concurrent calls
    denied += [76] if cfg["landlock"] < 3 else []  # truncate(path): Landlock covers it from ABI 3
    # C: no read-only mounts, and Landlock has no right for chmod, chown, file times
    if not cfg["mounts"]:
        denied += [90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280]
        # no folder the runner cannot read (it counts the disk by walking): mkdir needs rwx for the
        # owner, umask may not take them away (chmod is refused above)
        prog += only(83, arg(1), (0x54, 0, 0, 0o700), jeq(0o700, 0, 1), ret(ALLOW), ret(DENY))
        prog += only(258, arg(2), (0x54, 0, 0, 0o700), jeq(0o700, 0, 1), ret(ALLOW), ret(DENY))
        prog += only(95, arg(0), jset(0o700, 1, 0), ret(ALLOW), ret(DENY))
    for nr in denied:
        prog += only(nr, ret(DENY))
    # fcntl: no record locks or leases (the flock channel again), no signal owner
    # (F_SETOWN + F_SETSIG would send SIGKILL on I/O to any process of the same uid; Landlock
    # scopes signals from ABI 6 only), no F_GETLK / F_OFD_GETLK (they name the host process that
    # holds a lock on a readable file)
    prog += refuse(72, 1, (6, 7, 37, 38, 1024, 8, 10, 15, 1026, 5, 36))
    # ioctl: FIOSETOWN, SIOCSPGRP (F_SETOWN's other spellings); file flags and attributes (NODUMP,
    # NOATIME, SYNC, project ids: FS_IOC_SETFLAGS, its 32-bit form, FS_IOC_FSSETXATTR,
    # FS_IOC_SETVERSION) of any file the code owns -- Landlock's ioctl right covers devices only
    prog += refuse(16, 1, (0x8901, 0x8902,
                           0x40086602, 0x40046602, 0x401C5820, 0x40087602, 0x40047602))
    # page cache of host files: fadvise DONTNEED, madvise COLD and PAGEOUT evict what others read
    prog += refuse(221, 3, (4,))
    prog += refuse(28, 2, (20, 21))
    # fallocate reserves disk without writing:
    # "not supported" makes libc's posix_fallocate write instead
    prog += only(285, ret(0x50000 | 95))
    prog.append(ret(ALLOW))
    filt = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in prog))
    fprog = ctypes.create_string_buffer(struct.pack("HQ", len(prog), ctypes.addressof(filt)))
    # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    need(libc.prctl(22, L(2), fprog, L(0), L(0)) == 0, "seccomp")

# the call's cgroup, where the trainer made one: opened before /sys is made read-only, joined by the
# child before it allocates anything
cgroup = [libc.open(path.encode(), os.O_WRONLY | os.O_CLOEXEC) for path in cfg["cgroup"]]
# the disk walk (C) holds a folder fd per level: up to max_files
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
need(min(cgroup, default=0) >= 0, "the call's cgroup")
if cfg["mounts"]:
    private_mounts()

def disk_over(pid):
    limit = cfg["disk_mb"] * MB
    # the call's own tmpfs: the kernel counts every block and entry, held files too
    if cfg["mounts"]:
        st = os.statvfs(wd)
        used, entries = (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree - 1
        return used > limit or entries > cfg["max_files"]
    # C: the working dir is on the host's disk: walked read only, through folder fds (a folder's
    # name may be swapped for a symlink to a host folder: RENAME_EXCHANGE), names past PATH_MAX,
    # each file once however many links it has; plus the files the code holds open or mapped once
    # unlinked (O_TMPFILE too), which no walk sees -- not a file with a name (a library held open)
    used, entries, seen, frames = 0, 0, set(), []  # frames: [folder fd, subfolders left], a level
    DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        frames.append([os.open(wd, DIR), None])
        while frames:
            fd, subs = frames[-1]
            if subs is None:
                subs = []
                frames[-1][1] = subs
                with os.scandir(fd) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        used += 0 if st.st_ino in seen else st.st_blocks * 512
                        entries += 1
                        seen.add(st.st_ino)
                        subs += [e.name] if stat.S_ISDIR(st.st_mode) else []
                if used > limit or entries > cfg["max_files"]:
                    return True
            elif subs:
                try:
                    frames.append([os.open(subs.pop(), DIR, dir_fd=fd), None])
                except OSError as e:
                    if e.errno not in (2, 20, 40):  # gone, or now a file or a symlink
                        raise
            else:
                os.close(frames.pop()[0])
    except OSError:
        return True  # unreadable (seccomp keeps the owner's rwx): not measurable
    finally:
        for fd, _ in frames:
            os.close(fd)
    dev = os.stat(wd).st_dev
    try:
        for n in os.listdir(f"/proc/{pid}/fd") if pid else []:
            try:
                st = os.stat(f"/proc/{pid}/fd/{n}")
            except OSError:
                continue
            if (stat.S_ISREG(st.st_mode) and not st.st_nlink and st.st_dev == dev
                    and st.st_ino not in seen):
                seen.add(st.st_ino)
                used += st.st_blocks * 512
        maps = {}
        # bytes: the names are the code's, not always UTF-8
        for line in open(f"/proc/{pid}/maps", "rb").read().splitlines() if pid else []:
            f = line.split()
            if len(f) > 5 and line.endswith(b"(deleted)") and int(f[4]) not in seen:
                major, minor = (int(x, 16) for x in f[3].split(b":"))
                if os.makedev(major, minor) == dev:
                    start, end = (int(x, 16) for x in f[0].split(b"-"))
                    maps[int(f[4])] = max(maps.get(int(f[4]), 0), int(f[2], 16) + end - start)
        used += sum(maps.values())
    except OSError:
        pass  # the code is gone
    return used > limit

pid = os.fork()
if pid:  # pid 1 of the namespace: watch, stop, reap, then report; exiting kills the rest
    try:
        wake = [0, os.pidfd_open(pid)]  # the trainer's stop (stdin's end), the child's exit
    except (AttributeError, OSError):
        wake = [0]
    verdict = {}
    while True:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got == pid:
            # what it left: a tmpfs written full (ENOSPC), a walk over the limit
            if disk_over(None):
                verdict["disk"] = True
            break
        over = disk_over(pid)
        if over or 0 in select.select(wake, [], [], 0.05 if len(wake) == 2 else 0.01)[0]:
            verdict["disk" if over else "stopped"] = True
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            break
    verdict.update(status=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                   signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                   cpu_s=usage.ru_utime + usage.ru_stime)
    os.write(cfg["verdict_fd"], json.dumps(verdict).encode())
    os._exit(0)

# the child: only stdout and stderr are kept (not the verdict pipe, not the trainer's stop signal)
need(all(libc.write(fd, b"0", 1) == 1 for fd in cgroup), "the call's cgroup")  # "0": itself
os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
os.closerange(3, 1 << 16)
os.umask(0o022)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * MB, cfg["memory_mb"] * MB))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * MB, cfg["file_size_mb"] * MB))
resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["open_files"], cfg["open_files"]))
resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
drop_privileges()
os.chdir(wd)
if cfg["landlock"]:
    landlock()
if cfg["seccomp"]:
    seccomp()

def where(path, dir_fd=None):
    # the real path a call reaches: an fd's own path, or a relative path taken from its dir_fd
    if isinstance(path, int):
        return os.path.realpath(os.readlink(f"/proc/self/fd/{path}"))
    path = os.fsdecode(path)
    if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):  # -1: none (the cwd)
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(path)

def guard(event, args):
    # python-level refusal of file and network access outside the sandbox (see the module docstring)
    if event in PROCESS_EVENTS:
        raise PermissionError("sandbox: starting processes is disabled (one process per call)")
    if event == "socket.__new__":  # any socket, as seccomp: no network, no unix sockets
        raise PermissionError("sandbox: network access is disabled (no sockets)")
    if event == "open" and not isinstance(args[0], int):
        path, mode, flags = args
        writes = any(c in str(mode) for c in "wax+") if mode is not None else flags & WRITES
        check(where(path), WRITE if writes else READ)
    elif event == "sandbox.open":  # os.open with a dir_fd (the "open" event does not carry it)
        path, flags, dir_fd = args
        check(where(path, dir_fd), WRITE if flags & WRITES else READ)
    elif event in ("os.listdir", "os.scandir") and args and args[0] is not None:
        check(where(args[0]), READ)
    elif event in WRITE_EVENTS:
        for i, d in WRITE_EVENTS[event]:
            if i < len(args) and args[i] is not None:
                check(where(args[i], args[d] if d is not None and d < len(args) else None), WRITE)

def check(real, roots):
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
        raise PermissionError(f"sandbox: access to {real} is outside the sandbox")

def open_at(path, flags, mode=0o777, *, dir_fd=None, _open=os.open):
    if dir_fd is not None:
        sys.audit("sandbox.open", path, flags, dir_fd)
    return _open(path, flags, mode, dir_fd=dir_fd)

# (path index, its dir_fd index) of each write event's arguments
WRITE_EVENTS = {"os.remove": [(0, 1)], "os.rmdir": [(0, 1)], "os.mkdir": [(0, 2)],
                "os.chmod": [(0, 2)], "os.chown": [(0, 3)], "os.truncate": [(0, None)],
                "os.utime": [(0, 3)], "shutil.rmtree": [(0, 1)], "os.rename": [(0, 2), (1, 3)],
                "os.link": [(0, 2), (1, 3)], "os.symlink": [(0, None), (1, 2)],
                "shutil.copyfile": [(0, None), (1, None)],
                "shutil.copymode": [(0, None), (1, None)],
                "shutil.copystat": [(0, None), (1, None)],
                "shutil.move": [(0, None), (1, None)]}
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
                  "subprocess.Popen"}
WRITE = [wd, "/dev/null"]
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
READ = [wd] + LIBRARY + [os.path.realpath(p) for p in (
    "/etc", "/dev/null", "/dev/urandom", "/dev/random", "/dev/zero", "/proc/self", "/proc/cpuinfo",
    "/proc/meminfo", "/sys/devices/system/cpu")]

def report(e):
    # a traceback of the user's frames only (the runner's own frames are "<string>")
    frames = list(traceback.extract_tb(e.__traceback__))
    first = next((i for i, f in enumerate(frames) if f.filename == "<sandbox>"), len(frames))
    frames = [f for f in frames[first:] if f.filename != "<string>"]
    head = (["Traceback (most recent call last):\n", *traceback.format_list(frames)]
            if frames else [])
    sys.stderr.write("".join(head + traceback.format_exception_only(type(e), e)))

def run(src):
    # the last expression is printed like a REPL (repr, None skipped)
    linecache.cache["<sandbox>"] = (len(src), None, src.splitlines(True), "<sandbox>")
    tree = ast.parse(src, "<sandbox>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    env = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<sandbox>", "exec"), env)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<sandbox>", "eval"), env)
        if value is not None:
            print(repr(value))

del sys.argv[1:]
if cfg["guard"]:
    os.open = posix.open = open_at
    sys.addaudithook(guard)
status = 1
try:
    run(code)
    status = 0
except MemoryError:
    sys.stdout.flush()
    print(f"MemoryError: the sandbox memory limit ({cfg['memory_mb']} MB) was exceeded",
          file=sys.stderr)
except SystemExit as e:
    status = e.code if isinstance(e.code, int) else 0
except BaseException as e:
    sys.stdout.flush()
    report(e)
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
'''


def _sandbox_env(wd: str) -> dict[str, str]:
    # scrubbed: nothing from the trainer's environment (tokens, proxies, CUDA settings) leaks in
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": wd, "TMPDIR": wd, "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg"}


def _world_traversable(path: str) -> bool:
    # a dropped uid must be able to reach the python interpreter and its packages: "x" for others
    # on the path and every folder above it
    parts = os.path.realpath(path).split("/")
    return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001
               for i in range(1, len(parts) + 1))


def _next_uid() -> int:
    with _uid_lock:
        return UID_BASE + next(_uid_counter) % UID_SPAN


SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run",
               "/sbin", "/sys", "/usr", "/var")


def _kernel_layers() -> dict:
    """Landlock's ABI version (0: none) and whether the seccomp filter applies
    (its numbers are x86-64's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1))  # ..._VERSION
    seccomp = platform.machine() == "x86_64" and libc.prctl(21, 0, 0, 0, 0) >= 0  # PR_GET_SECCOMP
    return {"landlock": max(0, abi), "seccomp": bool(seccomp)}


NO_KERNEL_LAYERS = {"landlock": 0, "seccomp": False}


def _config(wd: str, uid: int | None, namespaces: list[str], mounts: bool, kernel: dict,
            limits: SandboxLimits, cgroup: list[str]) -> dict:
    # covered by an empty tmpfs: home directories and the trainer's working directory (the project,
    # its checkpoints, any .env) -- unless that is a system directory
    protect = sorted(set(map(os.path.realpath,
                             ["/root", "/home", os.path.expanduser("~"), os.getcwd()])))
    keep = [sys.prefix, sys.base_prefix, sys.exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable))]
    hide = [p for p in protect if p != "/" and not any(
        p == d or p.startswith(d + "/") for d in SYSTEM_DIRS)]
    return {"wd": os.path.realpath(wd), "uid": uid, "mounts": mounts, "keep": keep,
            "protect": protect, "hide": hide, "userns": "--user" in namespaces, **kernel,
            **asdict(limits),
            # v1's tasks file moves one thread without the lock cgroup.procs takes (an RCU grace
            # period, up to 15 ms here); the child has one thread when it joins
            "cgroup": [os.path.join(d, "tasks" if os.path.exists(os.path.join(d, "tasks"))
                                    else "cgroup.procs") for d in cgroup]}


# The cgroup per call of the module docstring, per version: (file, the limit it gets, required),
# {events file: its counter}.
CGROUP = {"v1": ([("memory.limit_in_bytes", "memory", True), ("pids.max", "nproc", True),
                  ("memory.memsw.limit_in_bytes", "memory", False),
                  ("memory.kmem.limit_in_bytes", "memory", False)],
                 {"memory.oom_control": "oom_kill", "pids.events": "max"}),
          "v2": ([("memory.max", "memory", True), ("pids.max", "nproc", True),
                  ("memory.swap.max", "none", False)],
                 {"memory.events": "oom_kill", "pids.events": "max"})}
_cgroup_names = itertools.count()
CGROUP_PREFIX = "sandbox-call-"  # + the creator (pid namespace, pid, start time) + a count
WORKDIR_PREFIX = "sandbox-"  # + the creator + mkdtemp's 8 letters
CGROUP_NAME = re.compile(CGROUP_PREFIX + r"(\d+)-(\d+)-(\d+)-\d+")
WORKDIR_NAME = re.compile(WORKDIR_PREFIX + r"(\d+)-(\d+)-(\d+)-[a-z0-9_]{8}")


def _start_time(pid: int | str) -> str | None:
    # when process `pid` started (clock ticks since boot): with its pid it names one process
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _creator() -> str:
    # what names a call's cgroup and working folder: pid namespace, pid, start time
    return f"{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}-{_start_time('self')}"


def _left_by_the_dead(name: str, pattern: re.Pattern, ns: str) -> bool:
    # a name of `pattern` whose creator (_creator) is of pid namespace ns and gone: no
    # process of that pid and start time
    match = pattern.fullmatch(name)
    return bool(match) and match[1] == ns and _start_time(match[2]) != match[3]


def _remove_stale() -> None:
    """What a trainer killed mid-call left (its clean-up never ran), ours by name, of this pid
    namespace, whose creator is gone: per-call cgroups (the kernel refuses to remove one that holds
    a task) and working folders (owned by this uid or a spare one). Nothing else is touched."""
    ns = str(os.stat("/proc/self/ns/pid").st_ino)
    for parent in (_cgroup_parents() or ("", ()))[1]:
        for name in os.listdir(parent):
            if _left_by_the_dead(name, CGROUP_NAME, ns):
                _quietly(os.rmdir, os.path.join(parent, name))  # EBUSY while it holds a task
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if _left_by_the_dead(name, WORKDIR_NAME, ns):
            try:
                st = os.lstat(os.path.join(tmp, name))  # a symlink is not ours
            except FileNotFoundError:  # another trainer of this namespace removed it meanwhile
                continue
            spare = UID_BASE <= st.st_uid <= UID_BASE + UID_SPAN  # the probe's uid is the last
            if stat.S_ISDIR(st.st_mode) and (st.st_uid == os.geteuid() or spare):
                _remove_tree(os.path.join(tmp, name))


@functools.cache
def _cgroup_parents() -> tuple[str, tuple[str, ...]] | None:
    """Where this process may make a cgroup per call: ("v1", (its memory cgroup, its pids cgroup)),
    ("v2", (its cgroup, or the parent of it, that gives memory and pids to children)) or None."""
    try:
        own = {c: path for line in open("/proc/self/cgroup")
               for _, cs, path in [line.rstrip("\n").split(":", 2)] for c in cs.split(",")}
        dirs = {}  # controller ("" for v2): the folder of this process's cgroup
        for line in open("/proc/self/mountinfo"):
            left, right = line.split(" - ", 1)
            root, point = left.split()[3:5]
            fstype, _, opts = right.split()[:3]
            names = opts.split(",") if fstype == "cgroup" else [""] if fstype == "cgroup2" else []
            for c in set(names) & {"memory", "pids", ""} & set(own):
                if root == "/" or (own[c] + "/").startswith(root + "/"):
                    dirs[c] = os.path.normpath(point + own[c][len(root.rstrip("/")):])
        if "memory" in dirs and "pids" in dirs:
            found = ("v1", (dirs["memory"], dirs["pids"]))
        else:  # v2: a cgroup with processes cannot give controllers to children, but the root
            found = next(("v2", (d,)) for d in (dirs[""], os.path.dirname(dirs[""]))
                         if {"memory", "pids"} <= set(
                             open(os.path.join(d, "cgroup.subtree_control")).read().split()))
    except (OSError, ValueError, KeyError, StopIteration):
        return None
    return found if all(os.access(d, os.W_OK) for d in found[1]) else None


def _new_cgroup(limits: SandboxLimits) -> list[str]:
    """The call's own cgroup (a folder per hierarchy), its limits set."""
    version, parents = _cgroup_parents()
    name, dirs = f"{CGROUP_PREFIX}{_creator()}-{next(_cgroup_names)}", []
    value = {"memory": limits.memory_mb * MB, "nproc": limits.nproc, "none": 0}
    try:
        for parent in parents:
            os.mkdir(os.path.join(parent, name), 0o755)
            dirs.append(os.path.join(parent, name))
        for file, what, required in CGROUP[version][0]:
            paths = [os.path.join(d, file) for d in dirs]  # the first hierarchy that has it
            try:
                with open(next(filter(os.path.exists, paths), paths[0]), "w") as f:
                    f.write(str(value[what]))
            except OSError:
                if required:
                    raise
    except BaseException:
        _remove_cgroup(dirs)
        raise
    return dirs


def _cgroup_events(dirs: list[str]) -> dict:
    """What the kernel counted in the call's cgroup: OOM kills ("oom") and tasks refused past
    pids.max ("threads")."""
    got = {"oom": 0, "threads": 0}
    for d in dirs:
        for file, key in CGROUP[_cgroup_parents()[0]][1].items():
            try:
                counts = dict(line.split() for line in open(os.path.join(d, file)))
            except (OSError, ValueError):
                continue
            got["oom" if key == "oom_kill" else "threads"] += int(counts.get(key, 0))
    return got


def _remove_cgroup(dirs: list[str]) -> None:
    for d in dirs:  # empty once the runner has reaped the code; a moment later where it was killed
        for _ in range(100):
            if _quietly(os.rmdir, d) or not os.path.exists(d):
                break
            time.sleep(0.01)


def _probe(namespaces: list[str], uid: int | None, mounts: bool, kernel: dict,
           cgroup: bool = False) -> bool:
    try:
        out, stop, verdict, _ = _call(b"print(6 * 7)", SandboxLimits(timeout_s=20, guard=False,
                                      unsafe=True), namespaces, uid, mounts, kernel, cgroup,
                                      lambda clean, what: clean(what))
        return (stop is None and verdict is not None and verdict["status"] == 0
                and out.text().strip() == "42")
    except (OSError, subprocess.SubprocessError):
        return False


def isolation(namespaces: bool = True) -> dict:
    """Which OS layers this machine gives the sandbox (probed once per process, about 0.5 s).
    namespaces=False: what set-up C (no namespaces) gives."""
    return _isolation(bool(namespaces))


@functools.cache
def _isolation(namespaces: bool) -> dict:
    root = os.geteuid() == 0
    unshare = shutil.which("unshare") if namespaces else None
    kernel = _kernel_layers()
    _quietly(_remove_stale)
    tries = []  # (namespaces, private mounts, may drop the uid), strongest first
    if unshare:
        ns = [unshare, "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]
        tries.append((ns if root else [unshare, "--user", "--map-root-user", *ns[1:]], True, root))
    # without a mount namespace a dropped uid must still reach the interpreter (not under /root)
    reachable = _world_traversable(sys.executable) and _world_traversable(sys.prefix)
    tries.append(([], False, root and reachable))
    for cmd, mounts, may_drop in tries:
        for layers in [kernel] + ([NO_KERNEL_LAYERS] if kernel != NO_KERNEL_LAYERS else []):
            for uid in ([UID_BASE + UID_SPAN] if may_drop else []) + [None]:
                if _probe(cmd, uid, mounts, layers):
                    cgroup = bool(_cgroup_parents()) and _probe(cmd, uid, mounts, layers, True)
                    return _report(cmd, mounts, uid is not None, layers,
                                   _cgroup_parents()[0] if cgroup else "")
    return {**_report([], False, False, NO_KERNEL_LAYERS, ""),
            "note": "the sandbox could not start python"}


def _report(cmd: list[str], mounts: bool, drop_uid: bool, kernel: dict, cgroup: str) -> dict:
    files = mounts or kernel["landlock"] > 0  # the kernel keeps the code off the trainer's files
    processes = bool(cmd) or kernel["seccomp"]  # ... and off the trainer's processes
    # ... and the code is not uid 0, which owns the host's files by name and is not bound by
    # RLIMIT_NPROC (the module docstring): as root a spare uid, or the code is not run
    unprivileged = drop_uid or os.geteuid() != 0
    layers = [("network namespace", bool(cmd)), ("read-only mounts", mounts),
              ("Landlock", kernel["landlock"] > 0), ("seccomp", kernel["seccomp"]),
              ("unprivileged uid", unprivileged)]
    missing = [name for name, ok in layers if not ok]
    note = ("missing: " + ", ".join(missing) + "; the python audit hook and rlimits still apply"
            + ("" if unprivileged else "; as root without namespaces the code must run as a spare "
               f"uid, which cannot reach {sys.executable} (a folder on its path is closed to other "
               "users): run as an ordinary user, with namespaces, or with python where every user "
               "can read it")) if missing else ""
    if not cgroup:  # not a refusal: seccomp's refusals are the fallback
        note += ("; " if note else "") + (
            "no cgroup per call (v1 needs root, v2 a subtree delegated to the trainer): memory is "
            "bounded by RLIMIT_AS and threads by RLIMIT_NPROC, seccomp refuses what they miss "
            "(fork, memfd, SysV shm, sockets); kernel memory is not counted")
    return {"namespaces": cmd, "mounts": mounts, "drop_uid": drop_uid,
            "network_isolated": bool(cmd), "read_only_fs": mounts, "landlock": kernel["landlock"],
            "seccomp": kernel["seccomp"], "kernel_isolated": files and processes and unprivileged,
            "setup": ("A" if "--user" not in cmd else "B") if cmd else "C", "cgroup": cgroup,
            "note": note}


def refusal(iso: dict) -> str:
    """Why model-written code is not run on this machine, and the switch that accepts the risk."""
    return ("the python sandbox cannot isolate model-written code on this machine "
            f"({iso['note'] or 'none'}): it needs a mount namespace or Landlock (files), "
            "namespaces or seccomp (processes), and as root a uid other than 0. Model-written code "
            "is not run; to run it anyway, with only the python audit hook and rlimits, accept the "
            "risk with arpo.py --unsafe-python (make_env('tools', unsafe_python=True); "
            "SandboxLimits(unsafe=True)).")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a fresh sandboxed process; never raises for anything the code does."""
    t0 = time.time()
    if len(code) > limits.max_code_chars:
        return SandboxResult(f"Error: code is {len(code)} characters; "
                             f"the limit is {limits.max_code_chars}.", "rejected", 0.0)
    iso = isolation(limits.namespaces)
    if not iso["kernel_isolated"] and not limits.unsafe:
        return SandboxResult(f"Error: {refusal(iso)}", "refused", 0.0)
    try:  # a full disk (a temp folder) is an error line too, not an exception
        # the folder and cgroup are removed off the caller's path: the call's time is its timeout
        # plus a small constant
        out, stop, verdict, rc = _call(code.encode("utf-8", errors="replace"), limits,
                                       iso["namespaces"], _next_uid() if iso["drop_uid"] else None,
                                       iso["mounts"], iso, bool(iso.get("cgroup")), _cleaner.submit)
        text = out.text(limits.max_output_chars)
        error, message = _classify(stop, verdict, rc, text, limits, time.time() - t0)
        if message:
            text = message + ("\n" + text if text.strip() else "")
        return SandboxResult(text.strip(), error, time.time() - t0)
    except OSError as e:
        return SandboxResult(f"Error: could not start the sandbox: {e}", "killed", time.time() - t0)


def _call(code: bytes, limits: SandboxLimits, namespaces: list[str], uid: int | None, mounts: bool,
          kernel: dict, cgroup: bool, cleanup) -> tuple[_Output, str | None, dict | None, int]:
    """One call: its working dir (the code's uid's) and, where asked, its cgroup made, the code run
    (`_execute`; the verdict with the cgroup's counts), both handed to cleanup(remove, what)."""
    wd, dirs = "", []
    try:
        wd = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{_creator()}-")
        if uid is not None:
            os.chown(wd, uid, uid)
        dirs = _new_cgroup(limits) if cgroup else []
        config = _config(wd, uid, namespaces, mounts, kernel, limits, dirs)
        out, stop, verdict, rc = _execute(config, namespaces, code, limits)
        if verdict is not None:  # the runner has reaped the code: the cgroup's counts are final
            verdict.update(_cgroup_events(dirs))
        return out, stop, verdict, rc
    finally:
        if wd:
            cleanup(_remove_tree, wd)
        if dirs:
            cleanup(_remove_cgroup, dirs)


class _Output:
    """What the code printed, as the trainer reads it from the pipe:
    its head, its tail and its size."""

    def __init__(self, keep: int):
        self.keep, self.head, self.tail, self.size = keep, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        take = max(0, self.keep - len(self.head))
        self.head += chunk[:take]
        self.tail += chunk[take:]
        if len(self.tail) > self.keep:
            del self.tail[:-self.keep]

    def text(self, max_chars: int = 1 << 30) -> str:
        """Cut to about max_chars: its head (2/3) and its tail (1/3, where errors are)."""
        whole = self.size <= len(self.head) + len(self.tail)
        text = (self.head + self.tail).decode("utf-8", errors="replace")
        if whole and len(text) <= max_chars:
            return text
        head_s = text if whole else self.head.decode("utf-8", errors="replace")
        tail_s = text if whole else self.tail.decode("utf-8", errors="replace")
        return (f"{head_s[:2 * max_chars // 3]}\n"
                f"... [output truncated: {self.size} bytes in total] ...\n"
                f"{tail_s[len(tail_s) - max_chars // 3:]}")


def _execute(cfg: dict, namespaces: list[str], code: bytes, limits: SandboxLimits
             ) -> tuple[_Output, str | None, dict | None, int | None]:
    """Run the runner: (the output, the trainer's own stop: None, "timeout" or "output", the
    runner's verdict or None, the exit status). stdout is a pipe the trainer reads (a file would
    be the code's to chmod, a set-uid executable on the host); the stop is asked of the runner,
    which kills and reaps the code, so nothing is left a zombie even where the trainer is PID 1."""
    vr, vw = os.pipe()
    cfg = {**cfg, "verdict_fd": vw}
    try:
        # -u: what the code printed before the kernel killed it (SIGSYS, SIGKILL) is in the output
        argv = [*namespaces, sys.executable, "-I", "-u", "-X", "utf8", "-c", RUNNER,
                json.dumps(cfg)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=_sandbox_env(cfg["wd"]),
                                cwd=cfg["wd"], start_new_session=True, pass_fds=(vw,))
    except BaseException:
        os.close(vr)
        raise
    finally:
        os.close(vw)
    out, stop, eof = _Output(4 * limits.max_output_chars), None, False
    data = memoryview(len(code).to_bytes(8, "little") + code)
    sel = selectors.DefaultSelector()
    try:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + limits.timeout_s

        def ask_to_stop(why: str) -> None:
            nonlocal stop, deadline
            stop, deadline = why, time.monotonic() + STOP_GRACE_S
            if not proc.stdin.closed:
                if proc.stdin in sel.get_map():
                    sel.unregister(proc.stdin)
                proc.stdin.close()  # its end: the runner kills the code, reaps it, reports

        while not eof:
            left = deadline - time.monotonic()
            if left <= 0:
                if stop is not None:
                    break  # the runner did not end in its grace: killed below
                ask_to_stop("timeout")
                continue
            for key, _ in sel.select(left):
                if key.fileobj is proc.stdin:
                    try:
                        data = data[os.write(proc.stdin.fileno(), data[:1 << 16]):]
                    except BlockingIOError:
                        pass
                    except OSError:  # the runner is gone
                        data = data[len(data):]
                    if not data:
                        sel.unregister(proc.stdin)  # kept open: its end means "stop"
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    eof = True
                    break
                out.add(chunk)
                if stop is None and out.size > limits.file_size_mb * MB:
                    ask_to_stop("output")
        rc = proc.wait(timeout=STOP_GRACE_S) if eof else None
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        sel.close()
        if proc.poll() is None:
            _kill_and_reap(proc)
        for f in (proc.stdin, proc.stdout):
            f.close()
        os.set_blocking(vr, False)
        try:
            verdict = json.loads(os.read(vr, 1 << 16) or b"null")
        except (OSError, ValueError):
            verdict = None
        os.close(vr)
    return out, stop, verdict, rc if rc is not None else proc.returncode


_cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-cleanup")  # joined at exit


def wait_for_cleanup() -> None:
    """Block until every finished call's folders are removed."""
    _cleaner.submit(lambda: None).result()


def _remove_tree(top: str) -> None:
    """`rm -rf top` that never raises: no recursion and no long paths (one fd per level, walked down
    and back up), whatever depth the code built; folders it made unreadable (chmod 000), the top one
    too, are opened up first, never through a symlink."""
    _open_up(top)
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    # the way down from top; folders that could not be emptied (left once each)
    names, stuck = [], set()
    try:
        while True:
            sub = None
            with os.scandir(fd) as entries:
                for e in entries:
                    if not e.is_dir(follow_symlinks=False):
                        _quietly(os.unlink, e.name, dir_fd=fd)
                    elif e.inode() not in stuck:
                        sub = e
                        break
            if sub is not None:
                _open_up(sub.name, fd)
                try:
                    child = os.open(sub.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                    dir_fd=fd)
                except OSError:  # unopenable, or gone since the scan: not tried again
                    stuck.add(sub.inode())
                    continue
                os.close(fd)
                fd = child
                names.append(sub.name)
                continue
            if not names:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            ino = os.fstat(fd).st_ino
            os.close(fd)
            fd = parent
            if not _quietly(os.rmdir, names.pop(), dir_fd=fd):
                stuck.add(ino)
    except OSError:
        pass
    finally:
        os.close(fd)
    _quietly(os.rmdir, top)


def _open_up(name: str, dir_fd: int | None = None) -> None:
    # chmod 700 of the folder itself: opened O_PATH without following a symlink,
    # changed through its fd
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
    except OSError:
        return
    try:
        _quietly(os.chmod, f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def _quietly(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
        return True
    except (OSError, NotImplementedError):
        return False


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                kids = [int(k) for k in open(f"/proc/{p}/task/{tid}/children").read().split()]
                found += kids
                todo += kids
        except (OSError, ValueError):
            pass
    return found


def _kill_and_reap(proc: subprocess.Popen) -> None:
    # the last resort (the runner did not stop the code when asked): SIGKILL to the session, which
    # holds unshare, the runner and the code (the code can neither fork nor leave the group); what
    # was orphaned onto the trainer (it is PID 1, or a subreaper) is reaped here, not left a zombie
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pid in below:
        for _ in range(200):
            try:
                if (int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                        != os.getpid()):
                    break  # not ours to reap
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except (OSError, ValueError, IndexError):
                break
            time.sleep(0.01)


def _classify(stop: str | None, v: dict | None, rc: int | None, text: str, limits: SandboxLimits,
              seconds: float) -> tuple[str | None, str]:
    # from what the trainer saw (its timer, the bytes it read) and what the runner
    # saw (the code's exit status or signal, its CPU time, the disk): never from
    # an exit status the code could choose
    if stop == "timeout":
        return "timeout", f"Error: execution timed out after {limits.timeout_s:g} s (wall clock)."
    if stop == "output":
        return ("output_limit",
                f"Error: output exceeded the {limits.file_size_mb} MB limit; stopped.")
    # the runner did not report: a layer it could not set up (its line is in the text)
    if v is None:
        return "killed", "" if text.strip() else ("Error: the sandbox ended without a report "
                                                  f"(status {rc}).")
    if v.get("disk"):
        return "disk", (f"Error: the working directory went over its limit ({limits.disk_mb} MB, "
                        f"{limits.max_files} files and folders); stopped.")
    if v.get("oom"):
        return "memory", (f"Error: the code went over its memory limit ({limits.memory_mb} MB, as "
                          "the call's cgroup counts it: kernel memory and files it wrote too).")
    sig = v["signal"]
    # RLIMIT_CPU ends in SIGXCPU, its hard limit in SIGKILL; the code may send either to itself, so
    # the CPU time it used says which. The kernel counts whole ticks for the limit, rusage the time
    # really run: up to a few % less under contention (0.97 s at a 1 s limit seen), hence 0.9.
    # (RLIMIT_FSIZE's SIGXFSZ is ignored by python: a write past it is an OSError in the code's
    # traceback; a SIGXFSZ death is the code's own doing, no verdict of ours.)
    if sig in (signal.SIGXCPU, signal.SIGKILL) and v["cpu_s"] >= 0.9 * limits.cpu_s:
        return "cpu", f"Error: CPU time limit of {limits.cpu_s} s exceeded."
    if sig == signal.SIGSYS:
        return "killed", ("Error: the sandbox's seccomp filter killed the code (SIGSYS): it made a "
                          "system call of another ABI (32-bit i386), which is refused.")
    if sig == signal.SIGKILL:
        return "killed", (f"Error: the code was killed (SIGKILL) after {seconds:.1f} s, "
                          "within its CPU limit.")
    if "MemoryError" in text:
        return "memory", ""
    if v.get("threads") and (sig or v["status"]):
        return "exit", f"Error: the code reached its limit of {limits.nproc} threads."
    if sig or v["status"] != 0:
        how = f"ended with signal {sig}" if sig else f"exited with status {v['status']}"
        return "exit", "" if text.strip() else f"Error: the code {how} and printed nothing."
    return None, ""


def run_python_many(codes: list[str], limits: SandboxLimits = SandboxLimits(),
                    max_workers: int = 8) -> list[SandboxResult]:
    """Run several snippets at once; threads only wait on child processes,
    so the trainer keeps going."""
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(codes)))) as pool:
        return list(pool.map(lambda c: run_python(c, limits), codes))
