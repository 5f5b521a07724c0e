"""The keepalive holder: holds every idle managed GPU, yields exactly what the Slurm prolog asks.

Concurrency: one thread accepts connections, one thread per connection, one maintenance
thread. `_state_lock` guards the bookkeeping (short sections only); each GPU has its own lock
so that taking or freeing one GPU (which can take seconds on a real GPU) never blocks a
prolog asking for a different one. Overlapping jobs on disjoint GPUs thus never wait on
each other.

Trust: only root may talk to the socket. The socket is 0600 in a private directory (made
0700 by the holder when missing; an existing one's mode is never changed, and one that others
may write to or own is refused), and every connection's SO_PEERCRED uid is checked as well,
so a mis-set permission is not enough to let an ssh/bash process take a GPU. Slurm's prolog,
run as root by slurmd, is the only release path.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from launch.errors import LaunchError
from launch.keepalive.holders import GpuHolder, LockHolder
from launch.keepalive.protocol import decode, encode, read_line
from toolkit.fsutil import atomic_write_text

log = logging.getLogger("launch.keepalive")

AllocationQuery = Callable[[], dict[str, list[int]]]
UNIX_PATH_MAX = 108  # sun_path of struct sockaddr_un on Linux, with its terminating NUL


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _check_parent(kind: str, path: Path) -> None:
    """Refuse, before anything is made, a path whose nearest existing ancestor is not a directory."""
    ancestor = path.parent
    try:
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if ancestor.is_dir():
            return
    except OSError:  # e.g. not searchable for this user: making the path reports it
        return
    raise LaunchError(f"{kind} {path}: {ancestor} is not a directory")


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class KeepaliveDaemon:
    def __init__(
        self,
        holders: dict[int, GpuHolder],
        socket_path: Path,
        state_path: Path,
        query_allocations: AllocationQuery | None,
        hold_timeout: float = 2.0,
        reconcile_interval: float = 30.0,
        allowed_uids: frozenset[int] = frozenset({0}),
        present: set[int] | None = None,
    ) -> None:
        self.holders = holders
        # Every GPU the node has (the holder may manage fewer): a job given another one was
        # allocated a GPU that does not exist (gres.conf and the node disagree).
        self.present = set(holders) if present is None else set(present) | set(holders)
        self.socket_path = socket_path
        self.state_path = state_path
        self.query_allocations = query_allocations
        self.hold_timeout = hold_timeout
        self.reconcile_interval = reconcile_interval
        self.allowed_uids = allowed_uids
        self.backend = "lock" if all(isinstance(h, LockHolder) for h in holders.values()) else "cuda"

        self._state_lock = threading.Lock()
        self._gpu_locks = {i: threading.Lock() for i in holders}
        self.released: dict[str, list[int]] = {}  # job id -> GPUs given to it
        self._released_at: dict[str, float] = {}
        self.pending: set[int] = set()  # GPUs to take back whose lock/memory is still busy
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._made_dir: Path | None = None  # the socket's directory, when this holder made it
        self._started_at = _now_iso()

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Listen first, then learn Slurm's allocations, then grab the rest.

        Listening first closes a race: a prolog that finds no socket lets its job proceed,
        but that job was allocated before its prolog ran, so the query below sees it.
        A prolog that connects now waits in the backlog until the grab is done.
        """
        _check_parent("control socket", self.socket_path)
        if len(os.fsencode(self.socket_path)) >= UNIX_PATH_MAX:
            raise LaunchError(f"control socket path {self.socket_path} is {len(os.fsencode(self.socket_path))} bytes; "
                              f"a unix socket path must be under {UNIX_PATH_MAX}: pick a shorter --socket")
        _check_parent("state file", self.state_path)
        if self.state_path.is_dir():
            raise LaunchError(f"state file {self.state_path} is a directory; pass a file path to --state")
        try:
            self._server = self._listen()
        except PermissionError as exc:
            raise LaunchError(f"cannot create the control socket {self.socket_path} ({exc.strerror}); "
                              "the holder runs as root (or pass --socket/--state you may write)") from None
        except OSError as exc:
            raise LaunchError(f"cannot create the control socket {self.socket_path} ({exc.strerror})") from None
        allocations: dict[str, list[int]] = {}
        if self.query_allocations is not None:
            allocations = self.query_allocations()
        with self._state_lock:
            for job, gpus in allocations.items():
                mine = [g for g in gpus if g in self.holders]
                if mine:
                    self.released[job] = mine
                    self._released_at[job] = time.monotonic()
                    log.info("job %s already owns GPU(s) %s (from Slurm); not taking them", job, mine)
            owned = self._owned_gpus()
        _, busy = self._hold_all(sorted(set(self.holders) - owned))
        if busy:
            log.warning("GPU(s) %s are busy; will keep trying to hold them", busy)
            with self._state_lock:
                self.pending.update(busy)
        with self._state_lock:
            try:
                self._write_state()
            except OSError as exc:  # shutdown (the caller's) frees what was just held
                raise LaunchError(f"cannot write the state file {self.state_path} ({exc.strerror})") from None
        log.info("holding GPU(s) %s; socket %s", self._held_gpus(), self.socket_path)

    def serve_forever(self) -> None:
        assert self._server is not None, "call start() first"
        maintenance = threading.Thread(target=self._maintenance_loop, name="maintenance", daemon=True)
        maintenance.start()
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        maintenance.join(timeout=5)

    @property
    def started(self) -> bool:
        """True once this holder owns the socket (so shutdown may remove it and the state)."""
        return self._server is not None

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Free every GPU and remove the socket and state: no holder means nothing held."""
        self._stop.set()
        if self._server is not None:
            self._server.close()
        for index, holder in self.holders.items():
            with self._gpu_locks[index]:
                holder.release()
        for path in (self.socket_path, self.state_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        if self._made_dir is not None:
            try:
                self._made_dir.rmdir()  # only the directory it made, and only when empty
            except OSError:
                pass
        log.info("stopped; all GPUs freed")

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop())

    def _listen(self) -> socket.socket:
        self._socket_directory()
        try:
            mode = self.socket_path.lstat().st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not (stat.S_ISSOCK(mode) or stat.S_ISLNK(mode)):
            # a stale socket is removed below; anything else at that path is someone's file
            raise LaunchError(f"control socket path {self.socket_path} exists and is not a socket; "
                              "refusing to replace it: pick another --socket")
        if mode is not None:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.socket_path))
            except OSError:
                self.socket_path.unlink()  # stale, from a holder that died
            else:
                raise LaunchError(
                    f"another keepalive holder already listens on {self.socket_path}; stop it first"
                )
            finally:
                probe.close()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600, no window with looser bits
        try:
            server.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        server.listen(64)
        return server

    def _socket_directory(self) -> None:
        """Make the socket's private directory (0700, ours) if it is missing; never change the
        mode of one that exists. A directory others may write to (or own) could have the
        socket swapped under the prolog, so it is refused rather than "fixed"."""
        directory = self.socket_path.parent
        if not directory.exists():
            directory.mkdir(parents=True, mode=0o700)
            os.chmod(directory, 0o700)  # ours, just made: the umask may have narrowed it further
            self._made_dir = directory
        st = directory.stat()
        if st.st_mode & stat.S_IWOTH:
            raise LaunchError(
                f"refusing a control socket directly in {directory}: anyone may write there "
                f"(mode {stat.S_IMODE(st.st_mode):o}); give a path in a private directory, e.g. "
                f"--socket {directory / 'launch-keepalive' / self.socket_path.name}")
        if st.st_uid not in (0, os.geteuid()):
            raise LaunchError(f"refusing a control socket in {directory}: it belongs to uid {st.st_uid}, "
                              "not to root or this holder")

    # ---- requests --------------------------------------------------------------------

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                uid = peer_uid(conn)
                conn.settimeout(5.0)
                line = read_line(conn)
                if uid not in self.allowed_uids:
                    # read before refusing, so the client sees the refusal, not a broken pipe
                    log.warning("refused a connection from uid %d (root only)", uid)
                    conn.sendall(encode({"ok": False, "error": "permission denied: root only"}))
                    return
                message = decode(line)
                answer = self.dispatch(message)
            except (ValueError, OSError) as exc:
                answer = {"ok": False, "error": f"bad request: {exc}"}
            try:
                conn.sendall(encode(answer))
            except OSError:
                log.warning("client went away before its answer to %s", answer)

    def dispatch(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        try:
            if op == "status":
                with self._state_lock:
                    return {"ok": True, **self._state()}
            job = message.get("job")
            if not isinstance(job, str) or not job:
                return {"ok": False, "error": f"{op!r} needs a job id"}
            gpus = message.get("gpus")
            if gpus is not None and not (
                isinstance(gpus, list) and all(isinstance(g, int) and g >= 0 for g in gpus)
            ):
                return {"ok": False, "error": "gpus must be a list of GPU indices"}
            if op == "release":
                if gpus is None:
                    return {"ok": False, "error": "release needs gpus"}
                return self.release(job, gpus)
            if op == "reclaim":
                return self.reclaim(job, gpus)
        except Exception as exc:  # keep serving other jobs; the client gets the reason
            log.exception("%s failed", op)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def release(self, job: str, gpus: list[int]) -> dict[str, Any]:
        """Free exactly `gpus` for `job`; return only once they are actually free."""
        t0 = time.monotonic()
        absent = sorted({g for g in gpus if g not in self.present})
        if absent:  # refused before anything is released: the prolog fails, Slurm drains the node
            log.error("job %s was allocated GPU(s) %s, which this node does not have (it has %s)", job, absent,
                      sorted(self.present))
            return {"ok": False, "error": f"job {job} was allocated GPU(s) {absent}, which this node does not have "
                    f"(it has {sorted(self.present)}): Slurm's gres.conf lists GPUs the node lacks"}
        mine = sorted({g for g in gpus if g in self.holders})
        unmanaged = sorted({g for g in gpus if g not in self.holders})
        with self._state_lock:
            for other, owned in list(self.released.items()):
                # Slurm is the authority: a GPU it gives to `job` is no longer the other's.
                if other != job and set(owned) & set(mine):
                    log.warning("GPU(s) %s were still recorded for job %s; now job %s's",
                                sorted(set(owned) & set(mine)), other, job)
                    self.released[other] = [g for g in owned if g not in mine]
                    if not self.released[other]:
                        del self.released[other]
            self.released[job] = sorted(set(self.released.get(job, [])) | set(mine))
            self._released_at[job] = t0
            self.pending.difference_update(mine)
        for index in mine:
            with self._gpu_locks[index]:
                self.holders[index].release()
        with self._state_lock:
            self._write_state()
        log.info("released GPU(s) %s for job %s in %.1f ms", mine, job, 1e3 * (time.monotonic() - t0))
        return {"ok": True, "job": job, "released": mine, "unmanaged": unmanaged}

    def reclaim(self, job: str, gpus: list[int] | None) -> dict[str, Any]:
        """Hold `job`'s GPUs again (those recorded for it, plus `gpus` if given)."""
        t0 = time.monotonic()
        with self._state_lock:
            targets = set(self.released.pop(job, []))
            self._released_at.pop(job, None)
            if gpus is not None:
                targets |= {g for g in gpus if g in self.holders}
            # never take a GPU that another live job owns
            targets -= self._owned_gpus()
        reclaimed, pending = self._hold_all(sorted(targets))
        with self._state_lock:
            self.pending.update(pending)
            self._write_state()
        log.info("reclaimed GPU(s) %s from job %s in %.1f ms%s", reclaimed, job,
                 1e3 * (time.monotonic() - t0), f"; still busy: {pending}" if pending else "")
        return {"ok": True, "job": job, "reclaimed": reclaimed, "pending": pending}

    def _hold_all(self, indices: list[int], timeout: float | None = None) -> tuple[list[int], list[int]]:
        """Hold `indices`, skipping any a job owns meanwhile; all started at once, then waited
        for against one deadline, so N slow-starting GPUs take one start time, not N."""
        timeout = self.hold_timeout if timeout is None else timeout
        reclaimed: list[int] = []
        pending: list[int] = []
        waiting: list[int] = []
        for index in indices:
            if self._hold_one(index, 0.0) is None:
                continue
            (reclaimed if self.holders[index].held else waiting).append(index)
        deadline = time.monotonic() + timeout
        for index in waiting:
            ok = self._hold_one(index, max(0.0, deadline - time.monotonic()))
            if ok is not None:
                (reclaimed if ok else pending).append(index)
        return sorted(reclaimed), sorted(pending)

    def _hold_one(self, index: int, timeout: float) -> bool | None:
        """Try to hold one GPU; None if a job owns it now (so it must not be held)."""
        with self._gpu_locks[index]:
            with self._state_lock:
                if index in self._owned_gpus():
                    return None
            return self.holders[index].hold(timeout)

    # ---- maintenance -------------------------------------------------------------------

    def _maintenance_loop(self) -> None:
        next_reconcile = time.monotonic() + self.reconcile_interval
        while not self._stop.wait(0.25):
            with self._state_lock:
                # a GPU neither held nor owned by a job (e.g. its CUDA worker died) is retried too
                self.pending.update(i for i, h in self.holders.items()
                                    if not h.held and i not in self._owned_gpus())
                pending = sorted(self.pending - self._owned_gpus())
            if pending:
                got, _ = self._hold_all(pending, timeout=0.0)
                if got:
                    with self._state_lock:
                        self.pending.difference_update(got)
                        self._write_state()
                    log.info("now holding previously busy GPU(s) %s", got)
            if (self.reconcile_interval > 0 and self.query_allocations is not None
                    and time.monotonic() >= next_reconcile):
                next_reconcile = time.monotonic() + self.reconcile_interval
                try:
                    self.reconcile()
                except LaunchError as exc:
                    log.warning("reconcile with Slurm skipped: %s", exc)

    def reconcile(self) -> None:
        """Take back GPUs of jobs Slurm no longer knows (an epilog that never reached us)."""
        assert self.query_allocations is not None
        asked_at = time.monotonic()
        active = self.query_allocations()
        with self._state_lock:
            stale = [job for job in self.released
                     if job not in active and self._released_at.get(job, asked_at) < asked_at]
        for job in stale:
            log.warning("job %s is gone from Slurm without an epilog; reclaiming its GPUs", job)
            self.reclaim(job, None)

    # ---- state -----------------------------------------------------------------------

    def _owned_gpus(self) -> set[int]:
        return {g for owned in self.released.values() for g in owned}

    def _held_gpus(self) -> list[int]:
        return sorted(i for i, h in self.holders.items() if h.held)

    def _state(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "backend": self.backend,
            "managed": sorted(self.holders),
            "held": self._held_gpus(),
            "released": {job: gpus for job, gpus in sorted(self.released.items())},
            "pending": sorted(self.pending),
            "socket": str(self.socket_path),
            "started_at": self._started_at,
            "updated_at": _now_iso(),
        }

    def _write_state(self) -> None:
        # Readable by everyone: `launch doctor` and `launch keepalive status` run as users.
        atomic_write_text(self.state_path, json.dumps(self._state(), indent=1) + "\n", mode=0o644)
