"""
train.py --wandb PROJECT: the log's train and eval records, sent to Weights & Biases as well
(imported only with the flag; WANDB_MODE=offline logs without a network, WANDB_NAME names the run).
"""
import os
import sys

try:
    import wandb
except ImportError:
    sys.exit("error: --wandb needs the wandb package: pip install wandb")

class WandB:
    def __init__(self, project, config):
        try:
            self.run = wandb.init(project=project, config=config)
        except wandb.errors.Error as e:     # e.g. no API key
            sys.exit(f"error: --wandb {project}: {e} (or log offline: WANDB_MODE=offline)")

    def log(self, record):
        # one key per number: "train/loss", "eval/slot_acc/3"
        if record["kind"] in ("train", "eval"):
            self.run.log({f"{record['kind']}/{k}" + (f"/{i}" if isinstance(v, list) else ""): x
                          for k, v in record.items() if k not in ("kind", "step")
                          for i, x in enumerate(v if isinstance(v, list) else [v])
                          if isinstance(x, (int, float))}, step=record["step"])

    def saved(self, drafter_dir):
        self.run.summary["drafter"] = os.path.abspath(drafter_dir)

    def finish(self):
        self.run.finish()
