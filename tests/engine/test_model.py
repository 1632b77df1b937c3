"""The decoder: HF-equivalent maths, and bit-exact invariance to batching and chunking."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvoffload.engine import gemm
from kvoffload.engine.attention import AttentionMetadata
from kvoffload.engine.model import DecoderLM, build_model
from kvoffload.engine.model_config import ModelConfig
from kvoffload.engine.sampling import greedy
from kvoffload.transfer.layout import KVGeometry, KVLayout

SMALL = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
QWEN_LIKE = ModelConfig(
    vocab_size=300,
    hidden_size=96,
    intermediate_size=128,
    num_layers=2,
    num_heads=6,
    num_kv_heads=3,
    head_dim=16,
    attention_bias=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    architecture="Qwen2ForCausalLM",
)


@pytest.fixture(scope="module")
def default_model() -> DecoderLM:
    return build_model(ModelConfig(), seed=0)


@pytest.fixture(scope="module")
def small_model() -> DecoderLM:
    return build_model(SMALL, seed=1)


class PagedSim:
    """Drives a model step by step over a paged cache, like an engine's runner.

    Block ids come from a shuffled free list, so sequences are scattered
    through the cache; ``share_prefix`` and ``reload_prefix`` reproduce a GPU
    prefix hit and a CPU-tier round trip.
    """

    def __init__(
        self,
        model: DecoderLM,
        block_size: int = 16,
        num_blocks: int = 160,
        layout: str = "layer_first",
        seed: int = 0,
    ) -> None:
        cfg = model.config
        self.model = model
        self.bs = block_size
        geo = KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, cfg.dtype)
        self.layout = KVLayout(geo, layout)
        self.tensors = self.layout.allocate(num_blocks)
        self.kv = [self.layout.layer_kv(self.tensors, i) for i in range(cfg.num_layers)]
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}

    def add(self, sid: str, tokens: list[int]) -> None:
        self.tokens[sid] = list(tokens)
        self.computed[sid] = 0
        self.blocks[sid] = []

    def share_prefix(self, sid: str, donor: str, num_blocks: int) -> None:
        """``sid`` starts with ``donor``'s first full blocks (a GPU prefix-cache hit)."""
        assert self.computed[donor] >= num_blocks * self.bs
        self.blocks[sid] = self.blocks[donor][:num_blocks]
        self.computed[sid] = num_blocks * self.bs

    def reload_prefix(self, sid: str, donor: str, num_blocks: int) -> None:
        """Copy ``donor``'s first blocks out to host memory and back into fresh blocks."""
        host = [
            (k[self.blocks[donor][:num_blocks]].clone(), v[self.blocks[donor][:num_blocks]].clone())
            for k, v in self.kv
        ]
        fresh = [self.free.pop() for _ in range(num_blocks)]
        for (k, v), (hk, hv) in zip(self.kv, host):
            k[fresh] = hk
            v[fresh] = hv
        self.blocks[sid] = fresh
        self.computed[sid] = num_blocks * self.bs

    def step(
        self, work: list[tuple[str, int]], all_logits: bool = False
    ) -> dict[str, torch.Tensor]:
        """Compute the next ``n`` tokens of each ``(sid, n)``; logits of each item's last token
        (or of all its tokens with ``all_logits``)."""
        ids, positions, slots, starts, lens, tables = [], [], [], [0], [], []
        for sid, n in work:
            start = self.computed[sid]
            assert start + n <= len(self.tokens[sid])
            while len(self.blocks[sid]) * self.bs < start + n:
                self.blocks[sid].append(self.free.pop())
            table = self.blocks[sid]
            ids += self.tokens[sid][start : start + n]
            positions += range(start, start + n)
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(start, start + n)]
            starts.append(starts[-1] + n)
            lens.append(start + n)
            tables.append(list(table))
        meta = AttentionMetadata.build(starts, lens, tables, slots, self.bs)
        last = torch.tensor([s - 1 for s in starts[1:]])
        rows = torch.arange(starts[-1]) if all_logits else last
        with torch.inference_mode():
            logits = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv, rows)
        out = {}
        for i, (sid, n) in enumerate(work):
            self.computed[sid] += n
            out[sid] = logits[starts[i] : starts[i + 1]] if all_logits else logits[i]
        return out

    def cached_kv(self, sid: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sequence's K/V per layer, contiguous ``[L, H_kv, D]``."""
        n = self.computed[sid]
        out = []
        for k, v in self.kv:
            blocks = self.blocks[sid]
            kk = k[blocks].reshape(-1, *k.shape[2:])[:n]
            vv = v[blocks].reshape(-1, *v.shape[2:])[:n]
            out.append((kk.clone(), vv.clone()))
        return out


def reference_logits(model: DecoderLM, tokens: list[int]) -> torch.Tensor:
    """An independent contiguous forward pass written from HF's Llama/Qwen2 formulas."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    n, h, d = len(tokens), cfg.num_heads, cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [heads, n, d]
        # HF computes the rotary angles and their cos/sin in float32 for every dtype.
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos().double(), ang.sin().double()
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"])
        q = rope(lin(a, p + "self_attn.q_proj").view(n, h, d).transpose(0, 1))
        k = rope(lin(a, p + "self_attn.k_proj").view(n, -1, d).transpose(0, 1))
        v = lin(a, p + "self_attn.v_proj").view(n, -1, d).transpose(0, 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + lin(o.transpose(0, 1).reshape(n, h * d), p + "self_attn.o_proj")
        m = rms(x, sd[p + "post_attention_layernorm.weight"])
        act = F.silu(lin(m, p + "mlp.gate_proj")) * lin(m, p + "mlp.up_proj")
        x = x + lin(act, p + "mlp.down_proj")
    x = rms(x, sd["model.norm.weight"])
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return F.linear(x, head)


def prompt(n: int, vocab: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt + 3) % vocab for i in range(n)]


# -- config ---------------------------------------------------------------------


def test_default_config_is_a_few_million_parameters(default_model) -> None:
    cfg = ModelConfig()
    count = sum(p.numel() for p in default_model.parameters())
    assert count == cfg.num_parameters()
    assert 2_000_000 < count < 10_000_000
    assert cfg.torch_dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple of"),
        ({"head_dim": 33}, "even"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"dtype": "int8"}, "dtype"),
        ({"tie_word_embeddings": 1}, "bool"),
        ({"architecture": "GPT2LMHeadModel"}, "not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ],
)
def test_config_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_config_dtype_aliases_and_hashable() -> None:
    cfg = ModelConfig(dtype=torch.float64, rope_scaling={"type": "linear", "factor": 2.0})
    assert cfg.dtype == "float64"
    assert ModelConfig(dtype="bf16").dtype == "bfloat16"
    assert cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert hash(cfg) == hash(ModelConfig(dtype="fp64", rope_scaling=cfg.rope_scaling_dict))


LLAMA_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}
QWEN2_JSON = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_from_hf_config_llama() -> None:
    cfg = ModelConfig.from_hf_config(LLAMA_JSON)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 32, 8, 64)
    assert cfg.rope_theta == 500000.0 and cfg.max_position == 131072
    assert cfg.rope_scaling_dict is not None and cfg.rope_scaling_dict["rope_type"] == "llama3"
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.dtype == "float32"  # compute dtype, not the stored bfloat16
    assert ModelConfig.from_hf_config(LLAMA_JSON, dtype="bfloat16").dtype == "bfloat16"
    biased = ModelConfig.from_hf_config({**LLAMA_JSON, "attention_bias": True})
    assert biased.attention_bias and biased.o_proj_bias


def test_from_hf_config_qwen2() -> None:
    cfg = ModelConfig.from_hf_config(QWEN2_JSON)
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.head_dim == 64 and cfg.num_kv_heads == 2 and cfg.rope_theta == 1e6


def test_from_hf_config_transformers_v5_rope_parameters() -> None:
    v5 = {k: v for k, v in LLAMA_JSON.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA_JSON["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf_config(v5) == ModelConfig.from_hf_config(LLAMA_JSON)
    plain = {**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    cfg = ModelConfig.from_hf_config(plain)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
        ({"architectures": None, "model_type": "gpt2"}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"vocab_size": None}, "vocab_size"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ],
)
def test_from_hf_config_errors(change, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**QWEN2_JSON, **change})


@pytest.mark.parametrize("cfg", [ModelConfig(), QWEN_LIKE, ModelConfig(rope_scaling=None)])
def test_hf_config_round_trip(cfg) -> None:
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_from_hf_config_derives_head_dim_and_model_type() -> None:
    d = {k: v for k, v in LLAMA_JSON.items() if k != "architectures"}
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.head_dim == 2048 // 32


# -- weights ----------------------------------------------------------------------


def test_seeded_init_is_reproducible() -> None:
    a, b, c = build_model(SMALL, seed=5), build_model(SMALL, seed=5), build_model(SMALL, seed=6)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values()
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_tied_embeddings_share_the_tensor() -> None:
    m = build_model(QWEN_LIKE, seed=0)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.model.layers[0].self_attn.q_proj.bias is not None
    assert m.model.layers[0].self_attn.o_proj.bias is None


# -- maths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "atol"),
    [
        (ModelConfig(), 1e-4),
        (QWEN_LIKE, 1e-4),
        (ModelConfig(num_kv_heads=8, dtype="float64"), 1e-10),
        (
            ModelConfig(
                hidden_size=128,
                num_heads=4,
                num_kv_heads=1,
                head_dim=48,
                attention_bias=True,
                o_proj_bias=True,
                mlp_bias=True,
                dtype="float64",
            ),
            1e-10,
        ),
    ],
)
def test_logits_match_contiguous_reference(cfg, atol) -> None:
    model = build_model(cfg, seed=2)
    tokens = prompt(90, cfg.vocab_size)
    sim = PagedSim(model, block_size=8)
    sim.add("a", tokens)
    ours = sim.step([("a", len(tokens))], all_logits=True)["a"]
    ref = reference_logits(model, tokens).to(ours.dtype)
    torch.testing.assert_close(ours, ref, rtol=0, atol=atol * float(ref.abs().max()))


def test_tiled_matmul_rows_are_invariant() -> None:
    gen = torch.Generator().manual_seed(0)
    wt = torch.randn(1024, 320, generator=gen)
    x = torch.randn(300, 1024, generator=gen)
    positions = torch.arange(300) * 7 % 293

    def run(idx: torch.Tensor) -> torch.Tensor:
        tiles = gemm.row_tiles(positions[idx], gemm.ROW_TILE)
        stack = torch.zeros(tiles.num_rows, x.shape[1])
        stack[tiles.rows] = x[idx]
        return gemm.tiled_matmul(stack, wt, tiles, "test")[tiles.rows]

    full = run(torch.arange(300))
    torch.testing.assert_close(full, x @ wt, rtol=1e-5, atol=1e-4)
    for start, n in [(0, 1), (5, 1), (3, 2), (17, 31), (40, 33), (100, 64)]:
        idx = torch.arange(start, start + n)
        assert torch.equal(run(idx), full[idx])
    shuffled = torch.randperm(300, generator=gen)[:50]
    assert torch.equal(run(shuffled), full[shuffled])


# -- invariance -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_chunked_prefill_is_bit_identical(dtype) -> None:
    """Every logits row and every KV byte, whatever the chunking (1-2 token pieces too)."""
    model = build_model(ModelConfig(dtype=dtype), seed=0)
    tokens = prompt(150, model.config.vocab_size)
    one = PagedSim(model, seed=1)
    one.add("s", tokens)
    ref = one.step([("s", 150)], all_logits=True)["s"]
    for chunks in ([16, 134], [1, 1, 5, 60, 83], [2, 1, 2, 3, 7, 64, 71], [149, 1]):
        sim = PagedSim(model, seed=len(chunks))
        sim.add("s", tokens)
        got = torch.cat([sim.step([("s", n)], all_logits=True)["s"] for n in chunks])
        assert torch.equal(got, ref), chunks
        for (k1, v1), (k2, v2) in zip(sim.cached_kv("s"), one.cached_kv("s")):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_batch_composition_does_not_change_results(dtype) -> None:
    model = build_model(ModelConfig(dtype=dtype), seed=0)
    vocab = model.config.vocab_size
    tokens = prompt(70, vocab)
    alone = PagedSim(model)
    alone.add("t", tokens)
    ref = alone.step([("t", 70)], all_logits=True)["t"]
    sim = PagedSim(model, seed=7)
    sim.add("t", tokens)
    for i, n in enumerate((3, 200, 1, 45)):
        sim.add(f"o{i}", prompt(n, vocab, salt=i + 1))
    sim.step([("o0", 3)])
    out = sim.step([("o0", 0), ("o1", 200), ("t", 70), ("o2", 1), ("o3", 45)], all_logits=True)
    assert torch.equal(out["t"], ref)
    for (k1, v1), (k2, v2) in zip(sim.cached_kv("t"), alone.cached_kv("t")):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("layout", ["kv_split", "cross_layer"])
def test_every_kv_layout_gives_identical_logits(small_model, layout) -> None:
    tokens = prompt(60, SMALL.vocab_size)
    ref_sim = PagedSim(small_model, block_size=8)
    ref_sim.add("s", tokens)
    ref = ref_sim.step([("s", 60)], all_logits=True)["s"]
    sim = PagedSim(small_model, block_size=8, layout=layout)
    sim.add("s", tokens)
    got = torch.cat([sim.step([("s", n)], all_logits=True)["s"] for n in (13, 47)])
    assert torch.equal(got, ref)


def _greedy(sim: PagedSim, sid: str, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    out, rows = [], []
    for _ in range(steps):
        row = sim.step([(sid, len(sim.tokens[sid]) - sim.computed[sid])])[sid]
        token = greedy(row)
        sim.tokens[sid].append(token)
        out.append(token)
        rows.append(row)
    return out, rows


def test_greedy_generation_identical_across_kv_sources(default_model) -> None:
    """Same tokens and bit-identical logits whether the prefix KV was computed in this
    step, by another request earlier, or copied out to host memory and back."""
    vocab = default_model.config.vocab_size
    system = prompt(64, vocab, salt=9)  # 4 full blocks of 16
    user = prompt(21, vocab, salt=4)
    steps = 12

    base = PagedSim(default_model, seed=0)
    base.add("r", system + user)
    ref_tokens, ref_rows = _greedy(base, "r", steps)
    assert len(set(ref_tokens)) > 1, "degenerate random model"

    # Chunked prefill interleaved with other requests, decode batched with them.
    mixed = PagedSim(default_model, seed=3)
    mixed.add("r", system + user)
    mixed.add("x", prompt(90, vocab, salt=2))
    mixed.add("y", prompt(5, vocab, salt=3))
    mixed.step([("x", 50), ("r", 30)])
    row = mixed.step([("r", 55), ("y", 5), ("x", 40)])["r"]
    tokens, rows = [], []
    for i in range(steps):
        token = greedy(row)
        tokens.append(token)
        rows.append(row)
        mixed.tokens["r"].append(token)
        mixed.tokens["x"].append(i)
        if i % 2:  # y decodes every other step only
            mixed.tokens["y"].append(i)
            work = [("x", 1), ("r", 1), ("y", 1)]
        else:
            work = [("r", 1), ("x", 1)]
        row = mixed.step(work)["r"]
    assert tokens == ref_tokens
    assert _same(rows, ref_rows)

    # Prefix blocks computed by an earlier request (GPU prefix-cache hit).
    shared = PagedSim(default_model, seed=4)
    shared.add("donor", system + prompt(30, vocab, salt=8))
    shared.step([("donor", 94)])
    shared.add("r", system + user)
    shared.share_prefix("r", "donor", 4)
    s_tokens, s_rows = _greedy(shared, "r", steps)
    assert s_tokens == ref_tokens
    assert _same(s_rows, ref_rows)

    # Prefix blocks copied out (CPU tier) and back into other block ids.
    tiered = PagedSim(default_model, seed=5)
    tiered.add("donor", system)
    tiered.step([("donor", 64)])
    tiered.add("r", system + user)
    tiered.reload_prefix("r", "donor", 4)
    t_tokens, t_rows = _greedy(tiered, "r", steps)
    assert t_tokens == ref_tokens
    assert _same(t_rows, ref_rows)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    chunks=st.lists(
        st.one_of(st.sampled_from([1, 2, 3, 7, 64]), st.integers(1, 40)), min_size=1, max_size=6
    ),
    companions=st.lists(st.integers(0, 50), max_size=3),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 1000),
)
@example(chunks=[64] * 6, companions=[50, 50, 50], block_size=1, seed=0)  # the most blocks
def test_random_schedules_are_bit_identical(small_model, chunks, companions, block_size, seed):
    total = sum(chunks)
    tokens = prompt(total, SMALL.vocab_size, salt=seed)
    ref_sim = PagedSim(small_model, block_size=block_size, num_blocks=400)
    ref_sim.add("s", tokens)
    ref = ref_sim.step([("s", total)], all_logits=True)["s"]

    # Up to 6 x 64 tokens of "s" and 3 x 110 of companions: 714 blocks of 1 token.
    sim = PagedSim(small_model, block_size=block_size, num_blocks=1024, seed=seed)
    sim.add("s", tokens)
    for i, n in enumerate(companions):
        sim.add(f"c{i}", prompt(n + 60, SMALL.vocab_size, salt=seed + i + 1))
    got = []
    for step, n in enumerate(chunks):
        work = [("s", n)]
        for i, c in enumerate(companions):  # companions advance by various amounts
            sid = f"c{i}"
            left = len(sim.tokens[sid]) - sim.computed[sid]
            take = min(left, (c + step * 7) % 23)
            work.insert((i + step) % (len(work) + 1), (sid, take))
        got.append(sim.step(work, all_logits=True)["s"])
    assert torch.equal(torch.cat(got), ref)


# -- forward contract -------------------------------------------------------------------


def test_default_logits_are_each_sequences_last_token(small_model) -> None:
    sim = PagedSim(small_model, block_size=8)
    sim.add("a", prompt(20, SMALL.vocab_size))
    sim.add("b", prompt(9, SMALL.vocab_size, salt=1))
    full = {**sim.step([("a", 20), ("b", 9)], all_logits=True)}
    sim2 = PagedSim(small_model, block_size=8)
    sim2.add("a", prompt(20, SMALL.vocab_size))
    sim2.add("b", prompt(9, SMALL.vocab_size, salt=1))
    ids = torch.tensor(sim2.tokens["a"] + sim2.tokens["b"])
    pos = torch.tensor([*range(20), *range(9)])
    tables = [[1, 2, 3], [4, 5]]
    slots = [tables[0][p // 8] * 8 + p % 8 for p in range(20)]
    slots += [tables[1][p // 8] * 8 + p % 8 for p in range(9)]
    meta = AttentionMetadata.build([0, 20, 29], [20, 9], tables, slots, 8)
    with torch.inference_mode():
        logits = small_model(ids, pos, meta, sim2.kv)
        empty = small_model(ids, pos, meta, sim2.kv, torch.tensor([], dtype=torch.long))
    assert logits.shape == (2, SMALL.vocab_size)
    assert torch.equal(logits[0], full["a"][-1]) and torch.equal(logits[1], full["b"][-1])
    assert empty.shape == (0, SMALL.vocab_size)


def _one_seq(sim: PagedSim, n: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    table = list(range(1, 1 + -(-n // sim.bs)))
    slots = [table[p // sim.bs] * sim.bs + p % sim.bs for p in range(n)]
    meta = AttentionMetadata.build([0, n], [n], [table], slots, sim.bs)
    return torch.arange(n), torch.arange(n), meta


def test_forward_validation(small_model) -> None:
    sim = PagedSim(small_model, block_size=8, num_blocks=8)
    ids, pos, meta = _one_seq(sim, 10)
    with pytest.raises(ValueError, match="positions disagree"):
        small_model(ids, pos + 1, meta, sim.kv)
    with pytest.raises(ValueError, match="tokens"):
        small_model(ids[:5], pos[:5], meta, sim.kv)
    with pytest.raises(ValueError, match="vocabulary"):
        small_model(ids + SMALL.vocab_size, pos, meta, sim.kv)
    with pytest.raises(ValueError, match="KV caches for"):
        small_model(ids, pos, meta, sim.kv[:1])
    with pytest.raises(ValueError, match="dtype"):
        small_model(ids, pos, meta, [(k.double(), v.double()) for k, v in sim.kv])
    with pytest.raises(ValueError, match="logits_indices"):
        small_model(ids, pos, meta, sim.kv, [10])
    wrong_bs = [(k.view(-1, 4, *k.shape[2:]), v.view(-1, 4, *v.shape[2:])) for k, v in sim.kv]
    with pytest.raises(ValueError, match="layer 0"):
        small_model(ids, pos, meta, wrong_bs)
    far = AttentionMetadata.build([0, 1], [1], [[50]], [400], 8)
    with pytest.raises(ValueError, match="beyond the cache"):
        small_model(ids[:1], pos[:1], far, sim.kv)
    tiny = build_model(ModelConfig(**{**SMALL.to_dict(), "max_position": 8}), seed=0)
    with pytest.raises(ValueError, match="max_position"):
        tiny(ids, pos, meta, sim.kv)
