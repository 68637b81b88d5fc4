"""normlab.runner.data.datasets: digits / mnist1d / cifar10 loading, splits, normalisation, augmentation, errors."""

import hashlib
import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from normlab.runner.data import cifar10, mnist1d
from normlab.runner.data.datasets import DATASETS, ArrayDataset, flip_crop, get_dataset


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="digits, mnist1d, cifar10"):
        get_dataset("imagenet")
    assert DATASETS == ("digits", "mnist1d", "cifar10")


def test_digits_split_shapes_and_normalisation():
    from sklearn.datasets import load_digits

    tr, te, info = get_dataset("digits")
    assert (len(tr), len(te)) == (1437, 360)
    assert tr.x.shape == (1437, 1, 16, 16) and te.x.shape == (360, 1, 16, 16)
    assert info["input_shape"] == (1, 16, 16) and info["in_channels"] == 1 and info["num_classes"] == 10
    assert (info["num_train"], info["num_test"]) == (1437, 360)
    # stratified: every class has 35 or 37 test images (360 / 10 with sklearn's class sizes 174..183)
    counts = torch.bincount(te.y, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    # standardised with the training statistics
    assert abs(tr.x.mean().item()) < 1e-5 and abs(tr.x.std(unbiased=False).item() - 1) < 1e-4
    # nearest upsampling: every 2x2 block is constant
    x = tr.x[:, 0]
    for dy in (0, 1):
        for dx in (0, 1):
            torch.testing.assert_close(x[:, dy::2, dx::2], x[:, ::2, ::2], rtol=0, atol=0)
    # undoing the normalisation gives back the original 0..16 pixel values, and the two parts make up the data set
    raw = load_digits().images.astype(np.float32) / 16.0
    both = torch.cat([tr.x, te.x])[:, 0, ::2, ::2].double()
    # the normalisation is one affine map: recover it from the lowest and highest grey level
    vals = torch.unique(both.round(decimals=4))
    assert len(vals) == 17  # 17 grey levels 0..16
    scale = (vals[-1] - vals[0]) / 16
    pixels = ((both - vals[0]) / scale).round()
    assert torch.allclose((both - vals[0]) / scale, pixels, atol=1e-3)
    got = np.sort(pixels.reshape(len(both), -1).numpy().astype(np.int64), axis=0)
    want = np.sort(np.round(raw.reshape(len(raw), -1) * 16).astype(np.int64), axis=0)
    np.testing.assert_array_equal(got, want)
    # fixed split: a second call gives identical tensors
    tr2, te2, _ = get_dataset("digits")
    assert torch.equal(tr2.x, tr.x) and torch.equal(te2.y, te.y)


def test_mnist1d_generated_cached_and_rng_untouched(tmp_path):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    tr, te, info = get_dataset("mnist1d", data_dir=tmp_path, num_samples=5000)
    assert np.array_equal(np.random.get_state()[1], before), "make_dataset must not leak its global seeding"
    assert tr.x.shape == (4000, 1, 40) and te.x.shape == (1000, 1, 40)
    assert tr.x.dtype == torch.float32 and tr.y.dtype == torch.int64
    assert info["input_shape"] == (1, 40) and info["num_classes"] == 10
    assert set(tr.y.unique().tolist()) == set(range(10))
    cached = list(tmp_path.glob("mnist1d_*.npz"))
    assert len(cached) == 1
    mnist1d._memory.clear()
    tr2, te2, _ = get_dataset("mnist1d", data_dir=tmp_path, num_samples=5000)  # from the cache
    assert torch.equal(tr2.x, tr.x) and torch.equal(te2.y, te.y)
    mnist1d._memory.clear()
    cached[0].write_bytes(b"not a zip file")  # a damaged cache is regenerated, not trusted
    tr3, _, _ = get_dataset("mnist1d", data_dir=tmp_path, num_samples=5000)
    assert torch.equal(tr3.x, tr.x)
    small, _, _ = get_dataset("mnist1d", data_dir=tmp_path, num_samples=5000, num_train=300)
    assert torch.equal(small.x, tr.x[:300])


def test_mnist1d_generation_is_deterministic_for_its_arguments(tmp_path):
    args = mnist1d.generation_args(2000)
    assert args["num_samples"] == 2000 and args["train_split"] == 0.8
    assert mnist1d.cache_key(args) != mnist1d.cache_key(mnist1d.generation_args(2010))
    first = mnist1d._generate(args)
    again = mnist1d._generate(dict(args))
    assert mnist1d.arrays_checksum(first) == mnist1d.arrays_checksum(again)
    assert mnist1d.arrays_checksum(first) != mnist1d.arrays_checksum(mnist1d._generate({**args, "seed": 43}))
    assert first["x"].shape == (1600, 40) and first["x_test"].shape == (400, 40)
    with pytest.raises(ValueError, match="num_samples must be an int >= 50"):
        mnist1d.generation_args(10)
    with pytest.raises(ValueError, match="num_samples applies to generated data sets"):
        get_dataset("digits", num_samples=100)
    with pytest.raises(ValueError, match=r"num_train: expected an int in \[1, 1437\]"):
        get_dataset("digits", num_train=5000)


def _write_cifar(root, n_per_file=3, seed=0, skip=()):
    """A tiny CIFAR-10 in the official python-pickle format (6 files) under root/cifar-10-batches-py."""
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, size=(n_per_file, 3072), dtype=np.uint8)
        y = rng.integers(0, 10, size=n_per_file).tolist()
        files[name] = (x, y)
        if name not in skip:
            with open(d / name, "wb") as f:
                pickle.dump({b"data": x, b"labels": y, b"batch_label": name.encode()}, f)
    return d, files


def test_cifar10_reads_python_batches(tmp_path):
    d, files = _write_cifar(tmp_path)
    tr, te, info = get_dataset("cifar10", data_dir=tmp_path)
    assert len(tr) == 15 and len(te) == 3
    assert info["input_shape"] == (3, 32, 32) and info["num_classes"] == 10 and info["classes"][0] == "airplane"
    x_raw = np.concatenate([files[f"data_batch_{i}"][0] for i in range(1, 6)])
    y_raw = sum((files[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert tr.y.tolist() == y_raw
    xb, yb = tr.batch(torch.arange(15))  # no generator: no augmentation
    # row-major 3072 = 3 x 32 x 32 (channel planes), scaled to [0, 1], per-channel standardisation
    mean, std = np.array(cifar10.CIFAR10_MEAN), np.array(cifar10.CIFAR10_STD)
    want = (x_raw.reshape(15, 3, 32, 32) / 255.0 - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(xb.numpy(), want, rtol=1e-5, atol=1e-5)
    assert tr.augment and not te.augment
    # also accepts the batches directory itself
    tr2, _, _ = get_dataset("cifar10", data_dir=d)
    assert torch.equal(tr2.x, tr.x)
    # __getitem__ agrees with batch()
    xi, yi = tr[4]
    torch.testing.assert_close(xi, xb[4])
    assert yi == yb[4]


def test_cifar10_missing_and_corrupt_files_name_the_path(tmp_path):
    d, _ = _write_cifar(tmp_path, skip=("data_batch_3",))
    with pytest.raises(ValueError, match="data_batch_3"):
        get_dataset("cifar10", data_dir=tmp_path)
    _write_cifar(tmp_path)
    (d / "test_batch").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match=r"test_batch is not a CIFAR-10 python batch"):
        get_dataset("cifar10", data_dir=tmp_path)
    with open(d / "test_batch", "wb") as f:  # valid pickle, wrong shape
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match=r"shape \(2, 100\)"):
        get_dataset("cifar10", data_dir=tmp_path)
    with pytest.raises(ValueError, match="--data-dir is required .*--download"):
        get_dataset("cifar10")


def test_cifar10_download_verifies_md5(tmp_path, monkeypatch):
    # a fake tarball served by a patched urlretrieve: its md5 is wrong, so nothing may be extracted
    src = tmp_path / "src"
    _write_cifar(src)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    payload = buf.getvalue()
    calls = []

    def fake_urlopen(url):
        calls.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(cifar10.urllib.request, "urlopen", fake_urlopen)
    dest = tmp_path / "dest"
    with pytest.raises(RuntimeError, match="md5"):
        get_dataset("cifar10", data_dir=dest, download=True)
    assert calls == [cifar10.CIFAR10_URL]
    assert not (dest / "cifar-10-batches-py").exists()
    # with the expected checksum set to this payload's md5 the same archive is extracted and loaded
    monkeypatch.setattr(cifar10, "CIFAR10_MD5", hashlib.md5(payload).hexdigest())
    tr, te, _ = get_dataset("cifar10", data_dir=dest, download=True)
    assert len(tr) == 15 and len(te) == 3


class _Exploit:
    """Unpickling this runs os.system: a crafted data_batch must never get that far."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar10_crafted_pickle_is_refused_without_running_code(tmp_path):
    d, _ = _write_cifar(tmp_path)
    marker = tmp_path / "pwned"
    with open(d / "data_batch_2", "wb") as f:
        pickle.dump({b"data": _Exploit(marker), b"labels": [0]}, f)
    with pytest.raises(
        ValueError,
        match=r"data_batch_2 is not a CIFAR-10 python batch \(refusing to load "
        r"posix.system",
    ):
        get_dataset("cifar10", data_dir=tmp_path)
    assert not marker.exists()


def test_flip_crop_is_a_flip_and_shift_of_the_padded_image():
    torch.manual_seed(0)
    x = torch.randn(16, 2, 5, 6)
    g = torch.Generator().manual_seed(1)
    out = flip_crop(x, g, pad=2)
    assert out.shape == x.shape
    seen_flip, seen_shift = set(), set()
    for i in range(len(x)):
        matches = []
        for flip in (False, True):
            src = x[i].flip(-1) if flip else x[i]
            padded = torch.nn.functional.pad(src, (2, 2, 2, 2))
            for dy in range(5):
                for dx in range(5):
                    if torch.equal(padded[:, dy : dy + 5, dx : dx + 6], out[i]):
                        matches.append((flip, dy, dx))
        assert matches, f"sample {i} is not a flip+crop of its input"
        seen_flip.add(matches[0][0])
        seen_shift.add(matches[0][1:])
    assert seen_flip == {False, True} and len(seen_shift) > 3  # it is random
    # reproducible from the generator state
    torch.testing.assert_close(flip_crop(x, torch.Generator().manual_seed(1), pad=2), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="4D"):
        flip_crop(torch.zeros(2, 3, 4))


def test_array_dataset_augments_only_with_generator():
    x = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8)
    ds = ArrayDataset(x, torch.arange(8), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), augment=True)
    plain, _ = ds.batch(torch.arange(8))
    torch.testing.assert_close(plain, (x.float() / 255 - 0.5) / 0.25)
    aug, _ = ds.batch(torch.arange(8), torch.Generator().manual_seed(0))
    assert not torch.equal(aug, plain)
    with pytest.raises(ValueError, match="samples"):
        ArrayDataset(torch.zeros(3, 1, 2, 2), torch.zeros(2, dtype=torch.long))


def test_mnist1d_parallel_generation_equals_serial_bit_for_bit(monkeypatch):
    # the replayed random stream puts every worker at its chunk's exact state: the same arrays as mnist1d's own
    # serial make_dataset, element for element, at any number of workers (chunk bounds at odd places included)
    from normlab.runner.data import mnist1d_parallel

    args = mnist1d.generation_args(600)
    serial = mnist1d._generate(args)
    state = np.random.get_state()
    for workers in (2, 3):
        parallel = mnist1d_parallel.generate(args, workers)
        for key in ("x", "y", "x_test", "y_test"):
            assert np.array_equal(parallel[key].astype(serial[key].dtype), serial[key]), (workers, key)
    np.random.set_state(state)
    # through the loader (which only goes parallel for large sets): the same arrays, the global state untouched
    monkeypatch.setattr(mnist1d, "PARALLEL_MIN_SAMPLES", 0)
    before = np.random.get_state()[1].copy()
    via = mnist1d._generate(args, workers=2)
    assert all(np.array_equal(via[k], serial[k]) for k in serial)
    assert np.array_equal(np.random.get_state()[1], before)


def test_mnist1d_parallel_replay_mismatch_is_caught_and_falls_back(monkeypatch):
    # a replay that does not match mnist1d's draws (here: one draw too many per sample) is detected by the
    # workers' end states; the loader then generates serially, so the data stay right
    from normlab.runner.data import mnist1d_parallel

    args = mnist1d.generation_args(300)
    serial = mnist1d._generate(args)
    real = np.random.choice

    def extra_draw(*a, **k):
        np.random.rand()
        return real(*a, **k)

    def bad_states(args, starts):
        monkeypatch.setattr(np.random, "choice", extra_draw)
        try:
            return draw(args, starts)
        finally:
            monkeypatch.setattr(np.random, "choice", real)

    draw = mnist1d_parallel.draw_states
    monkeypatch.setattr(mnist1d_parallel, "draw_states", bad_states)
    with pytest.raises(mnist1d_parallel.ReplayMismatch):
        mnist1d_parallel.generate(args, 2)
    monkeypatch.setattr(mnist1d, "PARALLEL_MIN_SAMPLES", 0)
    fallback = mnist1d._generate(args, workers=2)
    assert all(np.array_equal(fallback[k], serial[k]) for k in serial)
