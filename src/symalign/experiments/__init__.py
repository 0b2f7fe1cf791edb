"""The papers' experiment protocol: re-initialisation scopes, alignment, LMC curves, reports."""

from symalign.experiments.config import ExperimentConfig, load_experiment_config, parse_config
from symalign.experiments.protocol import run_experiment

__all__ = ["ExperimentConfig", "load_experiment_config", "parse_config", "run_experiment"]
