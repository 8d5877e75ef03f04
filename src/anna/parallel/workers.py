"""The ranks of a tensor-parallel engine: their processes, how they meet, and the commands rank 0
sends them.

Rank 0 is the engine's own process: it schedules, runs its share of the model and samples. Every
other rank runs ``run_worker``: it loads its share of the model, allocates the same KV blocks (of
its own KV heads), then repeats what rank 0 tells it, one command per model call of rank 0's
runner (``forward``, ``compute_logits``, ``copy_states``), so that the collectives inside the
model meet. The model's sums and gathers go through torch.distributed's default group (gloo on
CPU, NCCL on CUDA, XCCL on XPU where torch has it; ranks on one host's CPU through shared memory,
parallel/collectives.py); commands through a channel of their own (parallel/channels.py).

Ranks start as processes of this node (``mp``; other nodes run ``anna serve --node-rank N``,
which starts theirs) or as Ray actors (``ray``). A rank that ends ends the engine: rank 0 notices
its process end (or the connection drop in a collective) and raises with the rank's name and
exit code instead of waiting on it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from anna.parallel.channels import GlooChannel, SharedMemoryChannel
from anna.parallel.collectives import Collectives, SharedMemoryCollectives
from anna.parallel.sharding import TensorParallelShard

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank that stops answering inside a step
COMMAND_TIMEOUT = timedelta(days=365)  # waiting for rank 0's next command: an idle server sends none
SHARED_MEMORY_DIR = "/dev/shm"


@dataclass(frozen=True)
class ParallelLayout:
    """Where the ranks are: ``size`` ranks over ``nnodes`` nodes, as many on each, node 0 first."""

    size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "mp"

    @classmethod
    def from_settings(cls, par: Any) -> "ParallelLayout":
        layout = cls(par.tensor_parallel_size, par.nnodes, par.node_rank, par.master_addr, par.master_port,
                     par.distributed_executor_backend)
        layout.check()
        return layout

    def check(self) -> None:
        if self.size % self.nnodes:
            raise ValueError(f"tensor_parallel_size: {self.size} ranks do not spread evenly over nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank} is not one of the {self.nnodes} nodes (0..{self.nnodes - 1})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("master_port: a rendezvous across nodes needs a port that every node knows "
                             "(--master-port or MASTER_PORT)")

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def with_free_port(self) -> "ParallelLayout":
        """A rendezvous port picked now, for ranks that all start from this node."""
        if self.master_port:
            return self
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((self.master_addr, 0))
            return dataclasses.replace(self, master_port=sock.getsockname()[1])


def threads_per_rank(layout: ParallelLayout) -> int:
    """Each rank of this node takes an equal share of its CPU cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // layout.ranks_per_node)


def collective_backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "nccl"
    if device.type == "xpu":
        if not dist.is_xccl_available():
            raise ValueError("tensor_parallel_size: this torch build has no XCCL backend for XPU collectives")
        return "xccl"
    return "gloo"


@dataclass
class RankGroups:
    """What one rank's process holds of the group: the model's collectives and the command channel."""

    rank: int
    comm: Collectives
    commands: GlooChannel  # rank 0's commands

    @property
    def shard(self) -> TensorParallelShard:
        return TensorParallelShard(self.rank, self.comm.size)


def join_group(layout: ParallelLayout, rank: int, device: torch.device,
               alive: Callable[[], bool] | None = None) -> RankGroups:
    """Meet the other ranks at node 0's address (blocks until all have come). Ranks that all run
    on this host's CPU sum through shared memory (parallel/collectives.py); ``alive`` tells such
    a rank, while it waits for the others, whether they can still come."""
    if device.type == "cuda":  # a Ray actor sees only the GPU Ray gave it
        torch.cuda.set_device(0 if layout.backend == "ray" and rank else rank % layout.ranks_per_node)
    dist.init_process_group(collective_backend(device), init_method=f"tcp://{layout.master_addr}:{layout.master_port}",
                            rank=rank, world_size=layout.size, timeout=COLLECTIVE_TIMEOUT)
    group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    if layout.nnodes == 1 and layout.backend == "mp" and os.path.isdir(SHARED_MEMORY_DIR):
        box = [os.path.join(SHARED_MEMORY_DIR, f"anna-tp-{os.getpid()}-{uuid.uuid4().hex}") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        commands = SharedMemoryChannel(group, box[0] + "-commands", rank, layout.size, alive)
        comm = SharedMemoryCollectives(layout.size, rank, box[0], alive) if device.type == "cpu" \
            else Collectives(layout.size)
        if rank == 0:  # the segments go with the process, however it ends (rank 0 removes them)
            atexit.register(commands.close)
            atexit.register(comm.close)
        return RankGroups(rank, comm, commands)
    return RankGroups(rank, Collectives(layout.size), GlooChannel(group))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _on_device(value: Any, device: torch.device) -> Any:
    """A command's arguments with their tensors moved (rank 0 sends host tensors)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v, device) for v in value)
    return value  # (a StepTensors stays on the host: its metadata is built for the device)


# ---- the other ranks ----
@dataclass(frozen=True)
class WorkerSpec:
    """What a rank's process needs to load its share: the settings as rank 0 resolved them and the
    model directory it serves (the demo model or a GGUF's prepared directory included)."""

    settings: Any  # ResolvedSettings
    model_dir: str
    lm_head_quantization: str
    layout: ParallelLayout
    rank: int


class ShardWorker:
    """A rank's share of the model and its caches; each method is one of rank 0's commands."""

    def __init__(self, model: torch.nn.Module, specs: list, platform: Any, ops: Any) -> None:
        self.model, self.specs, self.platform, self.ops = model, specs, platform, ops
        self.layer_caches: list = []

    def set_routing(self, routing: Any) -> None:
        """Rank 0's matmul routing (its calibration), so that every rank runs the same kernels."""
        self.ops.routing = routing

    def allocate_caches(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        from anna.runtime.model_runner import allocate_caches

        self.block_size = block_size
        self.layer_caches = allocate_caches(self.specs, self.platform, num_blocks=num_blocks, block_size=block_size,
                                            num_slots=num_slots)

    @torch.inference_mode()
    def forward(self, step: Any) -> None:
        from anna.runtime.model_runner import zero_states

        device = self.platform.device
        meta = step.metadata(self.block_size, self.model.config.sliding_window, device)
        fresh = step.fresh_slots(device)
        if fresh is not None:
            zero_states(self.layer_caches, fresh)
        with self.platform.numerics():
            self.model(step.input_ids.to(device), step.positions.to(device), self.layer_caches, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> None:
        self.model.compute_logits(hidden.to(self.platform.device))

    @torch.inference_mode()
    def copy_states(self, src: list[int], dst: list[int]) -> None:
        from anna.runtime.model_runner import copy_state_slots

        copy_state_slots(self.layer_caches, src, dst, self.platform.device)

    def release_blocks(self, ranges: list[tuple[int, int]]) -> None:
        """Hand back the memory of these blocks, as rank 0 did (runtime/memory_release.py)."""
        from anna.runtime.memory_release import release_blocks

        for first, count in ranges:
            release_blocks(self.platform, self._kv_caches(), first, count)
        self.platform.empty_cache()

    def commit_blocks(self, layer: int, first: int, count: int) -> None:
        """Commit the memory of these free blocks of one paged layer ahead of use, as rank 0 did
        (runtime/memory_release.py)."""
        from anna.runtime.memory_release import commit_blocks

        commit_blocks(self.platform, self._kv_caches()[layer:layer + 1], first, count)

    def _kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The paged layers' (K, V), as rank 0's runner lists them (its kv_caches)."""
        return [c for c in self.layer_caches if isinstance(c, tuple)]

    def profile(self, name: str, *args: Any) -> None:
        """One of runtime/memory.py's profile runs, as rank 0 runs it (GPUs: the memory plan)."""
        from anna.runtime import memory

        getattr(memory, name)(self.model, self.specs, self.platform, *args)


def run_worker(spec: WorkerSpec) -> None:
    """A rank other than 0: load the share, then serve rank 0's commands until it says close.
    Any failure ends the process, which ends the engine (rank 0 watches for it)."""
    from anna.runtime.builder import load_model_share

    logging.basicConfig(level=spec.settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank {spec.rank} %(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(spec.layout))
    try:
        parent = os.getppid()  # rank 0, or this node's `anna serve`: while it lives, the group may go on
        share = load_model_share(spec.settings, spec.model_dir, spec.lm_head_quantization,
                                 lambda device: join_group(spec.layout, spec.rank, device,
                                                           lambda: os.getppid() == parent), show_progress=False)
        worker = ShardWorker(share.model, share.specs, share.platform, share.ops)
        groups = share.groups
        while True:
            name, args = groups.commands.receive()
            if name == "close":
                break
            getattr(worker, name)(*_on_device(args, share.platform.device))
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        os._exit(1)  # the other ranks see this process end; a clean teardown could wait on them
    leave_group()


@dataclass
class RankProcess:
    """A rank's process on this node: ``python -m anna.parallel.rank_main`` with its WorkerSpec on
    stdin (a fresh interpreter: nothing of the caller's main module is imported again)."""

    rank: int
    popen: subprocess.Popen

    @property
    def name(self) -> str:
        return f"rank {self.rank} (pid {self.popen.pid})"


def start_node_workers(layout: ParallelLayout, settings: Any, model_dir: str,
                       lm_head_quantization: str) -> list[RankProcess]:
    """This node's ranks as processes (rank 0, the engine's, excepted)."""
    procs = []
    for rank in layout.node_ranks():
        if rank == 0:
            continue
        popen = subprocess.Popen([sys.executable, "-m", "anna.parallel.rank_main"], stdin=subprocess.PIPE)
        popen.stdin.write(pickle.dumps(WorkerSpec(settings, model_dir, lm_head_quantization, layout, rank)))
        popen.stdin.close()
        procs.append(RankProcess(rank, popen))
    return procs


def serve_node(settings: Any, model_dir: str, lm_head_quantization: str) -> int:
    """A node other than 0 (``anna serve --node-rank N``): run this node's ranks until they end."""
    layout = ParallelLayout.from_settings(settings.sections.parallel)
    procs = start_node_workers(layout, settings, model_dir, lm_head_quantization)
    log.info("Node %d of %d: ranks %s started, meeting at %s:%d", layout.node_rank, layout.nnodes,
             list(layout.node_ranks()), layout.master_addr, layout.master_port)
    failed = 0
    for proc in procs:
        code = proc.popen.wait()
        if code:
            log.error("%s exited with code %s", proc.name, code)
            failed = 1
    return failed


class WorkerGroup:
    """Rank 0's handle on the other ranks: sends them its commands, notices when one ends."""

    def __init__(self, layout: ParallelLayout, procs: list[RankProcess], ray_workers: Any = None) -> None:
        self.layout = layout
        self.procs = procs
        self.ray_workers = ray_workers
        self.commands: GlooChannel | None = None  # the command channel, once rank 0 has joined
        self.comm: Collectives | None = None  # rank 0's collectives
        self.dead: str | None = None  # why the group cannot run any more
        self._closing = False
        self._threads = torch.get_num_threads()  # rank 0's process gets its share, until close
        torch.set_num_threads(threads_per_rank(layout))
        self._watcher = threading.Thread(target=self._watch, name="anna-tp-watch", daemon=True)
        self._watcher.start()
        atexit.register(self.close)

    @classmethod
    def start(cls, layout: ParallelLayout, settings: Any, model_dir: str, lm_head_quantization: str) -> "WorkerGroup":
        if layout.backend == "ray":
            from anna.parallel.ray_workers import start_ray_workers

            ray_workers, layout = start_ray_workers(layout, settings, model_dir, lm_head_quantization)
            return cls(layout, [], ray_workers)
        return cls(layout, start_node_workers(layout, settings, model_dir, lm_head_quantization))

    def _watch(self) -> None:
        """Wait for a local rank's process (or Ray actor) to end; one that ends before close is fatal."""
        if self.ray_workers is not None:
            ended, why = self.ray_workers.wait_any()
        elif self.procs:
            proc = _first_to_end(self.procs)
            ended, why = proc.name, f"exited with code {proc.popen.returncode}"
        else:
            return
        if not self._closing:
            self.dead = f"tensor-parallel {ended} {why}"
            log.critical("%s: the engine cannot run any more", self.dead)

    def attach(self, groups: RankGroups) -> None:
        self.commands = groups.commands
        self.comm = groups.comm

    def check(self) -> None:
        """Raise if a rank has ended (or the ranks can no longer be trusted to be in step)."""
        if self.dead is not None:
            raise RuntimeError(self.dead)

    def broken(self, exc: BaseException) -> None:
        """Rank 0 failed inside a model call the others are running: they may wait in a collective
        rank 0 never reaches, and any later call would pair with the wrong one. The group is done."""
        if self.dead is None:
            self.dead = f"tensor-parallel rank 0 failed inside a model call the other ranks ran " \
                        f"({type(exc).__name__}: {exc}); the ranks are out of step"
            log.critical("%s", self.dead)

    def send(self, name: str, *args: Any) -> None:
        """Have every other rank run ``ShardWorker.<name>(*args)`` (host tensors in ``args``)."""
        self.check()
        try:
            self.commands.send((name, args))
        except Exception as exc:
            raise RuntimeError(f"tensor-parallel ranks unreachable ({self.dead or exc})") from exc

    def close(self, timeout: float = 30.0) -> None:
        """Tell the ranks to stop and wait for them (those that do not are ended)."""
        if self._closing:
            return
        self._closing = True
        if self.dead is None and self.commands is not None:
            try:
                self.send("close")
            except RuntimeError:
                pass
        for proc in self.procs:  # (ranks out of step may wait in a collective forever: no grace)
            try:
                proc.popen.wait(timeout if self.dead is None else 0)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        if self.ray_workers is not None:
            self.ray_workers.close()
        if self.comm is not None:
            self.comm.close()
            self.commands.close()
        leave_group()
        torch.set_num_threads(self._threads)


def _first_to_end(procs: list[RankProcess]) -> RankProcess:
    """Wait until one of these processes ends (polled: Popen has no wait-for-any)."""
    while True:
        for proc in procs:
            if proc.popen.poll() is not None:
                return proc
        time.sleep(0.2)

