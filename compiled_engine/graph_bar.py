"""The compile progress bar: graphs done / total and elapsed time, fed by `startup.warm_up`'s
callback."""

from __future__ import annotations


class GraphBar:
    """`graphs: 1/2 [00:38<00:38, decode, any batch]`: called as each graph starts, with its
    name."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, graph: str, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="graph", desc="graphs")
        else:
            self.bar.update(1)
        self.bar.set_postfix_str(graph)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()
