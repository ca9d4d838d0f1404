"""Entry point: `python train.py [overrides]` or `python train.py -m ...` for a sweep; `torchrun
--nproc_per_node=N train.py ...` runs one job as N DDP ranks. See README.md."""
import warnings

import hydra
from omegaconf import DictConfig

# conf/hydra/launcher/submitit_*.yaml are complete launcher configs that keep the plugin's names (so
# that `hydra/launcher=submitit_slurm` uses our defaults); Hydra validates them against the plugin's
# schema of the same name and warns that this matching is deprecated: the files do not depend on it.
warnings.filterwarnings(
    "ignore", message=r"\s*'hydra/launcher/submitit_\w+' is validated against ConfigStore schema"
)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from mixprec.job import run_job

    run_job(cfg)


if __name__ == "__main__":
    from mixprec.runtime.dist import finish, mute_other_ranks, share_run_time

    # under torchrun: every rank takes rank 0's clock for Hydra's dir name (one output dir)
    share_run_time()
    mute_other_ranks()  # and rank 0 alone reports a bad override
    main()
    finish()  # under torchrun: every rank done, then the process group goes (no rank ahead)
