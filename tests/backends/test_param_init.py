"""Parameter slices made on the device (backends/jax/param_init.py) are bit for bit the numpy
reference's (`InitializedData.block`), for every init and dtype, on random blocks, on one
device here and on 8 virtual CPU devices in a subprocess; and the portable transforms
(program/init_math.py) are accurate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from pcompile.backends.jax.param_init import device_block, round_bits, supports
from pcompile.compiler.frontend.initializer import (
    Constant,
    HeUniform,
    Normal,
    TruncatedNormal,
    Uniform,
    XavierUniform,
    initializer,
    set_seed,
)
from pcompile.ir.types import DType
from pcompile.program import init_math
from tests import ROOT
from tests.multiprocess import clean_env

FLOATS = [DType.float32, DType.bfloat16, DType.float16, DType.float64]
INITS = ["normal", "uniform", "xavier_uniform", "he_uniform", "truncatednormal",
         TruncatedNormal(sigma=1.0, a=-1.0, b=1.0),  # a third redrawn, some twice or more
         Normal(sigma=3.0, mean=-1.0), Uniform(scale=1e-3), XavierUniform(gain=2.0),
         HeUniform(mode="fan_out", nonlinearity="relu"), Normal(sigma=1e-4),  # float16 subnormals
         "zeros", "ones", 0.5, -3, Constant(1e6)]  # 1e6: infinity in float16


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}")


def random_bounds(rng: np.random.Generator, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for n in shape:
        lo = int(rng.integers(0, n))
        out.append((lo, int(rng.integers(lo + 1, n + 1))))
    return out


def check_blocks(init: object, dtype: DType) -> None:
    set_seed(5)
    rng = np.random.default_rng(abs(hash((str(init), dtype.name))) % 2**32)
    device = jax.devices()[0]
    for shape in ([37, 23, 5], [300, 70]):
        data = initializer(init, shape, dtype)
        assert supports(data)
        bounds = random_bounds(rng, data.shape)
        got = device_block(data, bounds, device)
        assert got is not None and got.shape == tuple(hi - lo for lo, hi in bounds)
        want = data.block(bounds)
        got_np = np.asarray(got)
        assert got_np.dtype == want.dtype
        np.testing.assert_array_equal(bits(got_np), bits(want),
                                      err_msg=f"{init} {dtype.name} {bounds}")


@pytest.mark.parametrize(("init", "dtype"), [
    ("normal", DType.float32), (TruncatedNormal(sigma=1.0, a=-1.0, b=1.0), DType.bfloat16),
    (Normal(sigma=1e-4), DType.float16), ("he_uniform", DType.float64), (0.5, DType.bfloat16)],
    ids=str)
def test_device_blocks_equal_numpy_bit_for_bit(init: object, dtype: DType) -> None:
    check_blocks(init, dtype)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("init", INITS, ids=str)
def test_device_blocks_equal_numpy_for_every_init_and_dtype(init: object, dtype: DType) -> None:
    """Random blocks of every init in every float dtype (a compile per init, shape and block:
    ~1 min on two cores)."""
    check_blocks(init, dtype)


@pytest.mark.parametrize("where", ["device", "auto"])
def test_the_in_process_runner_makes_the_programs_initial_values(where: str) -> None:
    """StandAloneRunner on JAX makes the initial values on the device, bit for bit the host's
    (the Llama example: float32 weights and Adam states, an embedding, norms' ones)."""
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.runners import StandAloneRunner

    program = compile_model(os.path.join(ROOT, "examples", "llama.py"), devices=1, dump=False)
    runner = StandAloneRunner(program, "jax", param_init=where)
    assert set(runner.values) == set(program.initial_values)
    for name in program.initial_values:
        want = program.initial_values[name]
        got = runner.values[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


def test_zero_rows_scalars_and_what_stays_on_the_host() -> None:
    device = jax.devices()[0]
    table = initializer("normal", [40, 8]).with_zero_rows([3, 17])
    for bounds in (((0, 40), (0, 8)), ((10, 20), (2, 6)), ((3, 4), (0, 8))):
        np.testing.assert_array_equal(np.asarray(device_block(table, bounds, device)),
                                      table.block(bounds))
    ones = initializer("ones", [6, 2]).with_zero_rows([1])
    np.testing.assert_array_equal(np.asarray(device_block(ones, ((0, 6), (0, 2)), device)),
                                  ones.block(((0, 6), (0, 2))))
    scalar = initializer("normal", [])
    block = np.asarray(device_block(scalar, (), device))  # a 0-d value's block: 1 element
    assert block.shape == (1,)
    np.testing.assert_array_equal(block[0], scalar.block(()))
    count = initializer(7, [4], DType.int32)  # constants of any dtype are filled on the device
    got = np.asarray(device_block(count, ((1, 3),), device))
    assert got.dtype == np.int32 and (got == 7).all()
    assert not supports(initializer(np.ones((2, 2)), [2, 2]))  # user arrays: read from .npy
    assert not supports(initializer("normal", [4], DType.int32))  # random integers: numpy
    with pytest.raises(ValueError, match="outside"):
        device_block(table, ((0, 41), (0, 8)), device)


def test_rounding_on_bits_matches_numpy_casts() -> None:
    """Ties, subnormals, overflow, NaN, infinities and signed zeros, to float32 and float16
    directly and to bfloat16 through float32 (numpy's and ml_dtypes' casts)."""
    import jax.numpy as jnp
    from jax import lax

    from pcompile.backends.jax.param_init import _to_dtype

    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-30,
               1 + 2**-24, 1 + 2**-24 + 2**-52, 1 + 3 * 2**-24, 65504.0, 65520.0, 65519.99,
               6.1e-5, 5.96e-8, 2.98e-8, 2.9802322387695312e-08, 1e-45, 7e-46, 3.4028235e38,
               3.4028236e38, 1e300, -1e-300, 5e-324, 2.2250738585072014e-308]
    values = np.concatenate([special, rng.standard_normal(20000) * 10.0 ** rng.integers(
        -50, 40, 20000)])
    with jax.enable_x64(True):
        x = jnp.asarray(values)
        for dtype in (DType.float32, DType.float16, DType.bfloat16):
            got = np.asarray(jax.jit(lambda v, d=dtype: _to_dtype(v, d))(x))
            with np.errstate(over="ignore"):
                # bfloat16 through float32, as the docstring says: ml_dtypes (0.7 here) casts
                # float64 to bfloat16 directly (a tie in float32 rounds differently), so the
                # reference spells the path out rather than depend on the installed version
                want = (values.astype(np.float32).astype(dtype.np)
                        if dtype == DType.bfloat16 else values.astype(dtype.np))
            same = (bits(got) == bits(want)) | (np.isnan(got.astype(np.float64))
                                                & np.isnan(want.astype(np.float64)))
            assert same.all(), (dtype, values[~same][:5], got[~same][:5], want[~same][:5])
        f16 = np.asarray(lax.bitcast_convert_type(
            round_bits(x, 5, 10).astype(jnp.uint16), jnp.float16))
    assert f16.dtype == np.float16 and ml_dtypes.bfloat16 is DType.bfloat16.np.type


def test_portable_log_and_cos_are_accurate() -> None:
    """init_math's log and cos (IEEE basic operations only) within 1 and 2 ulp of the exact
    values (computed in x87 extended precision, itself within ~4e-19 where 2 pi u is large;
    numpy's cos(2 pi u) is off by up to ~5e5 ulp near its zeros)."""
    rng = np.random.default_rng(1)
    k = np.concatenate([rng.integers(0, 2**53, 200000, dtype=np.uint64),
                        np.asarray([0, 1, 2, 2**50, 2**51 + 1, 2**52, 2**53 - 1], np.uint64)])
    u = k.astype(np.longdouble) * np.longdouble(2.0) ** -53
    pi = np.longdouble("3.14159265358979323846264338327950288")
    for got, want, ulps in ((init_math.log_unit(init_math.NUMPY, k), np.log1p(-u), 1),
                            (init_math.cos_turns(init_math.NUMPY, k), np.cos(2 * pi * u), 2)):
        error = np.abs(got.astype(np.longdouble) - want)
        ulp = np.spacing(np.abs(want.astype(np.float64)))
        assert (error <= ulps * ulp + 4e-19).all(), (error / ulp).max()


WORKER = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from pcompile.backends.jax.param_init import device_block
from pcompile.compiler.frontend.initializer import initializer, set_seed, TruncatedNormal
from pcompile.ir.types import DType

devices = jax.devices()
assert len(devices) == 8
set_seed(11)
report = []
for init, dtype in [("normal", DType.float32), ("he_uniform", DType.bfloat16),
                    (TruncatedNormal(sigma=1.0, a=-1.0, b=1.0), DType.float16),
                    ("uniform", DType.float64), ("zeros", DType.float32), (0.25, DType.bfloat16)]:
    data = initializer(init, [64, 48], dtype)
    whole = data.to_numpy()
    # a 4 x 2 split: device d holds rows (d // 2) * 16 ..., columns (d % 2) * 24 ...
    blocks = [device_block(data, ((d // 2 * 16, d // 2 * 16 + 16),
                                  (d % 2 * 24, d % 2 * 24 + 24)), devices[d])
              for d in range(8)]
    on = [next(iter(b.devices())).id for b in blocks]
    got = np.concatenate([np.concatenate([np.asarray(blocks[2 * i + j])
                                          for j in range(2)], 1) for i in range(4)], 0)
    width = whole.dtype.itemsize
    report.append({"case": f"{init} {dtype.name}", "devices": on,
                   "same": bool((got.view(f"u{width}") == whole.view(f"u{width}")).all())})

# the in-process SPMD runner makes every rank's blocks on its device as the numpy path does,
# with `device` by one program for all devices (param_init.mesh_blocks) for every value
import pcompile.backends.jax.param_init as param_init
from pcompile.backends.jax.spmd import JaxSpmdRunner
from pcompile.compiler.driver.runtime import initial_rank_values
from pcompile.tools.compile import compile as compile_model

made_whole = []
mesh_blocks = param_init.mesh_blocks
param_init.mesh_blocks = lambda *a, **k: made_whole.append(mesh_blocks(*a, **k)) or made_whole[-1]
program = compile_model("examples/llama.py", devices=8, dump=False)
want = initial_rank_values(program)
for where in ("device", "auto"):
    made_whole.clear()
    got = JaxSpmdRunner(program, param_init=where).values
    same = all(got[r][k].dtype == v.dtype and got[r][k].tobytes() == v.tobytes()
               for r, vals in enumerate(want) for k, v in vals.items())
    if where == "device":
        same = same and bool(made_whole) and all(a is not None for a in made_whole)
    report.append({"case": f"JaxSpmdRunner {where}", "devices": list(range(8)), "same": same})
print("REPORT " + json.dumps(report))
"""


# slow: an 8-device worker process (~17 s); test_device_blocks_equal_numpy_bit_for_bit checks
# device_block's values on this process's device
@pytest.mark.slow
def test_blocks_on_eight_devices_equal_the_single_device_initialisation() -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    for case in report:
        assert case["same"], case
        assert case["devices"] == list(range(8)), case


@pytest.mark.slow
def test_rank_program_makes_the_same_state_on_the_device_and_on_the_host(tmp_path) -> None:
    """The 8-rank program, every rank in one process on 8 virtual CPU devices: the state it
    makes on the devices (PCOMPILE_PARAM_INIT=device) and on the host (=host) train to the same
    losses and checkpoints, bit for bit."""
    from pcompile.backends.checkpoint_files import checkpoint_path, read_checkpoint
    from pcompile.tools.compile import compile as compile_model

    out = tmp_path / "out"
    compile_model(os.path.join(ROOT, "examples", "gpt_block.py"), devices=8,
                  parallel_mode="semi_auto_parallel", out_dir=str(out))
    env = clean_env()
    runs = {}
    for where in ("device", "host"):
        ckpt = tmp_path / f"ckpt_{where}"
        proc = subprocess.run([sys.executable, str(out / "rank_0" / "program.py"), "--steps",
                               "2", "--checkpoint-dir", str(ckpt), "--param-init", where],
                              capture_output=True, text=True, env=env, timeout=600,
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        made = [x for x in proc.stdout.splitlines() if x.startswith("parameters and ")]
        assert made and (" 0.00 M on the host" in made[0]) == (where == "device"), made
        runs[where] = ((out / "rank_3" / "train.log").read_text(),
                       [read_checkpoint(checkpoint_path(str(ckpt), r, 2), r)[0]
                        for r in (0, 3, 7)])
    assert runs["device"][0] == runs["host"][0]
    for got, want in zip(runs["device"][1], runs["host"][1]):
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(bits(got[name]), bits(want[name]), err_msg=name)


# -- params.json is checked before anything is made ---------------------------------------------


def manifest(tmp_path, entry: dict) -> str:
    """An output folder whose params.json holds one value `w` with the init `entry`."""
    from pcompile.backends.params import FORMAT, MANIFEST

    folder = tmp_path / "out"
    (folder / "params").mkdir(parents=True)
    data = {"format": FORMAT, "params": {"w": {"kind": "weight", "shape": [4, 3],
                                               "dtype": "float32", "init": entry}}}
    (folder / MANIFEST).write_text(json.dumps(data))
    return str(folder)


GOOD = {"initializer": "Normal", "args": {"sigma": 0.01, "mean": 0.0}, "ticket": [1, 0],
        "zero_rows": []}
BAD_ENTRIES = {
    "escaping file": ({"file": "params/../../x.npy", "view": None}, "outside the output folder"),
    "absolute file": ({"file": "/etc/passwd", "view": None}, "not a path relative"),
    "wrong-typed argument": ({**GOOD, "args": {"sigma": "abc", "mean": 0.0}},
                             "Normal: sigma must be a number, got str 'abc'"),
    "unknown argument": ({**GOOD, "args": {"sigma": 0.01, "mean": 0.0, "scale": 2}},
                         "unexpected keyword argument 'scale'"),
    "missing argument": ({**GOOD, "args": {"sigma": 0.01}}, "takes the arguments sigma, mean"),
    "arguments not an object": ({**GOOD, "args": [0.01]}, "not an object"),
    "negative sigma": ({**GOOD, "args": {"sigma": -1.0, "mean": 0.0}}, "sigma must be > 0"),
    "unknown initializer": ({**GOOD, "initializer": "InitializedData"}, "unknown initializer"),
    "bad ticket": ({**GOOD, "ticket": ["1", 0]}, "not an integer"),
    "no ticket": ({**GOOD, "ticket": None}, "draws random numbers but has no ticket"),
    "xavier on a vector": ({"initializer": "XavierUniform", "args": {"gain": 1.0},
                            "ticket": [1, 0]}, None),
    "zero with a value": ({"initializer": "Zero", "args": {"value": 3}}, "Zero takes"),
    "init not an object": ("normal", "not an object with an init"),
}


@pytest.mark.parametrize("kind", list(BAD_ENTRIES))
def test_a_bad_params_entry_is_one_message(tmp_path, kind: str) -> None:
    from pcompile.backends.params import ParamsError, read_manifest

    entry, message = BAD_ENTRIES[kind]
    folder = manifest(tmp_path, entry)
    (tmp_path / "x.npy").write_bytes(b"")
    if kind == "xavier on a vector":  # a 1-d shape: no fans
        data = json.loads((tmp_path / "out" / "params.json").read_text())
        data["params"]["w"]["shape"] = [12]
        (tmp_path / "out" / "params.json").write_text(json.dumps(data))
        message = "fewer than 2 dimensions"
    with pytest.raises(ParamsError) as info:
        read_manifest(folder)
    text = str(info.value)
    assert text.startswith(f"{folder}/params.json: parameter 'w' cannot be used (") and \
        text.endswith("; compile again") and message in text, text
    good = read_manifest(manifest(tmp_path / "good", GOOD))["w"]  # and a good one reads
    assert good.shape == (4, 3) and good.ticket == (1, 0)


def test_params_files_must_be_regular_files_inside_the_folder(tmp_path) -> None:
    """A FIFO (which would block the rank at open) or a link out of the folder is refused
    before anything opens it; a .npy inside the folder is read."""
    from pcompile.backends.params import ParamsError, read_manifest

    folder = manifest(tmp_path, {"file": "params/w.npy", "view": None})
    os.mkfifo(os.path.join(folder, "params", "w.npy"))
    with pytest.raises(ParamsError, match="is not a regular file"):
        read_manifest(folder)
    os.unlink(os.path.join(folder, "params", "w.npy"))
    outside = tmp_path / "secret.npy"
    np.save(outside, np.ones((4, 3), np.float32))
    os.symlink(outside, os.path.join(folder, "params", "w.npy"))
    with pytest.raises(ParamsError, match="outside the output folder"):
        read_manifest(folder)
    os.unlink(os.path.join(folder, "params", "w.npy"))
    np.save(os.path.join(folder, "params", "w.npy"), np.full((4, 3), 2, np.float32))
    assert (read_manifest(folder)["w"].to_numpy() == 2).all()
    npy = manifest(tmp_path / "npy", {"npy": str(tmp_path / "fifo.npy")})
    os.mkfifo(tmp_path / "fifo.npy")
    with pytest.raises(ParamsError, match="is not a regular file"):
        read_manifest(npy)
