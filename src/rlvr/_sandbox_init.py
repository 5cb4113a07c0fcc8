"""The first code that runs inside the sandbox: finish the isolation, then run the program.

rlvr/sandbox.py starts it as `python -I -S -c <this file's text> <spec as JSON>`.  It imports only
the standard library and is the only code in the sandbox that ever holds a privilege.  In order:

1. (unshare fallback only, spec "root") We are root in fresh mount, PID and network namespaces
   but still see the host's files: build a minimal read-only root in a tmpfs (/usr, the Python
   installation, five device nodes, /proc, a size-capped /tmp, the program at /sandbox/main.py),
   chroot into it, and fork: this process stays behind as the namespace's init and exits with
   the program's status, which makes the kernel kill whatever the program left running.
2. Give up privileges for good (spec "drop"): "uid" changes to the sandbox's unprivileged uid
   (we are real root: bubblewrap or unshare started by root); "caps" drops every capability and
   locks them out (we are root of a user namespace, where no other uid is mapped).  Then
   no_new_privs, and a check that no capability is left.
3. A seccomp filter refuses (EPERM) the system calls that reach outside the sandbox's limits:
   the kernel keyrings (add_key, request_key, keyctl: a new uid does not change the session
   keyring, so the program could read and revoke the trainer's keys) and memory that belongs to
   no process and so escapes RLIMIT_AS (memfd_create, memfd_secret, SysV shmget and msgget).
   System calls of another ABI (32-bit or x32 on x86-64) are refused as a whole.
4. Resource limits, close inherited descriptors, run the program as the __main__ module, with
   the installation's site-packages on sys.path (-S skips `site`, whose .pth files can cost tens
   of milliseconds per start; the program still imports what is installed there, except
   packages that only a .pth file makes importable).
"""

import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# statvfs flag -> mount flag, for the flags a user namespace locks (a remount must keep them)
_LOCKED_FLAGS = {4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # nodev noexec noatime nodiratime relatime
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 28, 38, 47
# SECBIT_NOROOT, _NOROOT_LOCKED, _NO_SETUID_FIXUP, _NO_SETUID_FIXUP_LOCKED, _KEEP_CAPS_LOCKED
_SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20


def main(spec: dict) -> None:
    if "root" in spec:
        _build_root(spec)
        _become_init()
    if spec["drop"] == "uid":
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    elif spec["drop"] == "caps":
        _drop_capabilities()
    if spec["drop"]:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if _status("CapEff") != 0 or _status("CapPrm") != 0:
            sys.exit("sandbox: could not drop privileges; refusing to run the program")
        _refuse_syscalls()
    _set_limits(spec["limits"])
    os.closerange(3, 1 << 16)
    _run(spec["main"])


def _set_limits(limits: dict) -> None:
    cpu = limits["cpu_time"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    for name, key in (("RLIMIT_AS", "memory"), ("RLIMIT_FSIZE", "file_size"),
                      ("RLIMIT_NPROC", "processes"), ("RLIMIT_NOFILE", "open_files")):
        if key in limits:
            resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run(path: str) -> None:
    import builtins
    import site
    import types

    sys.path += [p for p in site.getsitepackages() if p not in sys.path]
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = path, builtins
    sys.modules["__main__"] = module
    sys.argv = [path]
    exec(code, module.__dict__)


# --- the unshare fallback: build the root filesystem ourselves ---------------------------------

def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None) -> None:
    import ctypes

    enc = (lambda s: None if s is None else s.encode())
    if _libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _prctl(option: int, arg: int, arg2: int = 0) -> int:
    import ctypes

    if _libc().prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg2), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
    return 0


def _build_root(spec: dict) -> None:
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in spec["ro_binds"]:
        target = root + path
        os.makedirs(target, exist_ok=True) if os.path.isdir(path) else _touch(target)
        _mount(path, target, None, MS_BIND | MS_REC)
        f_flag = os.statvfs(path).f_flag
        kept = sum(flag for st, flag in _LOCKED_FLAGS.items() if f_flag & st)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept)
    for target, path in spec["symlinks"]:
        os.symlink(target, root + path)
    os.makedirs(root + "/dev")
    for name in ("null", "zero", "full", "random", "urandom"):
        _touch(f"{root}/dev/{name}")
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec['disk']}")
    os.makedirs(root + "/sandbox")
    with os.fdopen(spec["code_fd"], "rb") as src, open(root + "/sandbox/main.py", "wb") as dst:
        dst.write(src.read())
    os.chmod(root + "/sandbox/main.py", 0o444)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    os.chroot(".")
    os.chdir("/tmp")


def _touch(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "a").close()


def _become_init() -> None:
    """Fork; the parent stays as pid 1 of the PID namespace, reaps orphans and, when the program
    ends, exits with its status (the kernel then kills everything else in the namespace)."""
    child = os.fork()
    if child == 0:
        return
    for fd in (0, 1, 2):
        os.close(fd)
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _drop_capabilities() -> None:
    """Root of a user namespace: empty every capability set and lock root out of regaining them on exec."""
    import ctypes

    _prctl(PR_SET_SECUREBITS, _SECUREBITS)
    cap = 0
    while True:
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError:
            break  # past the last capability the kernel knows
        cap += 1
    _prctl(PR_CAP_AMBIENT, 4)  # PR_CAP_AMBIENT_CLEAR_ALL

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    if _libc().capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")


# (audit arch, syscall numbers refused): add_key, request_key, keyctl, memfd_create, memfd_secret, shmget, msgget
_REFUSED = {
    "x86_64": (0xC000003E, (248, 249, 250, 319, 447, 29, 68)),
    "aarch64": (0xC00000B7, (217, 218, 219, 279, 447, 194, 186)),
}


def _refuse_syscalls() -> None:
    """Install the seccomp filter described in the module docstring (no_new_privs is set)."""
    import ctypes
    import errno
    import platform

    if platform.machine() not in _REFUSED:
        return  # documented: no filter on other architectures
    arch, numbers = _REFUSED[platform.machine()]
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    # [code, jt, jf, k]; a jump target "DENY" is resolved to the last instruction below
    program = [[ld, 0, 0, 4], [jeq, 0, "DENY", arch], [ld, 0, 0, 0]]
    if platform.machine() == "x86_64":
        program.append([jset, "DENY", 0, 0x40000000])  # the x32 ABI
    program += [[jeq, "DENY", 0, nr] for nr in numbers]
    program += [[ret, 0, 0, allow], [ret, 0, 0, deny]]
    last = len(program) - 1
    for i, instr in enumerate(program):
        instr[1:3] = [last - i - 1 if x == "DENY" else x for x in instr[1:3]]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*instr) for instr in program])
    fprog = Program(len(program), filters)
    if _libc().prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        sys.exit(f"sandbox: could not install the seccomp filter ({os.strerror(ctypes.get_errno())}); refusing to run the program")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    return -1


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    del sys.argv[1]
    main(_spec)
