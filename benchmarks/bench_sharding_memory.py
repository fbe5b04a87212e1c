"""Bytes per device of the weights, the optimizer slots and the noise state of a private
run of a KerasHub Gemma backbone on 8 virtual CPU devices: DataParallel against
ModelParallel (mesh 2 × 4, data × model, ``GemmaBackbone.get_layout_map``), banded
b = 16 (15 buffers) against BLT d = 4 (4 buffers).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 KERAS_BACKEND=jax \\
        python benchmarks/bench_sharding_memory.py --layers 2

The backbone and the optimizer are built inside a ``keras.StatelessScope(initialize_variables=False)``: the variables
get their paths, shapes and layouts (the model's from the distribution, the noise states'
from ``NoiseCurveOptimizer.build``, exactly as in a run) but no memory, so a realistic
width fits on a laptop; the bytes of a device are then ``Σ prod(shard shape) × 4`` over the
variables, the shard shape being ``NamedSharding.shard_shape`` of each variable's layout.
Before that, ``--check`` (default on) builds a tiny Gemma for real under both
distributions and checks that this count equals the bytes the devices actually hold
(``addressable_shards``). The slots are Adam's (two per weight, laid out as the weight, as
Keras's ``add_variable_from_reference`` lays them out): counted, not built.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402
from keras_noisecurve.backend.jax.sharding import jax_sharding, variable_layout  # noqa: E402
from keras_noisecurve.mixing import MixingMatrix  # noqa: E402
from keras_noisecurve.mixing.strategies import BLTMixing  # noqa: E402

GIB = 2.0**30


def _mixing(kind, steps=64):
    if kind == "banded":  # b = 16: a ring of 15 buffers (the values do not matter here)
        return MixingMatrix.from_dense(np.eye(steps), bands=16, metadata={"objective": "memory"})
    theta, omega = [0.99, 0.9, 0.6, 0.2], [0.3, 0.2, 0.1, 0.05]  # d = 4 buffers
    return BLTMixing(theta=theta, omega=omega, steps=steps, metadata={"objective": "memory"})


def _distribution(name):
    import keras_hub

    devices = jax.devices()
    if name == "DataParallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), devices=devices)
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh, model_parallel_dim_name="model",
                                                              data_parallel_dim_name="data")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _device_bytes(variable):
    """Bytes one device holds of ``variable`` (the largest shard: all are equal here)."""
    shape = tuple(variable.shape)
    sharding = jax_sharding(variable_layout(variable))
    shard = shape if sharding is None else sharding.shard_shape(shape)
    return int(np.prod(shard)) * np.dtype(variable.dtype).itemsize


def _build(config, distribution, kind, stateless):
    """The backbone and the built optimizer under ``distribution`` (variables without memory
    when ``stateless``: the optimizer's own counters are made before the scope)."""
    import keras_hub

    with distribution.scope():
        optimizer = knc.NoiseCurveOptimizer(learning_rate=0.1, mixing=_mixing(kind), noise_multiplier=1.0,
                                            expected_batch_size=64, seed=0)
        if stateless:
            with keras.StatelessScope(initialize_variables=False):
                backbone = keras_hub.models.GemmaBackbone(**config)
                optimizer.build(backbone.trainable_variables)
        else:
            backbone = keras_hub.models.GemmaBackbone(**config)
            optimizer.build(backbone.trainable_variables)
    return backbone, optimizer


def _counted(backbone, optimizer):
    weights = sum(_device_bytes(v) for v in backbone.trainable_variables)
    noise = sum(_device_bytes(s) for s in optimizer._rings if s is not None)
    return {"weights": weights, "slots": 2 * weights, "noise": noise,
            "parameters": int(sum(np.prod(v.shape) for v in backbone.trainable_variables))}


def _held(variables):
    """The bytes the most loaded device actually holds of ``variables``."""
    per_device = {}
    for v in variables:
        for shard in v.value.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def check():
    """The counted bytes equal the held bytes on a tiny Gemma built for real."""
    config = dict(vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=4, hidden_dim=32,
                  intermediate_dim=64, head_dim=8)
    for name in ("DataParallel", "ModelParallel"):
        for kind in ("banded", "blt"):
            backbone, optimizer = _build(config, _distribution(name), kind, stateless=False)
            counted = _counted(backbone, optimizer)
            held_weights = _held(backbone.trainable_variables)
            held_noise = _held([s for s in optimizer._rings if s is not None])
            if (counted["weights"], counted["noise"]) != (held_weights, held_noise):
                raise AssertionError(f"{name} {kind}: counted {counted} but the devices hold weights "
                                     f"{held_weights} and noise {held_noise} bytes")
    print("check: the counted bytes per device equal the bytes the devices hold (tiny Gemma, both distributions, "
          "banded and BLT)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocabulary", type=int, default=256_000)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--intermediate", type=int, default=49_152)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args(argv)
    if len(jax.devices()) != 8:
        raise SystemExit(f"needs 8 devices, got {len(jax.devices())}: set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 before starting")
    if args.check:
        check()
    config = dict(vocabulary_size=args.vocabulary, num_layers=args.layers, num_query_heads=args.heads,
                  num_key_value_heads=args.heads, hidden_dim=args.hidden, intermediate_dim=args.intermediate,
                  head_dim=args.head_dim)
    print(f"GemmaBackbone {config}, float32, 8 devices (ModelParallel: mesh 2 x 4, data x model, "
          "GemmaBackbone.get_layout_map)")
    print("| distribution | noise | parameters | weights GiB/device | Adam slots GiB/device | noise state GiB/device "
          "| total GiB/device |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in ("DataParallel", "ModelParallel"):
        for kind, label in (("banded", "banded b = 16"), ("blt", "BLT d = 4")):
            distribution = _distribution(name)
            backbone, optimizer = _build(config, distribution, kind, stateless=True)
            with distribution.scope():  # a deferred weight's layout is the distribution's
                c = _counted(backbone, optimizer)
            total = c["weights"] + c["slots"] + c["noise"]
            print(f"| {name} | {label} | {c['parameters'] / 1e6:.0f} M | {c['weights'] / GIB:.2f} | "
                  f"{c['slots'] / GIB:.2f} | {c['noise'] / GIB:.2f} | {total / GIB:.2f} |")


if __name__ == "__main__":
    main()
