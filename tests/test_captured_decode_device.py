"""The captured decode step on a GPU that is not the current one (issue 25): the CUDA graph is
recorded on the model's device. On a CPU, ``CUDAGraphRecorder`` runs against a stand-in of
the ``torch.cuda`` calls it makes (which device each stream and graph belongs to, as torch
decides it); with two GPUs, beams decoded on ``cuda:1`` by the captured step are the eager
step's (marked ``gpu``)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import lora_core as lc


class FakeCuda:
    """``torch.cuda``'s device, stream and graph calls, on a CPU, deciding as torch does which
    device each belongs to: a ``Stream()`` or ``CUDAGraph()`` made without a device belongs to
    the current one; ``stream(s)`` makes ``s`` current on ``s``'s device only; ``graph(g)``
    captures on its ``stream=``, else on a stream of the current device (torch/cuda/graphs.py).
    A kernel on a tensor of device ``d`` goes to ``d``'s current stream: ``launch(d)`` notes
    which stream that is (``default``, ``side`` or ``captured``)."""

    def __init__(self, current: int = 0):
        self.current, self.defaults, self.streams, self.capturing = current, {}, {}, None
        self.graphs, self.launches = [], []
        fake = self

        class Stream:
            def __init__(self, device=None, **_):
                self.device = fake.index(device)

            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def __init__(self):
                self.device, self.captured_on, self.replayed_on = fake.current, None, []
                fake.graphs.append(self)

            def replay(self):
                self.replayed_on.append(fake.current)

        class graph:
            def __init__(self, g, pool=None, stream=None, **_):
                self.g, self.capture_stream = g, stream if stream is not None else Stream()

            def __enter__(self):
                self.ctx = fake.stream(self.capture_stream)
                self.ctx.__enter__()
                fake.capturing = self.capture_stream
                self.g.captured_on = (fake.current, self.capture_stream.device)  # capture_begin

            def __exit__(self, *exc):
                fake.capturing = None
                self.ctx.__exit__(*exc)

        self.Stream, self.CUDAGraph, self.graph = Stream, CUDAGraph, graph

    def index(self, device) -> int:
        if device is None or isinstance(device, int):
            return self.current if device is None else device
        return torch.device(device).index

    def current_stream(self, device=None):
        d = self.index(device)
        return self.streams.get(d) or self.defaults.setdefault(d, self.Stream(d))

    @contextlib.contextmanager
    def device(self, device):
        before, self.current = self.current, self.index(device)
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def stream(self, s):
        before = self.streams.get(s.device)
        self.streams[s.device] = s
        try:
            yield
        finally:
            self.streams[s.device] = before

    def launch(self, device: int) -> None:
        s = self.current_stream(device)
        kind = "captured" if s is self.capturing else "default" if s is self.defaults[device] else "side"
        self.launches.append((device, kind))


def _fake_cuda(monkeypatch, current: int) -> FakeCuda:
    fake = FakeCuda(current)
    for name in ("CUDAGraph", "graph", "Stream", "current_stream", "device", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


@pytest.mark.parametrize("current", [0, 1])
def test_cuda_graph_recorder_records_on_the_model_device(monkeypatch, current):
    """The model on cuda:1, cuda:``current`` current: the warm-ups run on a side stream of
    cuda:1, the recording captures the step's kernels (cuda:1 current, on a capture stream of
    cuda:1), replays run with cuda:1 current, and the current device is left as it was."""
    from backends.torch._captured_decode import CUDAGraphRecorder

    fake = _fake_cuda(monkeypatch, current)
    out = torch.zeros(3)
    replay, got = CUDAGraphRecorder().record(lambda: (fake.launch(1), out)[1], torch.device("cuda:1"))
    (graph,) = fake.graphs
    assert got is out and fake.current == current
    assert fake.launches == [(1, "side"), (1, "side"), (1, "captured")], fake.launches
    assert graph.device == 1 and graph.captured_on == (1, 1), vars(graph)
    replay()
    assert graph.replayed_on == [1] and fake.current == current


def test_fake_cuda_shows_why_a_bare_recording_misses_another_gpu(monkeypatch):
    """The stand-in reproduces issue 25's failure, so the test above can fail: recorded as
    before the fix (a stream and a graph made with no device, cuda:0 current), a cuda:1 step's
    kernels all run on cuda:1's default stream, none is captured."""
    fake = _fake_cuda(monkeypatch, 0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fake.launch(1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fake.launch(1)
    assert fake.launches == [(1, "default"), (1, "default")] and g.captured_on == (0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_captured_decode_on_the_second_gpu_gives_the_eager_beams():
    """On cuda:1 (cuda:0 current), the step captured once per shape decodes the eager step's
    beams, and the CPU's."""
    from test_beam import captured_search

    from backends.torch._captured_decode import CUDAGraphRecorder

    bt = lc.get_backend("torch")
    cfg = lc.gpt2_config("tiny")
    model = bt.build_model(cfg, lc.LoRAConfig(r=4, alpha=8), lc.init_gpt2_weights(cfg, 0))
    rng = np.random.default_rng(3)
    model.load_partial({n: rng.normal(0, 0.1, v.shape).astype(np.float32) for n, v in model.state_numpy().items()
                        if "lora_" in n})
    ctxs = [list(np.random.default_rng(10 + i).integers(1, 999, 3 + 2 * i)) for i in range(7)]
    bc = lc.beam.BeamConfig(beam=4, max_new_tokens=14, stop_ids=(5, 7, 9), length_penalty=0.8,
                            repetition_penalty=1.3, min_length=4, no_repeat_ngram_size=2)
    cpu = bt.beam_search(model, ctxs, bc, batch_size=3, decode_step="eager")
    assert bt.to_device(model, "cuda:1") == "cuda:1" and torch.cuda.current_device() == 0
    eager = bt.beam_search(model, ctxs, bc, batch_size=3, decode_step="eager")
    assert bt.beam_search(model, ctxs, bc, batch_size=3, decode_step="captured") == eager == cpu
    out, static = captured_search(model, ctxs, bc, 3)
    assert out == eager and static.captures == 2 and isinstance(static.recorder, CUDAGraphRecorder)
    assert torch.cuda.current_device() == 0
