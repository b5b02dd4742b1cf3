"""W&B logging of a local run: offline unless configured; resumable under one run id."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from slime_ext.job.config import JobConfig


class WandbLogger:
    def __init__(self, job: JobConfig, run_dir: Path, name: str) -> None:
        self.run: Any = None
        mode = job.logging.wandb_mode
        if mode == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
            return
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=job.logging.wandb_project,
            group=job.logging.wandb_group,
            name=name,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(run_dir),
            config=job.model_dump(mode="json"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            logged = {k: v for k, v in metrics.items() if k != "step"}
            # slime's step keys (launch/dashboard.py STEP_METRICS): one dashboard for both
            logged |= {"rollout/step": step, "train/step": step}
            self.run.log(logged, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
