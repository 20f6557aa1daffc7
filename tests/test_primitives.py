"""The shared primitives: tree utilities, atomic writes, seed derivation."""

import errno
import json
import os
import time

import numpy as np
import pytest
import torch

from lightning_wm import io, seeding, tree


def test_tree_map_keeps_structure_and_none():
    t = {"a": torch.ones(2), "b": (np.zeros(3), [torch.zeros(1)]), "c": None}
    out = tree.tree_map(lambda x: x + 1, t)
    assert set(out) == {"a", "b", "c"} and out["c"] is None
    assert isinstance(out["b"], tuple) and isinstance(out["b"][1], list)
    assert torch.equal(out["a"], torch.full((2,), 2.0)) and np.array_equal(out["b"][0], np.ones(3))
    summed = tree.tree_map(lambda x, y: x + y, t, out)
    assert torch.equal(summed["a"], torch.full((2,), 3.0))


def test_flatten_unflatten_roundtrip_and_bad_keys():
    nested = {"obs": {"image": 1, "state": 2}, "reward": 3}
    flat = tree.flatten(nested)
    assert flat == {"obs/image": 1, "obs/state": 2, "reward": 3}
    assert tree.unflatten(flat) == nested
    with pytest.raises(ValueError, match="invalid"):
        tree.flatten({"a/b": 1})
    with pytest.raises(ValueError, match="empty mapping"):
        tree.flatten({"a": {}})


def test_stack_and_first_leaf_and_where():
    states = [(torch.full((2, 3), float(i)), {"z": torch.full((2,), float(i))}) for i in range(4)]
    stacked = tree.stack(states)
    assert stacked[0].shape == (4, 2, 3) and stacked[1]["z"].shape == (4, 2)
    assert tree.first_leaf({"x": [np.zeros(5)]}).shape == (5,)
    old = (torch.zeros(3, 2), {"z": torch.zeros(3, dtype=torch.long)})
    new = (torch.ones(3, 2), {"z": torch.ones(3)})
    out = tree.where(torch.tensor([True, False, True]), new, old)
    assert out[0][:, 0].tolist() == [1, 0, 1] and out[1]["z"].tolist() == [1, 0, 1]
    assert out[1]["z"].dtype == torch.long


def test_concat_joins_along_an_existing_dimension():
    parts = [{"obs": np.full((2, 3), i), "state": (torch.full((1, 2), float(i)), None)} for i in range(3)]
    joined = tree.concat(parts)
    assert joined["obs"].shape == (6, 3) and joined["obs"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert joined["state"][0].shape == (3, 2) and joined["state"][1] is None
    chunks = [np.arange(6).reshape(2, 3) + 10 * i for i in range(2)]
    assert tree.concat(chunks, dim=1).tolist() == [[0, 1, 2, 10, 11, 12], [3, 4, 5, 13, 14, 15]]
    with pytest.raises(ValueError, match="at least one"):
        tree.concat([])


def test_atomic_write_replaces_whole_file_and_cleans_up_on_error(tmp_path):
    target = tmp_path / "x.bin"
    io.atomic_write(target, lambda f: f.write(b"one"))
    assert target.read_bytes() == b"one"

    def fail(f):
        f.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        io.atomic_write(target, fail)
    assert target.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_append_json_line_keeps_earlier_lines_and_names_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "new_folder" / "records.jsonl"
    io.append_json_line(path, {"a": 1})
    io.append_json_line(path, {"b": tmp_path})  # a path is written as its str
    assert path.read_text().splitlines() == ['{"a": 1}', json.dumps({"b": str(tmp_path)})]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(io.DiskFullError, match="no space left on the device appending to"):
        io.append_json_line(path, {"c": 3})


def test_atomic_torch_save_and_stale_temp_cleanup(tmp_path):
    io.atomic_torch_save({"w": torch.arange(3)}, tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["w"], torch.arange(3))
    stale = tmp_path / ".a.pt.123-abcd.tmp"
    stale.write_bytes(b"")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / ".b.pt.456-ef01.tmp"
    fresh.write_bytes(b"")
    removed = io.clean_stale_temps(tmp_path)
    assert removed == [stale] and fresh.exists() and (tmp_path / "a.pt").exists()


def test_seeds_are_deterministic_distinct_and_in_range():
    a = seeding.derive_seed(0, "train", rank=1, actor=2, index=3)
    assert a == seeding.derive_seed(0, "train", rank=1, actor=2, index=3)
    seeds = {
        seeding.derive_seed(0, role, r, act, i)
        for role in ("train", "eval")
        for r in range(4)
        for act in range(8)
        for i in range(16)
    }
    assert len(seeds) == 2 * 4 * 8 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert seeding.env_seeds(5, 3) == [seeding.derive_seed(5, "train", 0, 0, i) for i in range(3)]
    torch.Generator().manual_seed(a)  # usable as a torch seed
    with pytest.raises(ValueError):
        seeding.derive_seed(-1)


def test_the_settings_checks_name_the_setting_and_what_it_needs():
    from lightning_wm.settings import check_at_least, check_in_range, check_one_of, check_positive

    check_at_least("replay.capacity", None, 1)  # unset passes
    check_at_least("es.popsize", 2, 2)
    with pytest.raises(ValueError, match=r"^es\.popsize must be >= 2, got 1$"):
        check_at_least("es.popsize", 1, 2)
    with pytest.raises(ValueError, match=r"^es\.sigma0 must be > 0, got 0\.0$"):
        check_positive("es.sigma0", 0.0)
    with pytest.raises(ValueError, match=r"^behavior\.discount must be in \[0\.0, 1\.0\], got 1\.5$"):
        check_in_range("behavior.discount", 1.5, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"^dream\.starts must be one of \['first', 'all'\], got 'some'$"):
        check_one_of("dream.starts", "some", ("first", "all"))
