"""The launcher's environment: the one place that reads the variables torchrun, the
deepspeed launcher and srun wrappers set for each process."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # MASTER_ADDR is set: the processes meet through the launcher's rendezvous
    rendezvous: bool = False


def launch_env() -> LaunchEnv:
    """This process's place in the launch; one process without a launcher is rank 0 of 1."""
    env = os.environ
    return LaunchEnv(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                     local_rank=int(env.get("LOCAL_RANK", 0)), rendezvous="MASTER_ADDR" in env)
