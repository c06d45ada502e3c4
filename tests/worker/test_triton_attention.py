"""The Triton paged-attention kernels (services/worker/triton_attention.py: query rows, split
or not; triton_tiles.py: prompt chunks in tiles) against PyTorch's SDPA path over the same
paged cache: decodes, chunks, grouped heads, sliding windows.

Without a GPU they run in Triton's interpreter (CI; tests/conftest.py sets TRITON_INTERPRET
before anything imports Triton); with one (marked gpu) compiled, in half precision too. The
whole eager CUDA backend (its row and tile tables, or SDPA where the tile kernel cannot run)
and the decode-graph path also run here on the CPU through the interpreter, greedy-equal to
transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.worker import kernel_checks, runtime, triton_attention, triton_tiles
from services.worker.cuda_graphs import TRITON, CudaPaged
from services.worker.kv_cache import CacheShape, PagedKVCache
from services.worker.loader import load_model
from services.worker.paged_attention import (
    METADATA_KWARG,
    AttentionMetadata,
    paged_attention_forward,
)
from services.worker.row_tables import ROW_QUERIES, row_tables
from tests.support.engine_loop import EngineLoop, make_request
from tests.support.reference import greedy_continuation, reference_model

BLOCK = 16
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 24  # a head_dim that is no power of two
NUM_HEADS = NUM_KV_HEADS * GROUP

# (q_len, context_len, block ids): decodes within, across and at the end of a block, a chunk
# of 5 queries after 30 cached tokens, a one-token prompt; scattered blocks, some ahead; a
# chunk of 40 queries after 30 cached tokens and a whole 33-token prompt (three and three
# tiles of TILE_M queries, the last ones partial)
BATCH = [
    (1, 37, [6, 1, 9, 4]),
    (5, 35, [2, 7, 3]),
    (1, 1, [10]),
    (1, 32, [0, 5]),
    (1, 70, [11, 8, 12, 13, 14]),
    (40, 70, [19, 15, 18, 16, 17]),
    (33, 33, [22, 20, 21]),
]
TILE_M = 16  # the tile kernel's queries per tile here (TILE_QUERIES serves; 16 cuts more)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny Llama with one decoder layer: each interpreted kernel call costs seconds on a
    CPU, and a second layer would only run the same kernels again."""
    from tests.support.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-1-layer"), num_layers=1)


def kernel_and_sdpa(dtype: torch.dtype, device: torch.device, window: int | None):
    """One layer's attention output of BATCH through SDPA, through the row kernel alone (every
    query a row) and through both kernels (chunks of more than ROW_QUERIES as tiles)."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(CacheShape(1, NUM_KV_HEADS, HEAD_DIM, dtype), 24, BLOCK, device)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    query_start, context_lens, new_slots, context_slots = [0], [], [], []
    for q_len, context_len, blocks in BATCH:
        slots = cache.slots(blocks, context_len)
        new_slots.append(slots[context_len - q_len :])
        context_slots.append(slots.to(device))
        context_lens.append(context_len)
        query_start.append(query_start[-1] + q_len)
    batch = SimpleNamespace(
        query_start=query_start,
        context_lens=context_lens,
        block_tables=[blocks for *_, blocks in BATCH],
    )
    everything = list(range(len(BATCH)))
    short = [i for i, (q_len, *_) in enumerate(BATCH) if q_len <= ROW_QUERIES]
    long = [i for i in everything if i not in short]
    num_tokens = query_start[-1]
    query = torch.randn(1, NUM_HEADS, num_tokens, HEAD_DIM, generator=gen).to(device, dtype)
    key = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM, generator=gen).to(device, dtype)
    value = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM, generator=gen).to(device, dtype)
    layer = type("Layer", (), {"layer_idx": 0})()
    outputs = []
    for tables in (None, (everything, []), (short, long)):
        meta = AttentionMetadata(
            kv_cache=cache,
            slot_mapping=torch.cat(new_slots).to(device),
            query_start=query_start,
            context_lens=context_lens,
            context_slots=context_slots,
            prefill_indices=None if tables is None else [],
            rows=None if tables is None else row_tables(batch, *tables, BLOCK, device, TILE_M),
        )
        if tables is not None and tables[1]:
            meta.rows.splits = 4  # the rows beside the tiles: each one's keys in 4 ranges
        kwargs = {"scaling": 0.3, "sliding_window": window, METADATA_KWARG: meta}
        out, _ = paged_attention_forward(layer, query, key, value, None, **kwargs)
        outputs.append(out[0].float())  # [num_tokens, num_heads, head_dim]
    assert outputs[2] is not None and meta.rows is not None and meta.rows.tiles is not None
    assert meta.rows.tiles.start.shape[0] == 3 + 3  # the tiles were taken
    return outputs


@pytest.mark.parametrize("window", [None, 20])
def test_kernels_match_sdpa(window):
    """Rows alone (120 rows: one key range each), and rows with tiles (the 9 rows beside the
    tiles split their keys in 4 ranges, some empty at these lengths, merged after; on a GPU
    the launch would pick 4 too)."""
    assert triton_attention.num_splits(9, NUM_HEADS) == 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sdpa, rows, tiles = kernel_and_sdpa(torch.float32, device, window)
    assert torch.allclose(rows, sdpa, atol=1e-5), (rows - sdpa).abs().max()
    assert torch.allclose(tiles, sdpa, atol=1e-5), (tiles - sdpa).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)], ids=["fp16", "bf16"]
)
def test_kernels_match_sdpa_in_half_precision_on_cuda(window, dtype, tolerance):
    sdpa, rows, tiles = kernel_and_sdpa(dtype, torch.device("cuda"), window)
    assert torch.allclose(rows, sdpa, atol=tolerance), (rows - sdpa).abs().max()
    assert torch.allclose(tiles, sdpa, atol=tolerance), (tiles - sdpa).abs().max()


def test_num_splits():
    """Ranges enough for ~TARGET_PROGRAMS programs, in powers of two up to MAX_SPLITS."""
    assert triton_attention.num_splits(1, 32) == 8  # a batch-1 decode of a 32-head model
    assert triton_attention.num_splits(1, 9) == 16  # 144 programs
    assert triton_attention.num_splits(1, 2) == triton_attention.MAX_SPLITS
    assert triton_attention.num_splits(4, 32) == 2
    assert triton_attention.num_splits(8, 32) == 1
    assert triton_attention.num_splits(256, 32) == 1


@pytest.mark.parametrize("num_decodes", [0, 1, 2, 3, 5, 31])
@pytest.mark.parametrize("chunks", [[], [17], [128], [40, 70, 3]])
def test_every_table_starts_on_16_bytes(num_decodes, chunks):
    """Whatever the step's row and tile counts, each table the kernels take starts on a 16-byte
    boundary: Triton builds a kernel again for each new alignment of a pointer argument, so a
    step whose tables sat otherwise stalled on a build."""
    q_lens = [1] * num_decodes + chunks
    if not q_lens:
        return
    query_start = [0]
    for q_len in q_lens:
        query_start.append(query_start[-1] + q_len)
    batch = SimpleNamespace(
        query_start=query_start,
        context_lens=[q_len + 7 for q_len in q_lens],
        block_tables=[
            list(range(i, i + (q_len + 7 + BLOCK - 1) // BLOCK)) for i, q_len in enumerate(q_lens)
        ],
    )
    short = [i for i, q_len in enumerate(q_lens) if q_len <= ROW_QUERIES]
    long = [i for i, q_len in enumerate(q_lens) if q_len > ROW_QUERIES]
    tables = row_tables(batch, short, long, BLOCK, torch.device("cpu"), TILE_M)
    tensors = [tables.rows, tables.row_request, tables.row_lens, tables.block_tables]
    if tables.tiles is not None:
        tiles = tables.tiles
        tensors += [tiles.start, tiles.rows, tiles.request, tiles.lens]
    assert (tables.tiles is not None) == bool(long)
    assert all(tensor.data_ptr() % 16 == 0 for tensor in tensors)
    assert tables.rows.tolist() == [
        token for i in short for token in range(query_start[i], query_start[i + 1])
    ]
    assert tables.block_tables.shape[0] == len(q_lens)


def test_the_kernel_checks_see_a_wrong_kernel(monkeypatch, caplog):
    """tiles_agree and splits_agree pass the kernels as they are, and fail kernels that leave
    their output unwritten or that raise."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernel_checks.tiles_agree(device, torch.float32, HEAD_DIM, GROUP)
    assert kernel_checks.splits_agree(device, torch.float32, HEAD_DIM, GROUP)

    def broken(*args, **kwargs):
        raise RuntimeError("no tl.dot on this build")

    monkeypatch.setattr(triton_tiles, "attend_tiles", lambda *args: None)
    monkeypatch.setattr(triton_attention, "attend_rows", broken)
    with caplog.at_level("WARNING", logger=kernel_checks.__name__):
        assert not kernel_checks.tiles_agree(device, torch.float32, HEAD_DIM, GROUP)
        assert not kernel_checks.splits_agree(device, torch.float32, HEAD_DIM, GROUP)
    assert "tile kernel is off by" in caplog.text
    assert "split decode rows cannot run here" in caplog.text


@pytest.mark.parametrize("tiles_run", [True, False], ids=["tiles", "no-tile-kernel"])
def test_eager_cuda_backend_on_the_cpu_matches_transformers(
    tiny_llama, monkeypatch, caplog, tiles_run
):
    """CudaPaged without graphs, its kernels interpreted: decodes and chunks of at most 16
    queries through the rows, longer chunks as tiles, in one busy batch; where the tile kernel
    cannot run (its check at the first longer chunk raises), those chunks go to SDPA."""
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the GPU backend; on a GPU, tests/worker/test_cuda_path.py")
    if not tiles_run:

        def broken(*args, **kwargs):
            raise RuntimeError("no tl.dot on this build")

        monkeypatch.setattr(triton_tiles, "attend_tiles", broken)
    loaded = load_model(str(tiny_llama), device="cpu", cpu_kernels=False)
    backends: list[CudaPaged] = []

    def cuda_backend(loaded, fake_step_ms=None, cuda_graphs=None, compile=True):
        backends.append(CudaPaged(loaded.model, loaded.device, []))
        return backends[-1]

    monkeypatch.setattr(runtime, "pick_backend", cuda_backend)
    engine = EngineLoop(loaded, num_blocks=64, max_batch_prefill_tokens=40)
    assert engine.runner.attention == TRITON
    gen = torch.Generator().manual_seed(5)
    # the fallback's run is shorter: it only has to show SDPA taking the longer chunks
    lengths, new_tokens = ([3, 50, 12, 30], 3) if tiles_run else ([12, 30], 2)
    requests = [
        make_request(
            [1] + torch.randint(3, 300, (n,), generator=gen).tolist(), max_new_tokens=new_tokens
        )
        for n in lengths
    ]
    for request in requests:
        engine.add(request)
    with caplog.at_level("WARNING", logger=kernel_checks.__name__):
        engine.run()
    reference = reference_model(tiny_llama)
    for request in requests:
        expected = greedy_continuation(
            reference, request.input_ids, new_tokens, loaded.eos_token_ids
        )
        assert engine.tokens[request.request_id] == expected
    assert engine.scheduler.counters.num_prefill_chunks > 0
    assert max(engine.step_sizes) > 1
    # chunks of 17 to 40 queries went to the tile kernel, or to SDPA with a warning
    assert backends[0].tiles is tiles_run
    assert (backends[0].tiled_chunks > 0) is tiles_run
    assert ("prompt chunks go to SDPA" in caplog.text) is not tiles_run


class EagerReplay:
    """A captured graph's stand-in on the CPU: a replay runs the captured step function again
    into the same logits tensor (the static buffers, padding rows and spare block are real)."""

    def __init__(self, run, logits: torch.Tensor) -> None:
        self.run, self.logits, self.replays = run, logits, 0

    def replay(self) -> None:
        with torch.inference_mode():
            self.logits.copy_(self.run())
        self.replays += 1


def graphs_on_the_cpu(
    tiny_llama, monkeypatch, sizes, compile=False, compiler="aot_eager", num_blocks=40, **engine
):
    """CudaPaged on the CPU (its kernel interpreted) serving an engine (`num_blocks`, the
    `engine` keywords), with the static buffers of graphs of `sizes` over the engine's cache and
    torch.compile's `compiler` (aot_eager: the CPU's inductor is slow to build; dynamo's tracing
    is what these tests check); the tile kernel taken as checked (a GPU checks it at start), so
    mixed-step graphs get their buffers too. (loaded, backend, engine)"""
    loaded = load_model(str(tiny_llama), device="cpu", cpu_kernels=False)
    backend = CudaPaged(loaded.model, loaded.device, sizes, compile=compile)
    backend.compiler = compiler
    backend.tiles = True
    monkeypatch.setattr(runtime, "pick_backend", lambda *args, **kwargs: backend)
    engine = EngineLoop(loaded, num_blocks=num_blocks, **engine)
    backend.allocate_static(engine.runner.kv_cache, loaded.max_model_len)
    return loaded, backend, engine


def compiled_step(backend: CudaPaged, cache: PagedKVCache, compile: bool) -> int:
    """The unique graphs dynamo had before `backend` compiled its eager step (`compile`)."""
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    if compile:
        with torch.inference_mode():
            backend.compile_step(cache)
        assert backend.compile
    return before


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_graph_steps_on_the_cpu_match_transformers(tiny_llama, monkeypatch, compile):
    """The decode-graph path (static buffers, padding rows on the spare block, the smallest
    graph that fits) with each replay run eagerly: 5 and then fewer requests in graphs of 2, 4
    and 8 rows, greedy-equal to transformers; as is, and traced by torch.compile (its graph
    run by aot_eager here, the CPU's inductor being slow to build: the tracing of
    transformers' modules around the attention operator is what is checked; inductor's
    kernels are checked on a GPU, tests/worker/test_cuda_path.py)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the graph path; on a GPU, tests/worker/test_cuda_path.py")
    loaded, backend, engine = graphs_on_the_cpu(tiny_llama, monkeypatch, [2, 4, 8], compile)
    backend.mixed = None  # decode graphs alone: prompts run eagerly
    cache = engine.runner.kv_cache
    assert cache.keys[0].shape[0] == 41 * 16  # the spare block
    before = compiled_step(backend, cache, compile)
    stats = torch._dynamo.utils.counters["stats"]
    # eager steps and graphs of 2+ share one
    assert stats["unique_graphs"] == before + (1 if compile else 0)
    compiled_graphs = dict(stats)
    vocab = loaded.model.config.vocab_size
    for size in backend.sizes:
        logits = torch.zeros(size, vocab)
        backend.graphs[size] = (EagerReplay(backend.step_function(cache, size), logits), logits)
    gen = torch.Generator().manual_seed(11)
    requests = [
        make_request(
            [1] + torch.randint(3, 300, (n,), generator=gen).tolist(), max_new_tokens=2 + i // 2
        )
        for i, n in enumerate([5, 20, 9, 33, 14])
    ]
    for request in requests:
        engine.add(request)
    engine.run()
    reference = reference_model(tiny_llama)
    for request in requests:
        expected = greedy_continuation(
            reference, request.input_ids, request.stopping.max_new_tokens, loaded.eos_token_ids
        )
        assert engine.tokens[request.request_id] == expected
    replays = {size: graph.replays for size, (graph, _) in backend.graphs.items()}
    assert replays[8] > 0 and replays[4] > 0  # 5 decodes, then 4 or 3 as requests end
    assert backend.graph_steps == sum(replays.values())
    # prompts ran compiled too, and no step compiled anew (on a GPU that would stall serving)
    assert (backend.compiled_steps > 0) == compile
    assert dict(torch._dynamo.utils.counters["stats"]) == compiled_graphs
    assert int(backend.static["slot_mapping"][7]) == 40 * 16  # a padding row: the spare block


def test_cuda_graph_sizes():
    from services.worker.cuda_graphs import default_sizes
    from shared.settings import Settings, parse_cuda_graphs

    assert default_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and default_sizes(256)[-1] == 256
    assert default_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_sizes(3) == [1, 2, 3]
    assert parse_cuda_graphs("8,1,2,2") == [1, 2, 8]
    assert parse_cuda_graphs("0") == [] and parse_cuda_graphs(None) is None
    for bad in ("1,x", "-2", ","):
        with pytest.raises(ValueError, match="cuda_graphs must be"):
            parse_cuda_graphs(bad)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        Settings(cuda_graphs="4,-1")


def test_a_failing_compiler_leaves_the_graphs_eager(tiny_llama, monkeypatch, caplog):
    """torch.compile failing (here its backend raises) is logged, and the graphs then hold the
    eager modules: the worker still serves."""

    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here")

    loaded, backend, engine = graphs_on_the_cpu(tiny_llama, monkeypatch, [1, 4], True, broken)
    cache = engine.runner.kv_cache
    with torch.inference_mode():
        backend.compile_step(cache)
        assert not backend.compile
        logits = backend.step_function(cache, 4)()  # the eager modules
    assert logits.shape == (4, loaded.model.config.vocab_size)
    assert "torch.compile failed, decode graphs hold the eager modules" in caplog.text
    assert "no compiler here" in caplog.text


def test_graphs_smaller_than_the_compiled_eager_step_compile(tiny_llama, monkeypatch):
    """--cuda-graphs 1,2: the eager step compile_step compiles (3 tokens) still fits the
    static tables, so compiling succeeds (dynamo tracing, aot_eager running it)."""
    _, backend, engine = graphs_on_the_cpu(tiny_llama, monkeypatch, [1, 2], compile=True)
    with torch.inference_mode():
        backend.compile_step(engine.runner.kv_cache)
    assert backend.compile


@pytest.mark.parametrize(
    ("compile", "prompt_lens"),
    [(False, (3, 50, 12, 30, 20)), (True, (3, 50))],
    ids=["eager", "compiled"],
)
def test_mixed_steps_replay_token_bucket_graphs_on_the_cpu(
    tiny_llama, monkeypatch, compile, prompt_lens
):
    """Steps with prompt chunks (decodes beside them) replay the graph of the smallest token
    bucket that holds them, each replay run eagerly here over the static buffers: padded rows
    and tiles the kernels skip, padding tokens on the spare block. Greedy-equal to
    transformers, and no step of the busy batch ran eagerly; traced by torch.compile (aot_eager
    here), the buckets' shapes compile nothing beyond the one eager-step graph. Compiled, two
    requests: a chunk of the 50-token prompt beside the 3-token one (the 48-token bucket), then
    its rest beside a decode (the 24-token one); each interpreted step costs seconds."""
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the graph path; on a GPU, tests/worker/test_cuda_path.py")
    from services.worker.mixed_graphs import MixedGraphs

    loaded, backend, engine = graphs_on_the_cpu(
        tiny_llama, monkeypatch, [2, 4, 8], compile, num_blocks=64, max_batch_prefill_tokens=40
    )
    cache = engine.runner.kv_cache
    compiled_step(backend, cache, compile)
    stats = torch._dynamo.utils.counters["stats"]
    compiled = stats["unique_graphs"]  # (a graph an earlier test compiled serves here too)
    assert backend.mixed is not None and max(backend.mixed.graphs) == 2048  # the defaults
    # small buckets: every interpreted kernel program costs milliseconds here
    mixed = MixedGraphs(
        cache, backend.static["block_tables"], backend.spare_slot, 8, None, (24, 48)
    )
    backend.mixed = mixed
    stand_ins: list[EagerReplay] = []

    def record(run):  # as CudaPaged.capture runs it: under inference mode
        with torch.inference_mode():
            logits = run().clone()
        stand_ins.append(EagerReplay(run, logits))
        return stand_ins[-1], logits

    for size in backend.sizes:
        backend.graphs[size] = record(backend.step_function(cache, size))
    mixed.capture(backend.run_model, record)
    assert [graph.kept for graph in mixed.graphs.values()] == [8, 8]
    # one graph for steps of 2+ tokens: the eager step's, the decode graphs' and the buckets'
    assert stats["unique_graphs"] == compiled
    eager = []
    metadata = backend.metadata
    monkeypatch.setattr(backend, "metadata", lambda *args: eager.append(1) or metadata(*args))
    gen = torch.Generator().manual_seed(7)
    requests = [
        make_request([1] + torch.randint(3, 300, (n,), generator=gen).tolist(), max_new_tokens=3)
        for n in prompt_lens
    ]
    for request in requests:
        engine.add(request)
    engine.run()
    reference = reference_model(tiny_llama)
    for request in requests:
        expected = greedy_continuation(reference, request.input_ids, 3, loaded.eos_token_ids)
        assert engine.tokens[request.request_id] == expected
    assert engine.scheduler.counters.num_prefill_chunks > 0
    assert backend.mixed_graph_steps > 0 and backend.tiled_chunks > 0
    assert not eager  # every step held by a graph: decode or mixed
    replayed = {graph.tokens: graph.graph.replays for graph in mixed.graphs.values()}
    assert sum(replayed.values()) == backend.mixed_graph_steps
    assert all(replayed.values())  # both buckets
    assert backend.graph_steps > 0  # the decodes after the last chunk
    assert int(mixed.slots[-1]) == backend.spare_slot  # padding tokens write the spare block
    assert stats["unique_graphs"] == compiled  # no step compiled anew


def test_which_steps_a_mixed_graph_takes(tiny_llama):
    """The smallest bucket of more tokens than the step with room for its kept rows; none for
    prompt logprobs, too many tokens or too many kept rows, or before its capture."""
    from services.worker.mixed_graphs import MixedGraphs

    cache = PagedKVCache(CacheShape(1, NUM_KV_HEADS, HEAD_DIM, torch.float32), 8, BLOCK, "cpu")
    tables = torch.zeros(4, 8, dtype=torch.int32)
    mixed = MixedGraphs(cache, tables, 8 * BLOCK, 4, None, (32, 64))
    assert [(graph.tokens, graph.kept) for graph in mixed.graphs.values()] == [(32, 4), (64, 4)]

    def step(num_tokens, num_requests=2, prompt_rows=()):
        return SimpleNamespace(
            input_ids=torch.zeros(1, num_tokens, dtype=torch.long),
            states=[None] * num_requests,
            prompt_rows=list(prompt_rows),
        )

    assert mixed.pick(step(20), [0, 1]) is None  # not captured yet
    for graph in mixed.graphs.values():
        graph.graph = object()
    assert mixed.pick(step(20), [0, 1]).tokens == 32
    assert mixed.pick(step(32), [0, 1]).tokens == 64  # a padding token always
    assert mixed.pick(step(64), [0, 1]) is None
    assert mixed.pick(step(20), [0, 1, 2, 3, 4]) is None  # 5 kept rows: the buckets keep 4
    assert mixed.pick(step(20, num_requests=5), [0]) is None  # the block tables hold 4
    assert mixed.pick(step(20, prompt_rows=[3]), [0, 1]) is None
