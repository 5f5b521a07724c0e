"""The holder's control protocol: one JSON object per line, one request per connection.

Requests (client -> holder):
    {"op": "release", "job": "12", "gpus": [0, 1]}   free exactly these GPUs for job 12
    {"op": "reclaim", "job": "12", "gpus": [0, 1]}   hold job 12's GPUs again (gpus optional)
    {"op": "status"}
Responses (holder -> client): {"ok": true, ...} or {"ok": false, "error": "..."}.
The holder answers a release only after the locks/memory are actually freed, so the
acknowledgement is the prolog's proof that the job may start.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

from launch.errors import LaunchError

DEFAULT_RUN_DIR = Path("/run/launch-keepalive")
# The socket lives in its own 0700 directory so the state file beside it stays readable
# by `launch doctor` run as an ordinary user.
DEFAULT_SOCKET = DEFAULT_RUN_DIR / "ctl" / "control.sock"
DEFAULT_STATE = DEFAULT_RUN_DIR / "state.json"
MAX_MESSAGE_BYTES = 64 * 1024


def socket_path(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("LAUNCH_KEEPALIVE_SOCKET") or DEFAULT_SOCKET)


def state_path(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("LAUNCH_KEEPALIVE_STATE") or DEFAULT_STATE)


def parse_gpu_list(text: str, source: str = "", unique: bool = False) -> list[int]:
    """'0,1' or '0-2,5' (SLURM_JOB_GPUS / GRES IDX syntax) -> sorted unique indices.

    `source` names where the text came from in the error (e.g. "--gpus"); with `unique`, an index
    given twice is an error rather than merged (a user's list, not Slurm's)."""
    where = f"{source}: " if source else ""
    indices: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo or lo < 0:
                    raise ValueError(part)
                indices.extend(range(lo, hi + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError(part)
                indices.append(value)
        except ValueError:
            raise LaunchError(
                f"{where}bad GPU list {text!r}; expected indices like '0,1' or '0-3'"
            ) from None
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if unique and repeated:
        raise LaunchError(f"{source or 'GPU list'} {text!r} names GPU {repeated[0]} twice")
    return sorted(set(indices))


def seconds(value: float, label: str, allow_zero: bool = False) -> float:
    """A finite number of seconds (> 0, or >= 0 with `allow_zero`), else a one-line error that
    starts with `label` (where the value came from, e.g. "--timeout -1")."""
    if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        raise LaunchError(f"{label}: must be a number of seconds {'>=' if allow_zero else '>'} 0")
    return value


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, sort_keys=True) + "\n").encode()


class MessageTooLong(ValueError):
    pass


def read_line(sock: socket.socket) -> bytes:
    """One newline-terminated message (or what came before the peer closed), at most MAX_MESSAGE_BYTES.

    Raises MessageTooLong past the limit; the socket's own timeout applies to each recv.
    """
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_MESSAGE_BYTES:
            raise MessageTooLong(f"message longer than {MAX_MESSAGE_BYTES} bytes")
    return buf


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line.decode())
    if not isinstance(message, dict):
        raise ValueError("message is not a JSON object")
    return message


class HolderNotRunning(LaunchError):
    """Nothing listens on the socket: no holder, so there is nothing to release."""


def request(path: Path, message: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request and wait at most `timeout` seconds for its response.

    Raises HolderNotRunning when no holder listens, LaunchError on a timeout or a
    malformed/negative answer.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise HolderNotRunning(f"no keepalive holder listens on {path} ({exc.strerror})") from None
        except PermissionError:
            raise LaunchError(f"permission denied on {path}; the keepalive socket is root-only") from None
        except TimeoutError:
            raise LaunchError(f"keepalive holder on {path} did not accept within {timeout:g} s") from None
        try:
            sock.sendall(encode(message))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the holder answered and closed early (a refusal); read that answer below
        try:
            buf = read_line(sock)
        except MessageTooLong:
            raise LaunchError(f"keepalive holder on {path} sent an oversized answer") from None
        except TimeoutError:
            raise LaunchError(
                f"keepalive holder on {path} did not answer {message.get('op')!r} within {timeout:g} s"
            ) from None
        if not buf:
            raise LaunchError(f"keepalive holder on {path} closed the connection without answering")
        try:
            answer = decode(buf)
        except ValueError:
            raise LaunchError(f"keepalive holder on {path} sent a malformed answer") from None
        if not answer.get("ok"):
            raise LaunchError(f"keepalive holder refused {message.get('op')!r}: {answer.get('error')}")
        return answer
    finally:
        sock.close()
