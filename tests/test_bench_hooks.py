"""The benchmarks that subclass the trainer override its hooks with the trainer's own signatures."""

import inspect

from bench.out_of_core import MeasuredTrainer
from orchestrator.trainer import Trainer


def test_the_out_of_core_bench_overrides_train_with_the_trainers_signature():
    assert inspect.signature(MeasuredTrainer._train) == inspect.signature(Trainer._train)
