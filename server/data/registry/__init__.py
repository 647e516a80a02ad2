"""Where a config's datasets are registered and opened, above the two kinds
they open as: `Datasets` (datasets.py, the datasets by name, each opened
once), `open_dataset` and `Dataset` (factory.py: a `StepDataset` or a
`StreamDataset`). It sits above data/'s other modules and streams/, which
import nothing of it (tests/system/test_imports.py)."""

from grain_elevator.server.data.registry.datasets import Datasets
from grain_elevator.server.data.registry.factory import Dataset, open_dataset

__all__ = ["Dataset", "Datasets", "open_dataset"]
