#!/usr/bin/env bash
# LightZero 0.2.0 (the MuZero peer) in its own venv, for bench/mcts_speed.py and bench/muzero_cartpole.py.
#
#   bash bench/install_lightzero.sh [/work/venvs/lightzero]
#
# `pip install torch==2.13.0 lightzero==0.2.0` does not resolve: DI-engine 0.5.3 (LightZero's
# dependency) pins setuptools<=66.1.1 while torch 2.13 needs setuptools>=77.0.3. So torch goes in
# first, LightZero and DI-engine without dependencies, then their other requirements by hand.
# LightZero 0.2.0 ships a prebuilt cp311 manylinux wheel (its C++ tree included): about 3 minutes.
set -euo pipefail
VENV=${1:-/work/venvs/lightzero}
python -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install "torch==2.13.0+cpu" || "$PIP" install "torch==2.13.0"  # the CPU build where a wheel of it is at hand
"$PIP" install --no-deps "lightzero==0.2.0" "DI-engine==0.5.3"
"$PIP" install "yapf==0.29.0" "gym==0.25.1" "gymnasium==0.28.0" "numpy<2,>=1.24.1" "DI-treetensor>=0.4.0" \
    "DI-toolkit>=0.1.0" trueskill "tensorboardX>=2.2" "wandb<=0.19.0" matplotlib "easydict>=1.9" pyyaml enum-tools \
    cloudpickle hickle tabulate "click>=7.0.0" "flask<=2.0.3" "werkzeug<=2.0.3" requests responses URLObject pynng \
    sniffio redis "mpire>=2.3.5" einops pympler minigrid moviepy pytest line_profiler xxhash
# bench/mcts_speed.py runs our search beside LightZero's in this venv (PYTHONPATH=.): our MuZero model needs Lightning
"$PIP" install "pytorch-lightning>=2.3"
"$VENV/bin/python" -c "from lzero.mcts.ctree.ctree_muzero import mz_tree; print('LightZero ctree OK')"
