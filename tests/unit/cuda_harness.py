"""vLLM's real scheduler and umbp's real worker hooks, with the worker's copies run by a
recording fake of a GPU (:class:`umbp.testing.fake_cuda.FakeCuda`).

The KV tensors are host memory standing for the GPU's; the worker treats them as device
KV (byte ranges, streams, events, registered host memory), and the forward pass of each
step is enqueued on the fake's forward stream as vLLM's model runner enqueues its work:
blocks a load will fill are zeroed first (vLLM zeroes reused blocks on its stream; the
adversarial case: in the very step), each layer's attention reads its context blocks
after ``wait_for_layer_load``, each computed token's K/V rows are written, and the
sampled tokens are copied off at the end of the step, the host catching up one step
behind (asynchronous scheduling). Work runs lazily, so whatever umbp forgets to order
either shows as a violation in the fake's happens-before check or as wrong bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from tests.unit.vllm_driver import LAYERS, NULL_BLOCK, Driver, step_starts
from umbp.testing.fake_cuda import FakeCuda


def block_range(tensor: torch.Tensor, block: int) -> tuple[int, int]:
    """The bytes of one block of a ``[num_blocks, ...]`` KV tensor."""
    view = tensor[block]
    start = int(view.data_ptr())
    return start, start + int(view.numel()) * int(view.element_size())


class CudaDriver(Driver):
    """A :class:`Driver` whose worker copies through :attr:`fake`."""

    track_loads = False  # the KV is "on the GPU": read only after `sync`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.fake = FakeCuda()
        self.fake.model_thread = threading.get_ident()
        super().__init__(*args, **kwargs)

    def worker_connector(self, role: Any, worker_config: Any) -> Any:
        import umbp

        return umbp.UMBPStoreConnector(self.vllm_config, role, worker_config, device=self.fake)

    def new_kv_tensors(self) -> dict[str, torch.Tensor]:
        kv = super().new_kv_tensors()
        self.fake.device_memory(kv.values())
        return kv

    def sync(self) -> None:
        """The test reads the KV on the host: the GPU catches up first."""
        self.fake.run_all()

    def settle(self) -> None:
        super().settle()
        self.sync()

    def close(self) -> None:
        super().close()
        self.fake.close()

    def assert_blocks_hold(self, *args: Any, **kwargs: Any) -> int:
        self.sync()
        return super().assert_blocks_hold(*args, **kwargs)

    # -- one engine step, as vLLM's model runner enqueues it --------------------------------

    def _execute_rank(
        self, output: Any, track: bool = True
    ) -> tuple[Any, dict[str, list[tuple[int, int]]]]:
        self.fake.in_step = True
        try:
            return super()._execute_rank(output, track)
        finally:
            self.fake.in_step = False

    def before_forward(self, output: Any) -> None:
        self._zero_blocks_loads_fill(output.kv_connector_metadata)

    def after_step(self) -> None:
        self.fake.end_step()

    def _zero_blocks_loads_fill(self, meta: Any) -> None:
        for plan in getattr(meta, "loads", ()):
            for group in plan.groups:
                for name in self._layers_of(group.group_id):
                    tensor = self.kv[name]
                    for block in group.block_ids:
                        def zero(tensor: torch.Tensor = tensor, block: int = block) -> None:
                            tensor[block].zero_()
                        self.fake.forward_op("forward-zero", [block_range(tensor, block)], zero,
                                             label=f"zero {name} block {block}")

    def _layers_of(self, group_id: int) -> list[str]:
        return [name for name in LAYERS if self.group_of_layer[name] == group_id]

    def _forward(self, output: Any) -> None:
        starts = step_starts(output)
        for layer, name in enumerate(LAYERS):
            if output.kv_connector_metadata is not None:
                self.worker.wait_for_layer_load(name)
            tensor = self.kv[name]
            for request_id, count in output.num_scheduled_tokens.items():
                request = self.requests[request_id]
                start = starts[request_id]
                table = self.block_ids(request_id)[self.group_of_layer[name]]
                context = [b for b in table[: -(-(start + count) // self.block_size)]
                           if b != NULL_BLOCK]
                self.fake.forward_op("forward-read", [block_range(tensor, b) for b in context],
                                     label=f"attention {name} of {request_id}")
                self._write_tokens(name, layer, table, request.all_token_ids, start, count)

    def _write_tokens(self, name: str, layer: int, table: Sequence[int],
                      tokens: Sequence[int], start: int, count: int) -> None:
        blocks = {table[p // self.block_size] for p in range(start, start + count)
                  if p // self.block_size < len(table)
                  and table[p // self.block_size] != NULL_BLOCK}
        tensor = self.kv[name]
        tokens = list(tokens)

        def write() -> None:
            for position in range(start, start + count):
                self.write_token(name, layer, table, position, tokens[position])

        self.fake.forward_op("forward-write", [block_range(tensor, b) for b in blocks], write,
                             label=f"tokens {start}..{start + count} of {name}")
