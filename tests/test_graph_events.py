"""The cross-graph ordering oasis's tail graph relies on (policies/oasis.py): a graph replayed on one stream records an
external event at its end, and a graph replayed after it on another stream waits for that event at a node inside it,
not at its start. GPU only: the CPU runs no graphs."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: far longer than launching the second graph


def capture(stream: torch.cuda.Stream, fn) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


@pytest.mark.parametrize("wait", [True, False])
def test_a_graph_waits_inside_for_an_event_another_graph_records(wait):
    """With the wait node, the reader sees the writer's value though the writer sleeps first; without it (the
    control), it reads the old value: the sleep outlasts the launch, so the first case shows the wait."""
    side, main = torch.cuda.Stream(), torch.cuda.Stream()
    done = torch.cuda.Event(external=True)
    done.record(side)  # created before any capture waits on it
    x, before, y = (torch.zeros(1, device="cuda") for _ in range(3))

    def writer():
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
        done.record()

    def reader():
        before.copy_(x + 2.0)  # work ahead of the wait, which need not wait
        if wait:
            torch.cuda.current_stream().wait_event(done)
        y.copy_(x)

    write, read = capture(side, writer), capture(main, reader)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        write.replay()
    with torch.cuda.stream(main):
        read.replay()
    torch.cuda.synchronize()
    assert before.item() == 2.0  # read before the writer finished, in both cases
    assert y.item() == (1.0 if wait else 0.0)
