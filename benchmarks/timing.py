"""Timing helpers shared by the benchmarks."""

import torch


def in_cuda_graph(fn):
    """``fn`` captured once in a CUDA graph (as engines run decode and small batches): replays time
    the GPU work alone, without the launch overhead of the host."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture: compilation, allocator pools
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return lambda: (graph.replay(), out)[1]
