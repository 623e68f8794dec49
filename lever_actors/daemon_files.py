"""The daemon's files: its lock, its Unix socket and its status file.

``<name>.lock`` is held with ``flock`` for the daemon's life, so a second daemon
on the same socket is refused and a socket left by a dead one can be removed
without racing a live one. The status file (``<name>.json``, next to the
socket) is written atomically once the listener is up; reading and validating
it is the client's side (``lever_actors.client.read_status``). Paths and the
status file's fields are documented in ``protocols/rpc.py``.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket as stdlib_socket
import stat
from pathlib import Path

import trio

from lever_actors import __version__
from lever_actors.client import default_socket_dir, read_status, status_path_for
from lever_actors.errors import BadStatusFile, ConfigError, DaemonAlreadyRunning, DaemonNotRunning
from protocols import rpc

log = logging.getLogger(__name__)

SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes including the NUL


class SocketFiles:
    """The lock file, socket and status file of one daemon (see the module docstring)."""

    def __init__(self, socket_path: Path):
        self.socket = Path(socket_path)
        if self.socket.suffix in (".json", ".lock"):
            raise ConfigError(f"socket path {self.socket} must not end in .json or .lock")
        if len(os.fsencode(self.socket)) > SOCKET_PATH_MAX:
            raise ConfigError(f"socket path {self.socket} is too long for a Unix socket "
                              f"({len(os.fsencode(self.socket))} bytes, at most {SOCKET_PATH_MAX})")
        self.status = status_path_for(self.socket)
        self.lock_path = self.socket.with_suffix(".lock")
        self._lock_fd: int | None = None
        self._created: list[Path] = []   # what release() removes: only files we made

    def _prepare_dir(self) -> None:
        directory = self.socket.parent
        if directory == default_socket_dir():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = directory.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ConfigError(f"{directory} must be owned by you and private (mode 0700); "
                                  f"it is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}")
        elif not directory.is_dir():
            directory.mkdir(mode=0o700, parents=True)

    def _holder(self) -> str:
        try:
            status = read_status(self.status)
            return f"pid {status['pid']}, started {status['started_at']}"
        except (DaemonNotRunning, BadStatusFile):
            pass
        try:
            return f"pid {int(self.lock_path.read_text().strip())}"
        except (OSError, ValueError):
            return "pid unknown"

    def acquire(self) -> None:
        """Take the lock and clear files a dead daemon left behind.

        Raises:
            DaemonAlreadyRunning: another daemon holds the lock (message names its pid).
            ConfigError: the directory is not private, or the socket path is not a socket.
        """
        self._prepare_dir()
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DaemonAlreadyRunning(
                f"a daemon is already serving {self.socket} ({self._holder()}); stop it "
                f"first or choose another --socket") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        try:
            self._remove_stale()
        except BaseException:
            self.release()
            raise

    def _remove_stale(self) -> None:
        if os.path.lexists(self.socket):
            if not stat.S_ISSOCK(os.lstat(self.socket).st_mode):
                raise ConfigError(f"{self.socket} exists and is not a socket; not replacing it")
            log.warning("removing stale socket %s left by a dead daemon (%s)",
                        self.socket, self._holder())
            os.unlink(self.socket)
        if os.path.lexists(self.status):
            log.warning("removing stale status file %s", self.status)
            os.unlink(self.status)

    def write_status(self, extra: dict | None = None) -> None:
        """Write the status file atomically (temporary file, then rename); ``extra`` adds fields."""
        body = {"pid": os.getpid(), "socket": os.fspath(self.socket),
                "protocol": list(rpc.PROTOCOL_VERSION), "version": __version__,
                "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **(extra or {})}
        tmp = self.status.with_name(f".{self.status.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(body, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.status)
        self._created.append(self.status)

    def open_listener(self) -> trio.SocketListener:
        listener = open_unix_listener(self.socket)
        self._created.append(self.socket)
        return listener

    def release(self) -> None:
        """Remove the socket and status file we made, then drop the lock."""
        if self._lock_fd is None:
            return
        for path in self._created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._created.clear()
        os.close(self._lock_fd)
        self._lock_fd = None


def open_unix_listener(path: Path, backlog: int = 128) -> trio.SocketListener:
    """Bind a mode-0600 Unix stream socket at ``path`` and listen.

    Binds synchronously: trio's async ``bind`` runs in a worker thread for
    Unix paths, which MockClock's autojump would race in tests.
    """
    sock = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))
