"""llama.cpp's RPC backend: a model whose layers are split over `rpc-server`s on other machines.

llama.cpp's own tools do it this way (common/arg.cpp, `--rpc`): the RPC backend registry's
`ggml_backend_rpc_add_server(endpoint)` gives each server's devices, and the model's parameters list
them (`llama_model_params.devices`, NULL-terminated). The devices here are never registered
process-wide, so a model loaded without them (the draft, by default) stays on this machine.

What llama.cpp does with the list: the offloaded layers (`n_gpu_layers`, the last ones) are split
over the listed devices in order, in proportion to `tensor_split` (default: each device's free
memory); the rest, and the token embeddings, stay on this machine's CPU, which cannot itself be in
the list. localspec lists the RPC servers first (as llama.cpp does: fewer transfers), then the local
GPUs, and when this machine has no GPU and the layer count is left to it, keeps a share of the layers
on its CPU in proportion to its memory against the servers' (as ggml reports it: on Linux a CPU
device's "free" memory is the machine's whole RAM).

Each step's oracle pass then crosses the network once per device boundary, whatever the number of
tokens in it: speculation (k+1 tokens per pass) pays more the more a pass costs.

rpc-server has no authentication and runs what it is sent: it must listen on loopback or a trusted
network only.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from localspec.llama.bindings import PACKAGE_DIR, VERSION, llama_cpp

from localspec.llama.devices import Device, ggml, local_gpus
from localspec.llama.errors import LlamaError
from localspec.llama.model import model_n_layer

BUILD_SCRIPT = "scripts/build_rpc.sh"
DEFAULT_PORT = 50052
TIMEOUT_ENV = "LOCALSPEC_RPC_TIMEOUT"  # seconds to connect to a server and for it to answer the handshake
DEFAULT_TIMEOUT = 5.0

# the RPC wire protocol's handshake (ggml/src/ggml-rpc/ggml-rpc.cpp): | cmd (1 byte) | size (8 bytes) | data |
_CMD_HELLO = 14  # fixed across protocol versions ("RPC_CMD_HELLO must be always 14")
_CMD_DEVICE_COUNT = 15
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities; zero asks for plain TCP


class RPCError(LlamaError):
    """RPC was asked for and cannot be used: the message says why and what to do."""


def build_dir(version: str | None = None) -> Path:
    """Where scripts/build_rpc.sh puts the RPC-enabled llama-cpp-python (site/) and rpc-server (bin/)."""
    from localspec.cache import cache_dir

    return cache_dir() / "rpc" / f"llama.cpp-{version or VERSION}"


def supports_rpc() -> bool:
    return bool(llama_cpp.llama_supports_rpc())


def require_rpc() -> None:
    """Raise RPCError, naming the way to a build with RPC, unless the loaded llama.cpp has it."""
    if supports_rpc():
        return
    raise RPCError(
        f"RPC was asked for, but the installed llama-cpp-python {VERSION} ({PACKAGE_DIR}) was "
        f"built without llama.cpp's RPC backend. Rebuild it with RPC: CMAKE_ARGS=\"-DGGML_RPC=on\" pip install "
        f"--force-reinstall --no-deps --no-cache-dir llama-cpp-python=={VERSION} ; or run {BUILD_SCRIPT} (it builds "
        f"an RPC-enabled copy and rpc-server into {build_dir()}) and put its site/ directory first on "
        f"PYTHONPATH")


_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9._-]+):(?P<port>\d{1,5})")


def parse_servers(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """'HOST:PORT[,HOST:PORT...]' (or a list of them) -> the endpoints, in order, checked.
    llama.cpp splits an endpoint at its first ':', so an IPv6 address cannot be written: use a name."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [s for v in value for s in str(v).split(",")]
    servers: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            raise ValueError(f"RPC servers: an empty entry in {value!r} (give HOST:PORT[,HOST:PORT...])")
        m = _ENDPOINT.fullmatch(item)
        if not m or not 1 <= int(m["port"]) <= 65535:
            raise ValueError(f"RPC server {item!r}: give HOST:PORT, e.g. 192.168.1.20:{DEFAULT_PORT} (an IPv6 "
                             "address needs a host name: llama.cpp splits at the first ':')")
        endpoint = f"{m['host']}:{int(m['port'])}"
        if endpoint in servers:
            raise ValueError(f"RPC server {endpoint} is listed twice")
        servers.append(endpoint)
    return tuple(servers)


@dataclass(frozen=True)
class ServerInfo:
    endpoint: str
    protocol: tuple[int, int, int]
    n_devices: int


def _timeout() -> float:
    try:
        return max(0.1, float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT)))
    except ValueError:
        return DEFAULT_TIMEOUT


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection was closed")
        data += chunk
    return data


def probe(endpoint: str, timeout: float | None = None) -> ServerInfo:
    """Connect to an rpc-server, shake hands as llama.cpp does and ask for its device count, then
    hang up: RPCError naming the server on any failure. llama.cpp itself aborts the process when a
    server is unreachable or speaks another protocol, so this runs before anything loads."""
    timeout = _timeout() if timeout is None else timeout
    host, port = endpoint.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except socket.gaierror as e:
        raise RPCError(f"RPC server {endpoint}: cannot resolve {host!r} ({e.strerror})") from None
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise RPCError(f"RPC server {endpoint} is unreachable ({reason}): start `rpc-server --host ADDRESS --port "
                       f"{port}` there (see {BUILD_SCRIPT}), and check the address and the firewall") from None
    try:
        with sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CONN_CAPS) + bytes(_CONN_CAPS))
            size = struct.unpack("<Q", _recv_exact(sock, 8))[0]
            if not 4 <= size <= 4096:
                raise ValueError(f"a handshake answer of {size} bytes")
            major, minor, patch = _recv_exact(sock, size)[:3]
            client = client_protocol()
            if client is not None and (major != client[0] or minor > client[1]):
                raise RPCError(
                    f"RPC server {endpoint} speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp "
                    f"{'.'.join(map(str, client))}: build rpc-server from the same llama.cpp as llama-cpp-python "
                    f"{VERSION} ({BUILD_SCRIPT} does)")
            sock.sendall(struct.pack("<BQ", _CMD_DEVICE_COUNT, 0))
            if struct.unpack("<Q", _recv_exact(sock, 8))[0] != 4:
                raise ValueError("a malformed device count")
            n_devices = struct.unpack("<I", _recv_exact(sock, 4))[0]
    except TimeoutError:
        raise RPCError(f"RPC server {endpoint} accepted the connection but did not answer within {timeout:g} s: an "
                       "rpc-server serves one client at a time, so another program may be using it (or it is not an "
                       f"rpc-server; ${TIMEOUT_ENV} sets the wait)") from None
    except (OSError, ValueError) as e:
        raise RPCError(f"{endpoint} does not answer as an rpc-server ({e}): is the port right?") from None
    if n_devices == 0:
        raise RPCError(f"RPC server {endpoint} offers no device")
    return ServerInfo(endpoint=endpoint, protocol=(major, minor, patch), n_devices=n_devices)


def client_protocol() -> tuple[int, int, int] | None:
    """The RPC protocol version of the loaded llama.cpp, from the ggml-rpc.h installed beside it (None
    when it is not there: llama.cpp then checks it itself, by aborting)."""
    base = PACKAGE_DIR
    for header in (base / "include" / "ggml-rpc.h", base.parent / "include" / "ggml-rpc.h"):
        try:
            text = header.read_text()
        except OSError:
            continue
        found = [re.search(rf"#define\s+RPC_PROTO_{part}_VERSION\s+(\d+)", text)
                 for part in ("MAJOR", "MINOR", "PATCH")]
        if all(found):
            return tuple(int(m[1]) for m in found)  # type: ignore[return-value, index]
    return None


def check_servers(servers: Sequence[str]) -> list[ServerInfo]:
    """Before loading: llama.cpp has RPC, and every server answers (RPCError naming the first that does not)."""
    if not servers:
        return []
    require_rpc()
    return [probe(s) for s in servers]


def server_devices(endpoint: str) -> list[Device]:
    """The devices an rpc-server offers, through the RPC registry's ggml_backend_rpc_add_server (they
    are not registered process-wide)."""
    require_rpc()
    g = ggml()
    reg = g.reg_by_name(b"RPC")
    address = g.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not address:
        raise RPCError("this llama.cpp's RPC backend has no ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)
    server_reg = add_server(endpoint.encode())
    if not server_reg:
        raise RPCError(f"RPC server {endpoint} offers no device")
    return [g.device(g.reg_dev_get(server_reg, i)) for i in range(g.reg_dev_count(server_reg))]


@dataclass(frozen=True)
class Placement:
    """Where a model's layers go: the arguments for LlamaModel, and a summary for people."""

    devices: tuple[Device, ...]
    tensor_split: tuple[float, ...]
    n_gpu_layers: int  # layers offloaded to `devices` (the last ones, the output layer included)
    n_layer: int  # repeating layers; llama.cpp places n_layer + 1 (the output layer is the last)
    layers: tuple[tuple[str, int], ...]  # (where, how many layers), in model order

    @property
    def summary(self) -> str:
        return ", ".join(f"{n} on {where}" for where, n in self.layers if n)


def place(path: str | os.PathLike, servers: Sequence[str], *, n_gpu_layers: int = -1) -> Placement:
    """Split a model over `servers` (and this machine's GPUs and CPU) as described in the module's
    docstring. `n_gpu_layers` -1: llama.cpp's all, except that a machine without a GPU keeps a share
    in proportion to its free memory; N >= 0: the last N layers go to the devices, the rest stay on
    this machine's CPU."""
    if n_gpu_layers == 0:
        raise ValueError("0 offloaded layers with RPC servers would leave every layer here: give the number of "
                         "layers for the servers (or -1 to split by free memory)")
    remote = [dev for s in servers for dev in server_devices(s)]
    gpus = local_gpus()
    devices = remote + gpus
    free = [float(max(dev.memory()[0], 1)) for dev in devices]
    n_layer = model_n_layer(path)
    total = n_layer + 1  # the output layer counts as one more
    if n_gpu_layers < 0:
        if gpus:
            n_offload = total
        else:
            cpu = ggml().dev_by_type(0)
            local_free = float(ggml().memory(cpu)[0]) if cpu else 0.0
            n_offload = round(total * sum(free) / (sum(free) + local_free))
            n_offload = min(total, max(1, n_offload))  # RPC was asked for: at least the output layer goes
    else:
        n_offload = min(n_gpu_layers, total)
    # llama.cpp's assignment (llama_model::load_tensors): layer il >= i_start goes to the first device
    # whose cumulative share exceeds (il - i_start) / n_offload
    shares = [f / sum(free) for f in free]
    cumulative = [sum(shares[:i + 1]) for i in range(len(shares))]
    i_start = total - n_offload
    counts = [0] * len(devices)
    for il in range(i_start, total):
        x = (il - i_start) / n_offload
        counts[next((i for i, c in enumerate(cumulative) if c > x), len(devices) - 1)] += 1
    layers = (("this machine's CPU", i_start),) + tuple(zip((_where(d) for d in devices), counts))
    return Placement(devices=tuple(devices), tensor_split=tuple(shares), n_gpu_layers=n_offload, n_layer=n_layer,
                     layers=layers)


def _where(dev: Device) -> str:
    return f"{dev.name} ({dev.description})" if dev.backend == "RPC" else f"{dev.name} (this machine)"
