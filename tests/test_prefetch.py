"""The reader thread of the streamed engines (:mod:`symalign.io.prefetch`): the values of ``map(read, items)``, at
most one item ahead, errors raised where they happened, no thread left behind, and bit-identical streamed OUT with
``SYMALIGN_PREFETCH`` on and off."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from symalign.errors import CheckpointError, ConfigError
from symalign.io.prefetch import ENV, enabled, read_ahead


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "symalign-prefetch"]


@pytest.fixture(autouse=True)
def _no_thread_left():
    yield
    deadline = time.time() + 2
    while _prefetch_threads() and time.time() < deadline:
        time.sleep(0.01)
    assert not _prefetch_threads(), "a prefetch thread outlived its iteration"


@pytest.mark.parametrize("setting", ["1", "0"])
def test_values_and_order_are_those_of_map(setting, monkeypatch):
    monkeypatch.setenv(ENV, setting)
    items = list(range(7))
    read = lambda i: {"x": torch.full((3,), float(i)), "i": i}  # noqa: E731
    got = list(read_ahead(read, items))
    assert [g["i"] for g in got] == items and all(torch.equal(g["x"], read(i)["x"]) for i, g in zip(items, got))


@pytest.mark.parametrize("setting", ["1", "0"])
def test_an_item_dropped_by_the_caller_is_freed_at_once(setting, monkeypatch):
    """Once the caller drops an item, nothing keeps it: not the generator's suspended frame (0.66 GiB at 7B)."""
    import weakref

    monkeypatch.setenv(ENV, setting)
    alive = []
    items = read_ahead(lambda k: {"x": torch.full((8,), float(k))}, range(4))
    for _ in range(4):  # not zip() or enumerate(): their reused result tuple would hold the item
        item = next(items)
        ref = weakref.ref(item["x"])
        del item
        alive.append(ref() is not None)  # still inside step i: the generator has not been resumed yet
    assert alive == [False] * 4


def test_read_on_a_thread_at_most_one_item_ahead(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    where: list[str] = []

    def read(i):
        where.append(threading.current_thread().name)
        time.sleep(0.01)
        with lock:
            log.append(("read", i))
        return i

    for i in read_ahead(read, range(6)):
        time.sleep(0.03)  # the caller's work: the reader runs ahead meanwhile, but only by one item
        with lock:
            ahead = max(j for what, j in log if what == "read") - i
            log.append(("used", i))
        assert ahead <= 1
    assert set(where) == {"symalign-prefetch"}
    reads_before_use = [j for what, j in log if what == "read"]
    assert reads_before_use == list(range(6))
    # the overlap happened: item i + 1 was read before item i was finished with
    assert any(log.index(("read", i + 1)) < log.index(("used", i)) for i in range(5))


def test_off_reads_on_the_calling_thread_when_asked(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert not enabled()
    where, order = [], []

    def read(i):
        where.append(threading.current_thread().name)
        order.append(("read", i))
        return i

    for i in read_ahead(read, range(3)):
        order.append(("used", i))
    assert set(where) == {threading.current_thread().name}
    assert order == [("read", 0), ("used", 0), ("read", 1), ("used", 1), ("read", 2), ("used", 2)]


def test_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ConfigError, match=ENV):
        enabled()


def test_an_exception_on_the_thread_is_raised_at_its_item(monkeypatch):
    monkeypatch.setenv(ENV, "1")

    def read(i):
        if i == 3:
            raise CheckpointError("shard 3 is truncated")
        return i

    got = []
    with pytest.raises(CheckpointError, match="shard 3"):
        for i in read_ahead(read, range(6)):
            got.append(i)
    assert got == [0, 1, 2]


@pytest.mark.parametrize("how", ["break", "raise", "close"])
def test_the_thread_stops_when_the_caller_stops(how, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    reads = []

    def read(i):
        reads.append(i)
        return i

    def loop():
        for i in read_ahead(read, range(100)):
            if i == 2:
                if how == "break":
                    break
                raise ValueError("the caller failed")

    if how == "close":
        gen = read_ahead(read, range(100))
        assert next(gen) == 0
        gen.close()
    elif how == "raise":
        with pytest.raises(ValueError):
            loop()
    else:
        loop()
    assert max(reads) <= 3  # nothing read past the item after the last one used


def test_timer_wraps_each_wait(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    import contextlib

    n = []

    @contextlib.contextmanager
    def timer():
        n.append(1)
        yield

    assert list(read_ahead(lambda i: i, range(4), timer=timer)) == [0, 1, 2, 3] and len(n) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pins_and_moves_on_a_side_stream(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    read = lambda i: {"w": torch.full((256, 256), float(i))}  # noqa: E731
    for i, v in enumerate(read_ahead(read, range(4), "cuda:0")):
        assert v["w"].is_pinned() and torch.equal(v["w"], read(i)["w"])
    for i, v in enumerate(read_ahead(read, range(4), "cuda:0", to_device=True)):
        assert v["w"].device.type == "cuda" and torch.equal(v["w"].cpu(), read(i)["w"])


# -- the streamed engines ---------------------------------------------------------------------------------------------

def _pair(tmp, layers=3):
    from hf_tiny import make_model

    for name, seed in (("A", 0), ("B", 1)):
        make_model("llama", dtype=torch.float32, seed=seed, n_layers=layers).save_pretrained(tmp / name,
                                                                                            max_shard_size="20KB")
    return tmp / "A", tmp / "B"


def _bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != "symalign.json"}


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_streamed_out_is_bit_identical_with_prefetch_on_and_off(scope, tmp_path, monkeypatch, capsys):
    from _cli_util import run_symalign

    a, b = _pair(tmp_path)
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(ENV, setting)
        out = tmp_path / f"O{setting}"
        code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out, "--stream", "--scope", scope,
                                    "--max-sweeps", "2")
        assert code == 0, err
        outs[setting] = _bytes(out)
    assert outs["1"] == outs["0"] and any(k.endswith(".safetensors") for k in outs["1"])


@pytest.mark.parametrize("scope", ["attention", "model"])
def test_a_read_failing_on_the_thread_stops_the_run_in_one_line(scope, tmp_path, monkeypatch, capsys):
    from _cli_util import run_symalign
    from symalign.io.tensors import ShardedTensors

    a, b = _pair(tmp_path)
    monkeypatch.setenv(ENV, "1")
    real = ShardedTensors.read
    seen = []

    def read(self, names, *args, **kwargs):
        names = list(names)
        if any(".layers.1." in n for n in names) and threading.current_thread().name == "symalign-prefetch":
            seen.append(1)
            raise CheckpointError(f"{self.path}: layer 1 cannot be read (test)")
        return real(self, names, *args, **kwargs)

    monkeypatch.setattr(ShardedTensors, "read", read)
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", tmp_path / "O", "--stream", "--scope",
                                scope, "--max-sweeps", "1")
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and "layer" in ln and "error" in ln]
    assert code == 2 and seen and len(lines) == 1 and "layer 1 cannot be read" in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "B"]  # nothing written


def test_with_a_gate_the_reader_waits_for_it(monkeypatch):
    from symalign.io.prefetch import Gate

    monkeypatch.setenv(ENV, "1")
    reads = []
    gate = Gate()

    def read(i):
        reads.append(i)
        return i

    for i in read_ahead(read, range(4), gate=gate):
        time.sleep(0.05)
        assert max(reads) == i  # not read ahead before the gate opens
        if i < 2:
            gate.open()
            deadline = time.time() + 2
            while max(reads) == i and time.time() < deadline:
                time.sleep(0.005)
            assert max(reads) == i + 1  # read ahead once it has
    assert reads == [0, 1, 2, 3]


def test_by_default_on_for_cuda_only(monkeypatch):
    """Unset, read-ahead is on where the reads feed a CUDA device and off on the CPU (no gain measured there)."""
    monkeypatch.delenv(ENV, raising=False)
    assert not enabled() and not enabled("cpu") and not enabled(torch.device("cpu"))
    assert enabled("cuda") and enabled(torch.device("cuda", 1))
    monkeypatch.setenv(ENV, "1")
    assert enabled() and enabled("cpu")
    monkeypatch.setenv(ENV, "0")
    assert not enabled("cuda")
