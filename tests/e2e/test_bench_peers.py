"""benchmarks/bench_peers.py without its peers: model definitions, the timer's median, the skip path (≈ 20 s)."""

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMMON = _load("_peer_common")


@pytest.mark.parametrize(
    "name, expected",
    [
        # (784·512 + 512) + (512·512 + 512) + (512·10 + 10)
        ("mlp", 401_920 + 262_656 + 5_130),
        # convs 3·3·(3·16 + 16·32 + 32·64) + biases 112, GroupNorm 2·112, Dense 256·64 + 64, 64·10 + 10
        ("cnn", 9 * (48 + 512 + 2048) + 112 + 224 + 16_448 + 650),
        # MHA: 4 projections (64·64 + 64); 2 LayerNorms 2·128; Dense 64→256, 256→64, 64→10
        ("transformer", 4 * 4_160 + 256 + 16_640 + 16_448 + 650),
    ],
)
def test_peer_models_are_the_stated_architectures(name, expected):
    import keras

    model = COMMON.build_model(name, keras)
    assert model.count_params() == expected
    batch, shape = COMMON.MODELS[name]
    assert tuple(model.input_shape[1:]) == shape
    x, y = COMMON.make_data(name, 2)
    assert x.shape == (2 * batch, *shape) and y.min() >= 0 and y.max() <= 9
    assert tuple(model.output_shape) == (None, 10)


def test_summarise_drops_the_warmup_and_takes_the_median():
    ends = [0.0, 10.0, 10.001, 10.003, 10.006, 10.010]  # steps 10 s (compile), 1, 2, 3, 4 ms
    median, steps = COMMON.summarise(ends, warmup=1)
    assert steps == pytest.approx([10_000.0, 1.0, 2.0, 3.0, 4.0])
    assert median == pytest.approx(2.5)
    assert COMMON.summarise(ends, warmup=2)[0] == pytest.approx(3.0)
    with pytest.raises(RuntimeError, match="no timed steps"):
        COMMON.summarise(ends, warmup=5)


def test_missing_peers_are_skipped_with_their_setup_commands(tmp_path, capsys):
    bench = _load("bench_peers")
    out = tmp_path / "table.md"
    missing = str(tmp_path / "nowhere" / "bin" / "python")
    code = bench.main(["--models", "mlp", "--columns", "keras-tf", "jax-privacy", "tfp-fast",
                       "--warmup", "1", "--steps", "2", "--jax-python", missing, "--tfp-python", missing,
                       "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "pip install jax-privacy==2.0.0" in printed and "pip install tensorflow-privacy==0.9.0" in printed
    table = out.read_text()
    assert "jax-privacy skipped: no interpreter at" in table and "tfp-fast skipped" in table
    row = next(line for line in table.splitlines() if line.startswith("| MLP"))
    assert row.count("|") == 3 and " ms" in row  # one timed column: plain Keras (TF)
    assert "keras 3." in table and "tensorflow 2." in table  # versions in the header
