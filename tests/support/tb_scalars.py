"""What a run logged to TensorBoard, for tests that check logged curves."""

from pathlib import Path


def logged_scalars(run_dir: Path, tag: str) -> list[float]:
    """Every value of scalar ``tag`` in the ``version_*`` folders of ``run_dir``, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for version in sorted(run_dir.glob("version_*")):
        acc = EventAccumulator(str(version))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [e.value for e in acc.Scalars(tag)]
    return values
