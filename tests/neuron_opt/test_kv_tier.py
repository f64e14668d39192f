"""The second KV tier on its own (runtime/kv_tier.py): blocks copied out of and back into real pools byte for byte,
its size limit and LRU order, damaged entries refused, and the layouts it refuses. The engine-level checks (a
returning turn restored, tokens unchanged, prefill skipped) are in test_engine_blocks.py."""

from __future__ import annotations

import time

import pytest
import torch

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.kv_tier import WINDOW, HostBlocks, KVTier, group_blocks
from neuron_opt.runtime.scheduler import KVConfig, Scheduler

LAYERS, BLOCKS, SHAPE = 3, 12, (2, 4, 8)  # per block: [n_kv, block positions, D]


def pools(dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    make = [torch.randn((BLOCKS, *SHAPE), generator=g).to(dtype) for _ in range(2 * LAYERS)]
    return make[:LAYERS], make[LAYERS:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_block_comes_back_byte_for_byte_in_every_layer(dtype):
    k, v = pools(dtype)
    tier = KVTier(HostBlocks(k, v), 1 << 20)
    assert tier.block_bytes == 2 * LAYERS * 2 * 4 * 8 * k[0].element_size()
    before = [c[5].clone() for c in (*k, *v)]
    tier.store(b"a", 5)
    for c in (*k, *v):
        c[5].view(torch.uint8).fill_(0)  # the block's new owner overwrites it
    assert tier.load([b"a"], [9]) == 1
    for c, want in zip((*k, *v), before, strict=True):
        assert torch.equal(c[9].view(torch.uint8), want.view(torch.uint8))


def test_the_size_limit_holds_and_the_least_recently_used_go_first():
    k, v = pools(torch.float32)
    one = KVTier(HostBlocks(k, v), 1 << 20).block_bytes
    tier = KVTier(HostBlocks(k, v), 3 * one + one // 2)  # room for 3 blocks
    for i in range(1, 5):
        tier.store(bytes([i]), i)
        assert tier.num_bytes <= tier.max_bytes
    assert list(tier.entries) == [b"\x02", b"\x03", b"\x04"] and tier.stats.evicted == 1
    assert tier.load([b"\x02"], [10]) == 1  # a restore marks it used: 3 is now the oldest
    tier.store(b"\x02", 7)  # a key it holds: kept once, marked used
    tier.store(b"\x05", 5)
    assert list(tier.entries) == [b"\x04", b"\x02", b"\x05"] and tier.stats.stored == 5
    assert tier.load([b"\x04", b"\x03", b"\x05"], [1, 2, 3]) == 1  # stops at the first missing key


def test_a_damaged_entry_is_dropped_and_ends_the_run():
    k, v = pools(torch.float32)
    tier = KVTier(HostBlocks(k, v), 1 << 20)
    for i in range(1, 4):
        tier.store(bytes([i]), i)
    assert tier.load([b"\x01"], [10]) == 1  # hashed now if the digest thread has not reached it
    for _ in range(1000):  # the digest thread hashes entries off the engine thread
        if tier.entries[b"\x02"].digest is not None:
            break
        time.sleep(0.01)
    tier.entries[b"\x02"].data[0] ^= 1
    target = k[0][11].clone()
    assert tier.load([b"\x01", b"\x02", b"\x03"], [10, 11, 9]) == 1
    assert b"\x02" not in tier and tier.stats.corrupt == 1 and torch.equal(k[0][11], target)  # nothing written


class Pools:  # an executor's pools of host tensors (k_caches, v_caches as the eager and cpu backends hold them)
    def __init__(self) -> None:
        self.k_caches, self.v_caches = pools(torch.float32)


def test_an_executors_own_copier_copies_each_window_kv_group_apart():
    """Window-sized KV over an executor with a copier of its own (the neuron backend's device pools,
    `tier_blocks(layers)`): each group is that copier over its layers, and a block of one group comes back without
    touching the other's pools."""

    class OwnCopier(Pools):
        def tier_blocks(self, layers):
            return HostBlocks([self.k_caches[i] for i in layers], [self.v_caches[i] for i in layers])

    ex = OwnCopier()
    full, window = group_blocks(ex, [1])
    assert full.caches == (ex.k_caches[0], ex.k_caches[2], ex.v_caches[0], ex.v_caches[2])
    assert window.caches == (ex.k_caches[1], ex.v_caches[1])
    tier = KVTier(full, 1 << 20, window_pools=window)
    before = [c.clone() for c in (*ex.k_caches, *ex.v_caches)]
    tier.store(b"a", 4, WINDOW)
    ex.k_caches[1][4].fill_(0)
    assert tier.load([b"a"], [7], WINDOW) == 1 and not tier.holds(b"a")
    after = [c.clone() for c in (*ex.k_caches, *ex.v_caches)]
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if i in (1, 1 + LAYERS):  # the window layer's K and V: block 7 is block 4's bytes
            assert torch.equal(a[7], b[4]) and torch.equal(a[:4], b[:4])
        else:
            assert torch.equal(a, b)


def test_layouts_the_tier_cannot_hold_are_refused():
    k, v = pools(torch.float32)
    with pytest.raises(ConfigError, match="hold no block"):
        KVTier(HostBlocks(k, v), 100)
    with pytest.raises(ConfigError, match="keeps its KV elsewhere"):
        HostBlocks([], [])  # rank processes hold the pools
    tier = KVTier(HostBlocks(k, v), 1 << 20)
    with pytest.raises(ConfigError, match="window-sized KV.*needs both groups' pools"):
        Scheduler(2, KVConfig(16, 4, 32, 32, sliding_window=8, window_num_blocks=8), tier=tier)
    two = KVTier(HostBlocks(k[:1], v[:1]), 1 << 20, window_pools=HostBlocks(k[1:], v[1:]))
    with pytest.raises(ConfigError, match="holds a window group, which this model's pool does not have"):
        Scheduler(2, KVConfig(16, 4, 32, 32), tier=two)
    with pytest.raises(ValueError, match="not some, and not all"):
        group_blocks(Pools(), [0, 1, 2])
    with pytest.raises(ValueError, match="not some, and not all"):
        group_blocks(Pools(), [3])
    with pytest.raises(ConfigError, match="turn prefix caching on"):
        Scheduler(2, KVConfig(16, 4, 32, 32, enable_prefix_caching=False), tier=tier)


def test_serve_flag_builds_the_tier_and_metrics_count_its_hits(tiny_dir, tmp_path):
    """`serve --kv-offloading-size GIB` (and a disk level) gives the engine a tier of that size over its pools; a
    prompt whose blocks were evicted into it comes back from it, and /metrics' vLLM external prefix cache counters
    and our per-level ones say so."""
    from neuron_opt.cli import build_parser
    from neuron_opt.commands.serve_engine import build_engine
    from neuron_opt.runtime.kv_tier import GIB
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.server.app import engine_metrics

    def args(*extra: str):
        return build_parser().parse_args(["serve", "--model", str(tiny_dir("smollm-tok")), "--max-num-seqs", "1",
                                          "--max-model-len", "64", *extra])

    for bad, message in ((["--kv-offloading-size", "0"], "must be > 0 GiB"),
                         (["--kv-offloading-size", "nan"], "must be > 0 GiB"),
                         (["--kv-offloading-size", "1", "--kv-offloading-disk-dir", "s3://bucket/kv",
                           "--kv-offloading-disk-size", "1"], "is not an existing local directory"),
                         (["--kv-offloading-disk-dir", str(tmp_path)], "go together"),
                         (["--kv-offloading-disk-dir", str(tmp_path), "--kv-offloading-disk-size", "1"],
                          "give --kv-offloading-size too")):
        with pytest.raises(ConfigError, match=message):  # refused before the model loads
            build_engine(args(*bad))
    engine = build_engine(args("--kv-offloading-size", "0.001", "--kv-offloading-disk-dir", str(tmp_path),
                               "--kv-offloading-disk-size", "0.002"))
    tier = engine.kv_tier
    assert tier is not None and tier.max_bytes == int(0.001 * GIB) and tier.disk.max_bytes == int(0.002 * GIB)
    assert tier.disk.path.parent == tmp_path
    bs, usable = engine.runner.cache.block_size, engine.runner.cache.num_blocks - 1
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def serve_one(rid: str, prompt: list[int]) -> None:
        engine.add_request(rid, prompt, sp, lambda o: None)
        while engine.step():
            pass

    prompt = list(range(100, 100 + bs + 1))  # a full block and the token whose logits are computed
    serve_one("first", prompt)
    serve_one("filler", list(range(1000, 1000 + usable * bs - 1)))  # takes every block of the pool
    assert engine.scheduler.blocks.cached_prefix(prompt) == [] and tier.stats.stored == 1
    serve_one("again", prompt)
    text = engine_metrics(engine, "tiny", 64).render().decode()
    assert f'vllm:external_prefix_cache_hits_total{{model_name="tiny"}} {float(bs)}' in text
    assert 'neuron_opt:kv_offload_corrupt_blocks_total{model_name="tiny"} 0.0' in text
    assert 'neuron_opt:kv_offload_restored_blocks_total{model_name="tiny",tier="ram"} 1.0' in text
    assert 'neuron_opt:kv_offload_bytes{model_name="tiny",tier="disk"} 0.0' in text
    assert engine.prefix_cache_stats.hits == 0


def wait_written(tier: KVTier) -> None:
    for _ in range(1000):  # the background thread writes the disk level
        if not tier.disk.pending:
            return
        time.sleep(0.01)
    raise AssertionError("the disk level's writes did not finish")


def test_the_disk_level_takes_what_ram_evicts_within_its_limit_and_checks_it(tmp_path):
    k, v = pools(torch.float32)
    one = KVTier(HostBlocks(k, v), 1 << 20).block_bytes
    tier = KVTier(HostBlocks(k, v), 2 * one, disk_dir=tmp_path, disk_bytes=3 * (one + 16) + 5)  # RAM: 2 blocks, disk: 3
    saved = {i: [c[i].clone() for c in (*k, *v)] for i in range(1, 7)}
    for i in range(1, 7):
        tier.store(bytes([i]), i)
    wait_written(tier)
    assert list(tier.entries) == [b"\x05", b"\x06"] and list(tier.disk.index) == [b"\x02", b"\x03", b"\x04"]
    assert tier.stats.evicted == 1 and tier.disk_num_bytes <= tier.disk.max_bytes and b"\x01" not in tier
    assert tier.disk.path.parent == tmp_path and tier.disk.path.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in tier.disk.path.iterdir()) == ["02", "03", "04"]
    assert tier.load([b"\x02", b"\x05"], [10, 11]) == 2
    assert (tier.stats.restored_disk, tier.stats.restored_ram) == (1, 1)
    for c, want in zip((*k, *v), saved[2], strict=True):
        assert torch.equal(c[10], want)
    f = tier.disk.file(b"\x03")
    raw = bytearray(f.read_bytes())
    raw[40] ^= 1
    f.write_bytes(bytes(raw))
    assert tier.load([b"\x03"], [11]) == 0 and tier.stats.corrupt == 1 and not f.exists() and b"\x03" not in tier
    path = tier.disk.path
    del tier
    for _ in range(1000):  # the directory goes with the tier
        if not path.exists():
            break
        time.sleep(0.01)
    assert not path.exists()
