"""`torchrun --standalone --nproc-per-node N SCRIPT ARGS...` for a test, its ranks forked from the preloaded fork
server (`spawned.spawn`) instead of started as new interpreters: each rank a fresh process of its own, with the
environment torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, the elastic agent's variables
that Lightning and Accelerate read), running SCRIPT as `__main__`. torchrun itself and each rank would import
torch and transformers again (about 12 s of CPU a launch on this 2-core host); a fork starts in milliseconds.
Each rank's output goes to OUT/rank<r>.log."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from ports import free_port
from spawned import spawn


def _rank(local_rank: int, script: str, argv: list[str], world: int, port: int, env: dict[str, str],
          log_dir: str) -> None:
    log = os.open(Path(log_dir, f"rank{local_rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(local_rank), ROLE_NAME="default",
                      ROLE_WORLD_SIZE=str(world), GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"test-{port}", TORCHELASTIC_RESTART_COUNT="0",
                      TORCHELASTIC_MAX_RESTARTS="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # torchrun's ranks start with OMP_NUM_THREADS set; a fork of a process that imported torch already has its
    # pool sized, so the rank sizes it as a started one would
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def torchrun(script: Path, argv: list[str], log_dir: Path, nprocs: int = 2, env: dict[str, str] | None = None) -> str:
    """Runs the ranks to their end; raises (torch.multiprocessing's ProcessRaisedException or
    ProcessExitedException, with the failing rank's traceback) if one fails, as torchrun exits non-zero. Returns
    the ranks' output, joined."""
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        spawn(_rank, args=(str(script), [str(a) for a in argv], nprocs, free_port(), dict(env or {}), str(log_dir)),
              nprocs=nprocs)
    finally:
        output = "".join(path.read_text(errors="replace") for path in sorted(log_dir.glob("rank*.log")))
        (log_dir / "torchrun.log").write_text(output)
    return output
