"""bench/evaluations.py: the table of `evaluate --out` records, from an evaluation the CLI wrote."""

import json

from lightning_wm.cli import main

from support.bench_scripts import load_bench_script

evaluations = load_bench_script("evaluations.py")

RECORD = {
    "run": "worldmodels-carracing-controller_dream_320",
    "checkpoint": "/runs/lightning_logs/worldmodels-carracing-controller_dream_320/checkpoints/best.ckpt",
    "checkpoint_step": 15,
    "hparams": {"memory_ckpt": "lightning_logs/m_320/checkpoints/last.ckpt", "dream": {"dir": "d/latents_320"}},
    "env": {"id": "CarRacing-v3", "seed": 7},
    "return_mean": 2.0,
    "return_std": 1.0,
    "returns": [1.0, 3.0],
}


def test_a_row_shows_the_run_the_checkpoint_the_settings_and_the_returns():
    text = evaluations.table([RECORD], ["memory_ckpt", "dream.dir", "dream.temperature"])
    head, rule, row = text.splitlines()
    assert head.count("|") == rule.count("|") == row.count("|") == 10
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == [
        "worldmodels-carracing-controller_dream_320",
        "worldmodels-carracing-controller_dream_320/best.ckpt (step 15)",
        "m_320/last.ckpt",
        "latents_320",
        "—",  # not a setting of this record
        "7",
        "2",
        "2.00 ± 1.00",
        "2.00",
    ]


def test_the_records_evaluate_writes_make_a_table(tmp_path, capsys):
    args = ["evaluate", "--model", "lightning_wm.agents.random.RandomPolicy"]
    args += ["--data", "lightning_wm.data.offline.EpisodeDataModule", "--data.directory", "eps"]
    args += ["--data.env", '{"id": "CartPole-v1", "seed": 5}', "--episodes", "2", "--out", "evals.jsonl"]
    main(args=args)
    record = json.loads(open("evals.jsonl").read())
    capsys.readouterr()
    evaluations.main(["evals.jsonl", "--runs", record["run"]])
    out = capsys.readouterr().out
    assert f"{record['return_mean']:.2f} ± {record['return_std']:.2f}" in out and "CartPole" not in out
