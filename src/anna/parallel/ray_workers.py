"""The ranks other than 0 as Ray actors (``--distributed-executor-backend ray``), for a Ray
cluster that places them on its nodes. Each actor runs ``run_worker`` as the processes of the
``mp`` backend do; rank 0 stays in the engine's process, which joins the cluster (``ray.init``:
the cluster named by Ray's own RAY_ADDRESS, else a local instance). ray is an optional extra
(``pip install anna[ray]``), imported only here."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from anna.parallel.workers import ParallelLayout, WorkerSpec, run_worker, threads_per_rank

log = logging.getLogger(__name__)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend: ray is not installed (pip install 'anna[ray]')") from None
    return ray


class RayWorkers:
    """The actors and their running ``run`` calls; one that ends (or whose process dies) is fatal."""

    def __init__(self, ray: Any, actors: list, runs: list) -> None:
        self.ray, self.actors, self.runs = ray, actors, runs

    def wait_any(self) -> tuple[str, str]:
        ready, _ = self.ray.wait(self.runs, num_returns=1)
        rank = self.runs.index(ready[0]) + 1
        try:
            self.ray.get(ready[0])
            return f"rank {rank} (Ray actor)", "returned"
        except Exception as exc:  # the actor's process ended (run_worker exits on any failure)
            return f"rank {rank} (Ray actor)", f"ended: {type(exc).__name__}"

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        finally:
            for actor in self.actors:
                self.ray.kill(actor)


def start_ray_workers(layout: ParallelLayout, settings: Any, model_dir: str,
                      lm_head_quantization: str) -> tuple[RayWorkers, ParallelLayout]:
    """Ranks 1..size-1 as actors, each asking Ray for its share of CPUs (or one GPU); the layout
    with the address they meet at (this node's, where the cluster has several)."""
    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=True)
    if layout.master_addr in ("127.0.0.1", "localhost") and len(ray.nodes()) > 1:
        layout = dataclasses.replace(layout, master_addr=ray.util.get_node_ip_address())
    gpus = 1 if settings.device == "cuda" else 0
    actor_class = ray.remote(num_cpus=threads_per_rank(layout), num_gpus=gpus)(RankActor)
    actors, runs = [], []
    for rank in range(1, layout.size):
        actor = actor_class.options(name=None).remote()
        actors.append(actor)
        runs.append(actor.run.remote(WorkerSpec(settings, model_dir, lm_head_quantization, layout, rank)))
    log.info("Tensor parallel: ranks 1..%d started as Ray actors", layout.size - 1)
    return RayWorkers(ray, actors, runs), layout


class RankActor:
    """One rank: serves rank 0's commands until it says close."""

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)
