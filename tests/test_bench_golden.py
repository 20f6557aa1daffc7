"""bench/golden.py's hashing: one flipped bit, another dtype or shape, a missing key all show."""

from __future__ import annotations

from pathlib import Path

import torch

from support.bench_scripts import load_bench_script

golden = load_bench_script("golden.py")  # bench/ goes last on sys.path: its minatar.py shadows nothing
RUNS, _tensor_hashes = golden.RUNS, golden._tensor_hashes


def _hashes(value: object) -> dict[str, str]:
    out: dict[str, str] = {}
    _tensor_hashes(value, "state", out)
    return out


def test_equal_tensors_hash_equal_and_one_bit_differs():
    a = {"w": torch.arange(6, dtype=torch.float32), "b": torch.zeros(2)}
    b = {"b": torch.zeros(2), "w": torch.arange(6, dtype=torch.float32)}
    assert _hashes(a) == _hashes(b)  # key order does not matter
    flipped = a["w"].clone()
    flipped.view(torch.int32)[3] ^= 1  # the lowest mantissa bit of one element
    assert _hashes({**a, "w": flipped})["state/w"] != _hashes(a)["state/w"]
    assert _hashes({**a, "w": torch.tensor(-0.0)}) != _hashes({**a, "w": torch.tensor(0.0)})


def test_dtype_shape_and_keys_are_part_of_the_hash():
    w = torch.zeros(4)
    assert _hashes({"w": w}) != _hashes({"w": w.double()})
    assert _hashes({"w": w}) != _hashes({"w": w.reshape(2, 2)})
    assert set(_hashes({"w": w, "v": [w, 3]})) == {"state/w", "state/v[0]", "state/v[1]"}


def test_every_run_names_a_shipped_config():
    root = Path(__file__).resolve().parents[1]
    for name, args in RUNS.items():
        config = args[args.index("--config") + 1]
        assert Path(config).is_file() and str(root / "configs") in config, name
