"""A fake Grid that delivers messages to in-process nodes (the real ClientApp or stubs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

NodeFn = Callable[[Message], Message | None]  # None = the node never answers


def set_task_identity() -> None:
    """Flower 1.41 needs a task identity to build messages outside a running app."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


class FakeGrid(Grid):
    """Delivers each message to ``nodes[dst]``; records every message and reply."""

    def __init__(self, nodes: dict[int, NodeFn]) -> None:
        self.nodes = nodes
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        out = []
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"m{len(self.sent)}-{i}"
            self.sent.append(m)
            reply = self.nodes[m.metadata.dst_node_id](m)
            if reply is not None:
                out.append(reply)
        self.replies.extend(out)
        return out

    # unused by the strategy
    def set_run(self, run):  # pragma: no cover
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *a, **k):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError


def client_node(app, node_id: int, node_config: dict, run_config: dict, run_id: int = 7) -> NodeFn:
    """A node running the real ClientApp ``app`` in this process."""
    ctx = Context(run_id=run_id, node_id=node_id, node_config=node_config, state=RecordDict(), run_config=run_config)
    return lambda msg: app(msg, ctx)


def write_topic_csv(path, topics: dict[str, str], per_topic: int, template: str = "{base} number {i}.") -> str:
    """A small CSV (text, topic) with ``per_topic`` records per topic; returns its path."""
    import pandas as pd

    rows = [{"text": template.format(base=base, i=i), "topic": t}
            for t, base in topics.items() for i in range(per_topic)]
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


class NanWeightsFromRound2(FedAvg):
    """A curious server's phase-1 aggregator (run-config ``aggregator``): from round 2 on it sends
    the strong nodes weights with a NaN in them, as a probe of the records through non-finite
    arithmetic. The nodes must refuse it before anything is spent."""

    def configure_train(self, server_round, arrays, config, grid):  # noqa: D102
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if server_round >= 2:
            import numpy as np
            from flwr.app import Array, ArrayRecord

            for m in messages:
                rec = m.content.array_records["arrays"]
                poisoned = {k: np.array(v.numpy(), copy=True) for k, v in rec.items()}
                first = next(iter(poisoned))
                poisoned[first].flat[0] = np.nan
                m.content.array_records["arrays"] = ArrayRecord({k: Array(v) for k, v in poisoned.items()})
        return messages


class NanAggregate(FedAvg):
    """A broken phase-1 aggregator (run-config ``aggregator``) whose global weights are NaN."""

    def aggregate_train(self, server_round, replies):  # noqa: D102
        import numpy as np
        from flwr.app import Array, ArrayRecord

        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            arrays = ArrayRecord({k: Array(np.full_like(v.numpy(), np.nan)) for k, v in arrays.items()})
        return arrays, metrics
