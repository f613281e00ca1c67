"""A Serve replica whose engine spans hosts: one `jax.distributed` process per host (docs/multihost.md),
process 0 inside the Serve replica actor, processes 1..N-1 as Ray actors running the follower loop.

Placement: the engine deployment asks Serve for one placement group per replica with N equal bundles
(`placement_bundles`), strategy STRICT_SPREAD by default: every bundle on a different node, because a
multi-host engine is one process per host (each owns its host's accelerators; two TPU processes cannot
share a host's chips, and a mesh laid out as (hosts, devices per host) assumes one process per host).
SPREAD only prefers different nodes and would silently put two processes on one host when nodes are
short; PACK is for trying N processes on one machine. Serve starts the replica actor in bundle 0 and
removes the group with the replica; `FollowerGroup.start` puts follower i in bundle i.

Start-up: process 0 picks the job's coordinator address (its node's IP, a free port there), starts the
followers with settings that differ only in `process_id`, and builds its own engine; every process
meets in `jax.distributed.initialize` and in `multihost.check_consistent`. A follower that fails
first (a bad path, an out-of-memory) fails the replica's constructor with that follower's error,
instead of leaving process 0 waiting for it.

Stopping and faults: process 0's engine sends SHUTDOWN when it closes, so each follower's `run`
returns 0; the followers are then killed (they are also owned by the replica actor, so Ray kills them
when it dies, however it dies). A follower that dies breaks the next step's collective, and process 0
exits (multihost.exit_on_peer_failure); while idle, the replica's health check sees the follower's
`run` end (`FollowerGroup.failure`) and fails, so Serve replaces the whole replica (a new group, new
processes). Ray is imported where it is used: this module imports without the `[ray]` extra.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from typing import Any, Callable

from jaxserve.config import EngineConfig

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
START_POLL_SECONDS = 1.0  # how often process 0 looks at its followers while its own engine starts
STOP_WAIT_SECONDS = 10.0  # how long a follower gets to leave its loop after SHUTDOWN before it is killed


def placement_bundles(resources: dict[str, float], num_processes: int) -> list[dict[str, float]]:
    """One bundle per process of a replica: each the resources of one process (--replica-resources,
    default one CPU). Ray refuses empty bundles, so zero amounts are left out."""
    bundle = {"CPU": 1, **resources}
    bundle = {name: amount for name, amount in bundle.items() if amount}
    if not bundle:
        raise ValueError("a replica process needs some resource (give --replica-resources a nonzero amount)")
    return [dict(bundle) for _ in range(num_processes)]


def actor_resources(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options for one process's resources: {"CPU": 2, "GPU": 1, "TPU": 4} as num_cpus,
    num_gpus and custom resources (the same split for the replica actor and its followers)."""
    rest = dict(resources)
    options: dict[str, Any] = {"num_cpus": rest.pop("CPU", 1), "num_gpus": rest.pop("GPU", 0)}
    if rest:
        options["resources"] = rest
    return options


def coordinator_address() -> str:
    """HOST:PORT for this replica's jax.distributed coordinator: this node's IP (the one Ray uses, which
    the other nodes reach) and a port free on it now. Process 0 binds it moments later, in
    `jax.distributed.initialize`; another program taking the port in between fails the replica's
    start, and Serve starts it again."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def process_settings(settings: EngineConfig, num_processes: int, address: str, process_id: int) -> EngineConfig:
    """The settings of one process of a replica: the replica's, in a job of `num_processes`."""
    return settings.replace(num_processes=num_processes, process_id=process_id, coordinator_address=address)


class JaxserveFollower:
    """Process `process_id` > 0 of a replica's engine: builds the same engine (it waits for the others in
    jax.distributed.initialize), then runs process 0's device calls until SHUTDOWN. Its `run` returns
    0 then; if the job breaks, the process exits (multihost.exit_on_peer_failure) and `run` fails."""

    def run(self, settings: EngineConfig, warm_up: bool) -> int:
        from jaxserve.llm_engine import LLMEngine  # lazy: pulls in JAX
        from jaxserve.runner import multihost

        logger.info(
            "follower %d of %d: coordinator %s",
            settings.process_id,
            settings.num_processes,
            settings.coordinator_address,
        )
        return multihost.run_follower(LLMEngine(settings, warm_up=warm_up))


class FollowerGroup:
    """Processes 1..N-1 of one replica's engine, started from inside the replica actor (process 0)."""

    def __init__(self, actors: list[Any], runs: list[Any]):
        self.actors = actors  # follower i + 1's actor handle
        self.runs = runs  # follower i + 1's `run` ObjectRef: it ends when the follower does

    @classmethod
    def start(cls, leader_settings: EngineConfig, resources: dict[str, float], warm_up: bool) -> "FollowerGroup":
        """One follower per process but 0 of `leader_settings`' job, follower i in bundle i of the
        replica's placement group (none outside a group: then Ray places them anywhere)."""
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = get_current_placement_group()
        actor_class = ray.remote(JaxserveFollower)
        actors, runs = [], []
        for i in range(1, leader_settings.num_processes):
            options = actor_resources(resources)
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i
                )
            actor = actor_class.options(max_restarts=0, **options).remote()
            actors.append(actor)
            runs.append(actor.run.remote(leader_settings.replace(process_id=i), warm_up))
        return cls(actors, runs)

    def failure(self) -> str | None:
        """Why a follower is gone (its `run` ended: it died, its engine failed, or it stopped), else None."""
        import ray

        ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if not ended:
            return None
        index = self.runs.index(ended[0]) + 1
        try:
            result = ray.get(ended[0], timeout=0)
        except Exception as err:  # noqa: BLE001 - RayActorError (it died), RayTaskError (its engine raised)
            return f"process {index} of the replica's engine failed: {type(err).__name__}: {str(err).strip()[:500]}"
        return f"process {index} of the replica's engine stopped (status {result})"

    def build_leader(self, build: Callable[[], Any]) -> Any:
        """`build()` (process 0's engine) on a thread of its own, watching the followers meanwhile: one
        that fails first fails this with its error, since process 0 would otherwise wait for it in
        jax.distributed.initialize (up to 5 minutes)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def target() -> None:
            try:
                done.set_result(build())
            except BaseException as err:  # noqa: BLE001 - re-raised on the constructor's thread
                done.set_exception(err)

        threading.Thread(target=target, name="jaxserve-leader-start", daemon=True).start()
        while True:
            try:
                return done.result(timeout=START_POLL_SECONDS)
            except concurrent.futures.TimeoutError:
                failure = self.failure()
                if failure is not None:
                    raise RuntimeError(f"the replica's multi-host engine could not start: {failure}") from None

    def stop(self) -> None:
        """After process 0's engine closed (it sent SHUTDOWN): give the followers a moment to leave
        their loops, then end their actors."""
        import ray

        try:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_WAIT_SECONDS)
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
