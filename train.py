"""Entry point: `python train.py [overrides]` or `python train.py -m ...` for a sweep. See README.md."""
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from mixprec.run import run_job

    run_job(cfg)


if __name__ == "__main__":
    main()
