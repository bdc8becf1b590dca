"""IDX encoding, the verified cache, and the real MNIST / Fashion-MNIST splits."""

import hashlib
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torchvision

from workers import data

# Per-class counts of the canonical splits.
MNIST_TRAIN_LABEL_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_idx_round_trip():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=5, dtype=np.uint8)
    encoded_images = data.encode_idx(images)
    assert encoded_images[:16] == bytes.fromhex("00000803 00000005 0000001c 0000001c")
    assert np.array_equal(data.decode_idx(encoded_images), images)
    assert np.array_equal(data.decode_idx(data.encode_idx(labels)), labels)


def test_idx_decoder_refuses_truncated_and_foreign_files():
    encoded = data.encode_idx(np.zeros((2, 3, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        data.decode_idx(encoded[:-1])
    with pytest.raises(ValueError, match="not an unsigned-byte IDX file"):
        data.decode_idx(b"\x00\x00\x0d\x01" + encoded[4:])
    with pytest.raises(ValueError, match="uint8 arrays only"):
        data.encode_idx(np.zeros(3, dtype=np.int32))


class TinyMNIST(torchvision.datasets.MNIST):
    """torchvision's MNIST reader over a tiny cache, with no download mirrors."""

    mirrors = []


TINY_IMAGES = {
    "train": np.arange(4 * 28 * 28, dtype=np.int64).reshape(4, 28, 28).astype(np.uint8),
    "test": np.full((2, 28, 28), 255, dtype=np.uint8),
}
TINY_LABELS = {"train": np.array([3, 1, 4, 1], dtype=np.uint8), "test": np.array([5, 9], dtype=np.uint8)}


def tiny_idx_files():
    files = {}
    for split, (image_file, label_file) in data.IDX_FILE_NAMES.items():
        files[image_file] = data.encode_idx(TINY_IMAGES[split])
        files[label_file] = data.encode_idx(TINY_LABELS[split])
    return files


@pytest.fixture
def tiny_dataset(monkeypatch):
    """Register a 4+2 example dataset whose registry fallback writes the tiny IDX files."""
    files = tiny_idx_files()
    fallback_calls = []

    def fallback(raw_dir):
        fallback_calls.append(raw_dir)
        for name, payload in files.items():
            data.write_atomically(raw_dir / name, payload)

    source = data.DatasetSource(
        torchvision_class_name="TinyMNIST",
        sha256={name: hashlib.sha256(payload).hexdigest() for name, payload in files.items()},
        split_sizes={"train": 4, "test": 2},
        fallback=fallback,
    )
    monkeypatch.setitem(data.DATASETS, "tiny", source)
    monkeypatch.setattr(torchvision.datasets, "TinyMNIST", TinyMNIST, raising=False)
    return fallback_calls


def test_checksum_detects_a_corrupted_file(tmp_path):
    files = tiny_idx_files()
    for name, payload in files.items():
        (tmp_path / name).write_bytes(payload)
    manifest = {name: hashlib.sha256(payload).hexdigest() for name, payload in files.items()}
    assert data.invalid_files(tmp_path, manifest) == []

    corrupted = bytearray(files["train-images-idx3-ubyte"])
    corrupted[100] ^= 0xFF
    (tmp_path / "train-images-idx3-ubyte").write_bytes(bytes(corrupted))
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    assert data.invalid_files(tmp_path, manifest) == ["train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def test_load_split_builds_verifies_and_rebuilds_the_cache(tmp_path, tiny_dataset, capsys):
    images, labels = data.load_split("tiny", "train", root=tmp_path)
    assert "falling back" in capsys.readouterr().err
    assert images.dtype == torch.float32 and images.shape == (4, 1, 28, 28)
    assert torch.equal(images[:, 0], torch.from_numpy(TINY_IMAGES["train"]).float() / 255)
    assert labels.dtype == torch.int64 and labels.tolist() == [3, 1, 4, 1]
    assert len(tiny_dataset) == 1

    test_images, test_labels = data.load_split("tiny", "test", root=tmp_path)
    assert torch.equal(test_images, torch.ones(2, 1, 28, 28)) and test_labels.tolist() == [5, 9]
    assert len(tiny_dataset) == 1, "an intact cache must not be fetched again"

    train_images_file = tmp_path / "TinyMNIST" / "raw" / "train-images-idx3-ubyte"
    train_images_file.write_bytes(train_images_file.read_bytes()[:-10])
    images_again, _ = data.load_split("tiny", "train", root=tmp_path)
    assert len(tiny_dataset) == 2, "a truncated file must trigger a rebuild"
    assert torch.equal(images_again, images)


def test_cache_root_comes_from_argument_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DPFLEET_DATA", str(tmp_path / "from-env"))
    assert data.data_root() == tmp_path / "from-env"
    assert data.data_root(tmp_path / "explicit") == tmp_path / "explicit"
    monkeypatch.delenv("DPFLEET_DATA")
    assert data.data_root().parts[-2:] == (".cache", "dpfleet")


def test_unknown_dataset_and_split_are_refused():
    with pytest.raises(ValueError, match=r"unknown dataset 'cifar10'; valid names: \['fashion-mnist', 'mnist'\]"):
        data.dataset_size("cifar10")
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'test'\)"):
        data.dataset_size("mnist", "valid")


def test_dataset_sizes():
    assert [data.dataset_size(name, split) for name in ("mnist", "fashion-mnist") for split in data.SPLITS] == [
        60000,
        10000,
        60000,
        10000,
    ]


def test_real_mnist_splits():
    images, labels = data.load_split("mnist", "train")
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert torch.bincount(labels).tolist() == MNIST_TRAIN_LABEL_COUNTS
    assert images.min().item() == 0.0 and images.max().item() == 1.0
    # The familiar normalisation constant of MNIST (mean pixel / 255).
    assert abs(images.mean().item() - 0.1307) < 1e-4
    test_images, test_labels = data.load_split("mnist", "test")
    assert test_images.shape == (10000, 1, 28, 28)
    assert torch.bincount(test_labels).tolist() == MNIST_TEST_LABEL_COUNTS


def _fashion_mnist_obtainable():
    source = data.DATASETS["fashion-mnist"]
    raw_dir = data.data_root() / source.torchvision_class.__name__ / "raw"
    if not data.invalid_files(raw_dir, source.sha256) or data.FASHION_MNIST_DEBIAN_DIR.is_dir():
        return True
    if shutil.which("apt-cache") is None:
        return False
    policy = subprocess.run(
        ["apt-cache", "policy", data.FASHION_MNIST_DEBIAN_PACKAGE], capture_output=True, text=True
    ).stdout
    return "Candidate:" in policy and "Candidate: (none)" not in policy


@pytest.mark.skipif(
    not _fashion_mnist_obtainable(),
    reason="Fashion-MNIST is not cached and apt knows no dataset-fashion-mnist; run `apt-get update`",
)
def test_real_fashion_mnist_splits():
    images, labels = data.load_split("fashion-mnist", "train")
    assert images.shape == (60000, 1, 28, 28)
    assert torch.bincount(labels).tolist() == [6000] * 10
    assert abs(images.mean().item() - 0.2860) < 1e-4
    _, test_labels = data.load_split("fashion-mnist", "test")
    assert torch.bincount(test_labels).tolist() == [1000] * 10
