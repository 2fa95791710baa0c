"""Mesh: the named process groups of one rank, built from a Topology and passed explicitly.

Nothing here is global: every function that communicates takes a ``Mesh`` (or a group from
it) as an argument. ``torch.distributed``'s default group must exist (it is what
``init_process_group`` creates); the Mesh never stores it in a module-level variable.

Nodes (topology.py): ``topology.nodes`` when the config simulates them (``parallel.sim_nodes``),
else the hosts the ranks run on, when each holds a contiguous block of equally many ranks (what
torchrun's LOCAL_WORLD_SIZE describes). The communicator of a group whose ranks span nodes is
wrapped by tiers.py: its slow-tier bytes are counted, and throttled when the topology gives the
simulated slow tier a bandwidth or latency.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .collectives import Comm
from .flight import Recorder
from .ledger import Ledger
from .shm import X86 as _X86, SharedComm
from .shm_host import collective_timeout
from .tiers import Link, tiered
from .topology import DERIVED, GROUPS, Topology

ALL_GROUPS = tuple(GROUPS) + DERIVED


def subgroup(ranks: list[int]):
    """``dist.new_group(ranks)`` under the default group's timeout. torch gives a new group its
    backend's own default otherwise (30 minutes for gloo), so a hang inside a subgroup (the tp or
    dp group of a 2-D layout, a pipeline's pp group) went unreported for 30 minutes, not
    ``train.timeout_s`` (tests/distributed/test_diagnosis.py). The timeout is the one the group is
    created with: gloo's point-to-point waits keep the timeout its connection was made under
    (``ProcessGroup.set_timeout`` changes the collectives' only), so it is not set afterwards."""
    return dist.new_group(ranks, timeout=collective_timeout(dist.group.WORLD))  # None: torch's default


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


@dataclass
class Mesh:
    """One rank's view of the world: its coordinates and a process group per named axis."""

    topology: Topology
    rank: int
    device: torch.device
    groups: dict = field(default_factory=dict)
    members: dict = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    algorithm: str = "backend"
    flight: Recorder | None = None
    """The rank's flight recorder (flight.py); ``mesh.flight.check = True``: check mode."""
    transport: str = "auto"
    """``parallel.comm_transport``: process_group, shared or auto (see :meth:`comm`)."""
    comm_thread: bool = False
    """``parallel.comm_thread``: shared-memory comms queue their asynchronous collectives on a
    thread of their own (distributed/shm_thread.py)."""
    places: list = field(default_factory=list)
    """(host, device) of every global rank, gathered once by :meth:`build` (host: hostname and
    kernel boot id, so that two machines with one hostname still differ)."""
    _comms: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, topology: Topology, device: torch.device | str = "cpu", algorithm: str = "backend",
              check_collectives: bool = False, transport: str = "auto", flight_dir: str | None = None,
              comm_thread: bool = False) -> "Mesh":
        """Create every named group (collectively: all ranks must call this, in the same order).
        ``algorithm``: the collectives' default (``parallel.comm_algorithm``; see algorithms.py).
        ``check_collectives``: fingerprint every collective first (``parallel.check_collectives``).
        ``flight_dir``: where the flight recorder also dumps on a failure (``Recorder.run_dir``).
        ``comm_thread``: ``parallel.comm_thread``."""
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build needs torch.distributed initialised (use shardlab.launch)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != topology.world_size:
            raise ValueError(f"topology {topology.describe()} has {topology.world_size} ranks, world has {world}")
        mesh = cls(topology, rank, torch.device(device), algorithm=algorithm, transport=transport,
                   comm_thread=comm_thread)
        mesh.flight.check, mesh.flight.run_dir = check_collectives, flight_dir
        dev = mesh.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        mesh.places = [None] * world
        dist.all_gather_object(mesh.places, (_host_id(), str(dev)))
        mesh.topology = topology = _with_host_nodes(topology, [h for h, _ in mesh.places])
        seen: dict[tuple, object] = {}
        for name in ALL_GROUPS:
            for ranks in topology.groups(name):
                key = tuple(ranks)
                if key not in seen:  # identical rank sets share one communicator
                    seen[key] = subgroup(list(ranks)) if len(ranks) < world else dist.group.WORLD
                if rank in ranks:
                    mesh.groups[name] = seen[key]
                    mesh.members[name] = list(ranks)
        return mesh

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Mesh":
        """A world of one with no process groups: every collective is the identity."""
        topo = Topology()
        return cls(topo, 0, torch.device(device), {}, {name: [0] for name in ALL_GROUPS})

    def __post_init__(self):
        if self.flight is None:
            self.flight = Recorder(self.rank)

    def group(self, name: str):
        """The process group of ``name`` (None in a single-process Mesh)."""
        if name not in self.members:
            raise KeyError(f"unknown group {name!r}; groups are {ALL_GROUPS}")
        return self.groups.get(name)

    def comm(self, name: str) -> Comm:
        """The counted collectives handle of group ``name`` (see collectives.py)."""
        if name not in self._comms:
            args = (name, self.group(name), self.members[name], self.rank, self.ledger, self.algorithm, self.flight)
            comm = SharedComm(*args, device=self.device, comm_thread=self.comm_thread) if self._shared(name) \
                else Comm(*args)
            one_host = len({self.places[r][0] for r in self.members[name]}) == 1 if self.places else True
            self._comms[name] = tiered(comm, self.node_of, self.link, one_host) if self.topology.nodes > 1 else comm
        return self._comms[name]

    def node_of(self, rank: int) -> int:
        """The node of global ``rank`` (module doc)."""
        return self.topology.node(rank)

    @property
    def link(self) -> Link:
        """The slow tier between nodes, as the topology describes it for the throttle."""
        return Link(self.topology.inter_node_gbps, self.topology.inter_node_latency_us)

    def _shared(self, name: str) -> bool:
        """Whether group ``name`` runs on the shared-memory transport (shm.py): ``transport`` =
        shared (its ranks must be on one host), or auto and its ranks all on one CUDA device, or
        auto, CPU, one x86-64 host (where its barrier is a counter in shared memory:
        docs/collectives.md, "Shared-memory transport") and ``comm_algorithm`` = backend."""
        if self.transport not in ("process_group", "shared", "auto"):
            raise ValueError(f"parallel.comm_transport = {self.transport!r}; choose process_group, shared or auto")
        places = [self.places[r] for r in self.members[name]] if self.places else []
        if self.transport == "process_group" or len(places) < 2:
            return False
        if self.transport == "shared" and len({h for h, _ in places}) > 1:
            raise ValueError(f"parallel.comm_transport = shared, but group {name!r} spans hosts "
                             f"{sorted({h for h, _ in places})}; use process_group or auto")
        if self.transport == "shared" or len(set(places)) > 1:
            return self.transport == "shared"
        # on CPU only with the backend's algorithms: an own algorithm asked for (comm_algorithm) runs
        return places[0][1].startswith("cuda") or (places[0][1] == "cpu" and _X86 and self.algorithm == "backend")

    def size(self, name: str) -> int:
        return len(self.members[name])

    def local_rank(self, name: str) -> int:
        """This rank's index inside its ``name`` group (e.g. its tp rank)."""
        return self.members[name].index(self.rank)

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's ``name`` group, in group order."""
        return list(self.members[name])

    @property
    def coords(self) -> dict[str, int]:
        return self.topology.coords(self.rank)

    @property
    def world_size(self) -> int:
        return self.topology.world_size


def _with_host_nodes(topology: Topology, hosts: list[str]) -> Topology:
    """``topology`` with ``nodes`` = the hosts, when it simulates none and the ranks of each host
    form one contiguous block, all blocks equal (else unchanged: one node, no tiers)."""
    distinct = list(dict.fromkeys(hosts))
    if topology.nodes > 1 or len(distinct) < 2 or len(hosts) % len(distinct):
        return topology
    per = len(hosts) // len(distinct)
    if any(hosts[r] != distinct[r // per] for r in range(len(hosts))):
        return topology
    try:
        return replace(topology, nodes=len(distinct))
    except ValueError:  # an ep group spread unevenly over the hosts: counted as one node
        return topology
