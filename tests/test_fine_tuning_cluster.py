"""Fine-tuning a tiny pretrained decoder on a real Ray cluster of three nodes on loopback, on the collective path.

The head has no CPUs and each of three nodes one, so each of the three ranks runs on a node of its own. Noiseless
seeded runs (tests only): with a LoRA adapter the collective path gives the driver path's weights; with full
fine-tuning every rank holds the same weights after each step, and they moved.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from servers import start_loopback_cluster, stop_loopback_cluster  # noqa: E402
from test_collective import NoiseOff, RanksAgree, run  # noqa: E402
from test_pretrained import save_tiny_models  # noqa: E402

from orchestrator.config import build_config  # noqa: E402
from workers.models import flat_parameters  # noqa: E402
from workers.pretrained import PAD_INPUT  # noqa: E402

NODES = 3
LENGTH = 10


@pytest.fixture(scope="module")
def cluster():
    cluster, _ = start_loopback_cluster([dict(num_cpus=1) for _ in range(NODES)])
    yield cluster
    stop_loopback_cluster(cluster)


def token_table(path, rows: int, seed: int) -> str:
    """Token ids [rows, LENGTH] of varying lengths padded with -1, labelled by their first token's parity."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 64, (rows, LENGTH))
    ids[np.arange(LENGTH)[None, :] >= rng.integers(3, LENGTH + 1, rows)[:, None]] = PAD_INPUT
    column = pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), LENGTH)
    pq.write_table(pa.table({"input_ids": column, "label": ids[:, 0] % 2}), path)
    return str(path)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fine-tuning")
    return folder, save_tiny_models(str(folder / "models"))["llama"], {
        "format": "parquet", "train": token_table(folder / "train.parquet", 120, 1),
        "test": token_table(folder / "test.parquet", 30, 2)}


def fine_tuning_config(setting, name, **overrides):
    folder, model, dataset = setting
    values = dict(
        model={"hf": model, "task": "sequence-classification", "num_labels": 2}, dataset=dataset, workers=NODES,
        steps=2, batch_size=30, noise_multiplier=1.0, clip_norm=0.5, learning_rate=0.5, seed=3,
        run_dir=str(folder / name), max_physical_batch=16, plan_ahead_steps="off",
    )
    values.update(overrides)
    return build_config(values)


def test_the_collective_path_fine_tunes_a_lora_adapter_like_the_driver_path(cluster, setting):
    adapter = {"kind": "lora", "r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    (driver, _), (collective, _) = (run(NoiseOff, fine_tuning_config(setting, f"lora-{aggregation}",
                                                                     aggregation=aggregation, adapter=adapter))
                                    for aggregation in ("driver", "collective"))
    assert (driver.aggregation, collective.aggregation) == ("driver", "collective")
    weights = flat_parameters(collective.model)
    np.testing.assert_allclose(weights.numpy(), flat_parameters(driver.model).numpy(), rtol=1e-4, atol=1e-6)
    assert (weights - collective.initial_weights).abs().max() > 1e-4
    assert weights.numel() < 2_000  # the adapter's factors and the new head, not the frozen base


def test_the_collective_path_carries_full_fine_tuning_with_every_rank_in_step(cluster, setting):
    trainer, _ = run(RanksAgree, fine_tuning_config(setting, "full-collective", aggregation="collective"))
    assert trainer.aggregation == "collective"
    weights = flat_parameters(trainer.model)
    assert trainer.identical == [True, True]
    assert weights.numel() > 5_000 and bool(weights.isfinite().all())
    assert (weights - trainer.initial_weights).abs().max() > 1e-4
