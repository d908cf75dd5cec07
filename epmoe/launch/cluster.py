"""The Ray cluster a run uses: a private local one, or one joined with `--address`.

A local run starts its own cluster whatever else runs on the machine (`RAY_ADDRESS`, a
`ray start --head`, a stale `ray_current_cluster` file are all ignored): its own temp dir, its
own ports, every Ray process bound to loopback (Ray binds all interfaces unless the node
address is loopback, and rewrites 127.0.0.1 to the machine's address unless it runs as a
single-machine cluster: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), and Ray's token authentication
on with a fresh token written to a file only the user can read (never to the environment,
logs or the run's outputs). The ranks' gloo/NCCL sockets go to loopback too.

Joining with `--address` uses whatever authentication that cluster has (RAY_AUTH_MODE /
RAY_AUTH_TOKEN_PATH in the user's environment, see README "Security"). Failing to connect is an
InputError (nothing was started): an unresolvable host at once, a port nothing answers at after
the run's timeout, a cluster that refuses this driver (its token) when Ray gives up (~20 s).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from epmoe.env import RAY_TMPDIR
from epmoe.launch import reaper
from epmoe.launch.errors import InputError, LaunchError, stop_handlers_kept

LOOPBACK = "127.0.0.1"
# Unix socket paths hold 107 bytes; Ray's under our temp dir take about 82
# ("/epmoe-XXXXXXXX/ray/session_<date>_<time>_<pid>/sockets/plasma_store").
SOCKET_PATH_ROOM = 107 - 84
DEFAULT_RAY_PORT = 6379


@dataclass(frozen=True)
class ClusterAddress:
    """`--address` parsed: host, port, and whether it names a Ray Client server (ray://)."""

    text: str
    host: str
    port: int
    client: bool

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def for_ray(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'ray://' if self.client else ''}{host}:{self.port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> ClusterAddress:
    """host:port | ray://host:port -> ClusterAddress; InputError for a malformed address, an
    unresolvable host, or ray:// without the Ray Client package."""
    rest, client = text.strip(), False
    if rest.startswith("ray://"):
        rest, client = rest[len("ray://"):], True
        if importlib.util.find_spec("grpc") is None:
            raise InputError(f"--address {text}: ray:// needs the Ray Client (the grpc "
                             f"package): pip install 'ray[client]', or pass the cluster's GCS "
                             f"address host:port instead")
    if "://" in rest:
        raise InputError(f"--address {text!r}: use host:port (the head's GCS port, default "
                         f"{DEFAULT_RAY_PORT}) or ray://host:port")
    if rest.startswith("["):  # [v6]:port
        host, _, port = rest[1:].partition("]")
        port = port[1:] if port.startswith(":") else ""
    else:
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    port = port or str(10001 if client else DEFAULT_RAY_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--address {text!r} must be host:port with a port in 1..65535 "
                         f"(e.g. 10.0.0.1:{DEFAULT_RAY_PORT})")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"--address {text}: host {host!r} does not resolve ({e}); give the "
                         f"head node's name or IP") from None
    return ClusterAddress(text, host, int(port), client)


def wait_reachable(addr: ClusterAddress, seconds: float) -> None:
    """Until `seconds` pass, try a TCP connection to the address (a cluster may be starting)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr.host, addr.port), timeout=max(0.05, min(left, 2))):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() + 0.25 >= deadline:
            raise InputError(f"nothing answers at {addr.host}:{addr.port} within {seconds:g} s "
                             f"({why}): start the cluster (`ray start --head --port "
                             f"{addr.port}`) or fix --address")
        time.sleep(0.25)


def init_ray(error: type, what: str, **kwargs) -> None:
    """ray.init(**kwargs) in this thread (Ray's driver breaks when initialized from another
    thread); a failure becomes `error` with one line and leaves Ray shut down. Ray bounds its
    own retries (about 20 s when a cluster refuses this driver's token)."""
    import ray

    try:
        with stop_handlers_kept():  # not Ray's: a SIGTERM must unwind and stop the cluster
            ray.init(**kwargs)
    except Exception as e:
        if ray.is_initialized():
            ray.shutdown()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = (" (if the cluster uses token authentication, export RAY_AUTH_MODE=token and "
                "RAY_AUTH_TOKEN_PATH=<its token file>)" if isinstance(e, ConnectionError) else "")
        raise error(f"{what}: {type(e).__name__}: {first}{hint}") from None


class _Env:
    """Set/unset variables of this process and put them back afterwards."""

    def __init__(self):
        self._saved: dict[str, str | None] = {}

    def set(self, **kv: str | None) -> None:
        for k, v in kv.items():
            self._saved.setdefault(k, os.environ.get(k))
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def restore(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved.clear()


def _ray_rereads_env() -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once at import and caches the auth mode and
    token: make this process see the values just set (its child processes read them anew)."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get(
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "1").lower() not in ("0", "false")
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # Ray < 2.52: no token authentication
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _listens_beyond_loopback(port: int) -> bool:
    """Whether something answers at this machine's network address on `port` (a Ray head
    started as a cluster listens on every interface; a loopback-only one does not)."""
    from ray._private.services import node_ip_address_from_perspective

    try:
        ip = node_ip_address_from_perspective()
        with socket.create_connection((ip, port), timeout=1):
            return not is_loopback(ip)
    except OSError:
        return False


def _token_auth_on() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:
        return False
    return is_token_auth_enabled()


def loopback_env() -> dict[str, str]:
    """What makes Ray and the ranks' sockets stay on loopback on this machine."""
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    if sys.platform.startswith("linux"):
        env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    return env


class RayCluster:
    """The cluster of one run. `connect()` starts a private one (address None) or joins the
    given one; `close()` disconnects, stops a private cluster, removes its temp dir and token,
    and restores this process's environment."""

    def __init__(self, address: ClusterAddress | None, timeout_s: float,
                 num_cpus: int | None = None, num_gpus: int = 0):
        self.address, self.timeout_s = address, timeout_s
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.tmp: str | None = None
        self._reaper: Reaper | None = None
        self._env = _Env()
        self._connected = False

    @property
    def private(self) -> bool:
        return self.address is None

    def describe(self) -> str:
        if self.private:
            return f"private Ray cluster on {LOOPBACK} (token auth, temp dir {self.tmp})"
        return f"Ray cluster at {self.address.for_ray}"

    def connect(self, init_kwargs: dict) -> None:
        import ray

        if not (sys.stdout.isatty() and sys.stderr.isatty()):  # Ray colours raylet lines
            self._env.set(RAY_COLOR_PREFIX=os.environ.get("RAY_COLOR_PREFIX", "0"))
        if ray.is_initialized():
            raise LaunchError("this process is already connected to Ray: a run starts or "
                              "joins its own cluster (call ray.shutdown() first)")
        self._connected = True  # from here on, close() shuts Ray down
        if self.private:
            self._start_private(init_kwargs)
        else:
            self._join(init_kwargs)

    def _join(self, init_kwargs: dict) -> None:
        addr = self.address
        wait_reachable(addr, self.timeout_s)
        if addr.loopback and not _listens_beyond_loopback(addr.port):
            # a single-machine cluster on loopback: keep 127.0.0.1 (Ray would rewrite it to the
            # machine's address, where that cluster does not listen)
            self._env.set(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        _ray_rereads_env()
        init_ray(InputError, f"joining {addr.for_ray}", address=addr.for_ray, **init_kwargs)

    def _start_private(self, init_kwargs: dict) -> None:
        parent = RAY_TMPDIR or tempfile.gettempdir()
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise InputError(f"EPMOE_RAY_TMPDIR ({parent!r}) must be a writable folder")
        if len(parent) > SOCKET_PATH_ROOM:
            raise InputError(f"EPMOE_RAY_TMPDIR ({parent!r}, {len(parent)} characters) is too "
                             f"long for Ray's socket paths (at most {SOCKET_PATH_ROOM}): pick a "
                             f"shorter folder, e.g. /tmp/r")
        # <tmp> (0700, ours) holds the token and Ray's temp dir (which Ray makes 0777)
        self.tmp = tempfile.mkdtemp(prefix="epmoe-", dir=RAY_TMPDIR)
        token_path = os.path.join(self.tmp, "auth_token")
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._reaper = Reaper.start(self.tmp)  # the cluster goes with us, even on kill -9
        # RAY_AUTH_TOKEN would win over the file; RAY_ADDRESS would make Ray join another cluster
        self._env.set(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path,
                      RAY_AUTH_TOKEN=None, RAY_ADDRESS=None, **loopback_env(),
                      **{reaper.TAG_VAR: self._reaper.tag})
        _ray_rereads_env()
        if not _token_auth_on():
            raise InputError("this Ray has no token authentication (Ray >= 2.52 has it): "
                             "upgrade Ray, or run on a cluster you secured with --address")
        init_ray(LaunchError, "starting a private Ray cluster", address="local",
                 num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                 _temp_dir=os.path.join(self.tmp, "ray"), _node_ip_address=LOOPBACK,
                 **init_kwargs)
        self._env.set(**{reaper.TAG_VAR: None})  # Ray's daemons (and the workers they start)
        # carry the tag; what this process starts from here on is not the reaper's to stop
        import ray

        ip = ray.util.get_node_ip_address()
        if not is_loopback(ip):
            raise LaunchError(f"the private Ray cluster came up on {ip}, not loopback: refusing "
                              f"to run (use --address with a cluster you secured)")

    def close(self) -> None:
        import ray

        try:
            if self._connected and ray.is_initialized():
                ray.shutdown()  # stops the cluster if private, else only disconnects
        finally:
            self._env.restore()
            try:
                _ray_rereads_env()
            except Exception:  # pragma: no cover (Ray gone half-way)
                pass
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None
            if self._reaper is not None:  # sweeps what Ray's shutdown left (its agents)
                self._reaper.finish()
                self._reaper = None
            self._connected = False


@dataclass
class Reaper:
    """The reaper process (epmoe/launch/reaper.py) of a private cluster: it sweeps every
    process carrying `tag` and removes the temp dir when `finish()` closes its pipe, or when
    this process dies without doing so."""

    proc: subprocess.Popen
    pipe_w: int  # ours; the reaper holds the read end
    tag: str

    @classmethod
    def start(cls, tmp: str) -> Reaper:
        tag = secrets.token_hex(8)
        r, w = os.pipe()  # not inherited by anything else we start (PEP 446)
        try:
            proc = subprocess.Popen([sys.executable, reaper.__file__, str(r), tag, tmp],
                                    pass_fds=(r,), start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        return cls(proc, w, tag)

    def finish(self, timeout_s: float = reaper.GRACE_S + 10) -> None:
        os.close(self.pipe_w)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # pragma: no cover (it gives up after its grace)
            pass
