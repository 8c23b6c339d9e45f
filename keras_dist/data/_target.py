"""`InputTarget`: what the input layer reads of a strategy, and nothing more.

The input layer sits below the strategies: it imports none of them, and a
strategy hands it its `placement` (`experimental_distribute_dataset`,
Keras's per-pass iterator seam) — the collaborator that lays data out on
the strategy's mesh (`strategies/placement/_placement.py`). What the input layer may
use is declared here, and nothing else of a strategy.
"""

from typing import Any, Protocol

from keras_dist.data._input_context import InputOptions

__all__ = ["InputTarget"]


class InputTarget(Protocol):
    """A strategy, as the input pipeline sees it."""

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas a global batch is split over (all processes)."""

    @property
    def devices(self) -> tuple:
        """The devices of the mesh (all processes)."""

    @property
    def num_local_replicas(self) -> int:
        """Replicas on this process's devices."""

    @property
    def num_processes(self) -> int:
        """Processes holding the strategy's devices."""

    @property
    def process_id(self) -> int:
        """This process's index among them."""

    def process_rows(self, rows: int) -> slice:
        """The rows of a global batch of `rows` rows this process holds."""

    def lay_out(
        self, data: Any, rows: int | None = None, *, num_real: Any = None
    ) -> Any:
        """Lays this process's (padded) rows out over the mesh; with
        `num_real`, each array carries its real rows."""

    def lay_out_steps(self, data: Any) -> Any:
        """Lays out the batches of several steps, stacked (steps, rows, ...)."""

    def step_numbers(self, count: int) -> list:
        """The int32 scalars `0 ... count - 1` on every device (kept)."""

    def step_range(self, start: int, count: int) -> Any:
        """The int32 vector `start ... start + count - 1` on every device (kept)."""

    @property
    def input_options(self) -> InputOptions:
        """How `fit`/`evaluate`/`predict` bring their input to the devices."""

    def lay_out_dataset(self, data: Any) -> Any:
        """Copies a whole dataset to every device (one process), for `take_rows`."""

    def lay_out_blocks(self, data: Any, batch_rows: int) -> tuple[Any, Any]:
        """A dataset read in order as blocks split over the replicas, and its tail."""

    def lay_out_rows(self, data: Any) -> tuple[Any, int]:
        """A dataset split over the replicas by rows, and the rows each holds."""

    def exchange_rows(
        self, rows: list, replica_rows: int, batches: list
    ) -> list[list[Any]]:
        """Groups of batches of `lay_out_rows`'s rows, laid out as blocks."""

    def take_rows(self, dataset: list, indices: Any, *, blocked: bool = False) -> list:
        """Rows `indices` of a placed dataset, gathered on the devices.

        With `blocked`, the dataset is `lay_out_blocks`'s blocks and `indices`
        a step number: that block.
        """
