"""Gemma 3 for tests: the real GGUF (fetched once; tests skip saying why when it
cannot be), a tiny random Gemma3Config, and `HandPlan`, which drives
`forward_paged` through step plans built by hand, KV-cache groups included, so
the model's paged path is checked without the scheduler.

HandPlan keeps one pool of pages (page 0 the null page) shared by every group,
as the core does: a full group's table holds every block of a sequence; a
sliding-window group's table gets page 0 in place of each block that fell
behind the window of the step's first query (the block's page goes back to the
pool), and with `poison` a freed page is filled with NaN, as a page reused by
someone else would be garbage: a kernel that read it would give NaN logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvsched.engine.inputs import AttentionInputs  # noqa: E402
from kvsched.engine.model import Params, forward_paged  # noqa: E402
from kvsched.engine.model_config import Gemma3Config  # noqa: E402
from kvsched.shapes import KVGroupLayout, group_layers  # noqa: E402


def tiny_gemma3(**kw) -> Gemma3Config:
    """A small Gemma 3: 6 layers, global every third (layers 2 and 5), window 8."""
    base = dict(vocab_size=384, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
                ffn_dim=128, sliding_window=8, global_every=3, rope_theta=1_000_000.0,
                rope_local_theta=10_000.0, query_pre_attn_scalar=24.0)  # fmt: skip
    return Gemma3Config(**{**base, **kw})


@functools.cache
def _load_real(dtype: str):
    from kvsched.engine.loaders.gguf_gemma3 import load_gguf_gemma3

    path, why = _fetch()
    if path is None:
        return None, why
    return load_gguf_gemma3(path, dtype=dtype), None


@functools.cache
def _fetch():
    from kvsched import model_files

    try:
        return model_files.fetch(model_files.GEMMA3_270M, quiet=True), None
    except model_files.ModelFetchError as e:
        return None, str(e)


def gemma3_file():
    """The GGUF file's path, fetched, not loaded (for tests that start a process
    that loads it), or a skip saying why it cannot be fetched."""
    path, why = _fetch()
    if path is None:
        pytest.skip(f"gemma-3-270m cannot be fetched: {why}")
    return path


def gemma3_270m(dtype: str = "float32"):
    """The loaded Gemma 3 270M (GGUFModel), or a skip saying why it is not here."""
    model, why = _load_real(dtype)
    if model is None:
        pytest.skip(f"gemma-3-270m cannot be fetched: {why}")
    return model


@dataclass
class _Seq:
    tokens: list[int]
    cached: int = 0  # tokens whose K/V are in the cache
    tables: list[list[int]] = field(default_factory=list)  # per group: page per block


class HandPlan:
    """Step plans built by hand over one page pool. `step` runs chunks
    [(seq, n_new)] in one plan (tokens padded to a power of two, at least 16)
    and returns each chunk's last-row logits."""

    def __init__(
        self,
        params: Params,
        config: Gemma3Config,
        *,
        uniform: bool = False,
        block_size: int = 4,
        num_blocks: int = 512,
        max_seqs: int = 4,
        max_len: int = 256,
        tokens_per_step: int = 32,
        poison: bool = True,
        backend: str = "reference",
    ) -> None:
        self.params, self.config, self.poison = params, config, poison
        self.layout: KVGroupLayout = group_layers(config.layer_kinds, uniform=uniform)
        self.bs, self.max_seqs, self.t = block_size, max_seqs, tokens_per_step
        self.pps = -(-max_len // block_size)
        lg = self.layout.layers_per_group
        self.cache = jnp.zeros(
            (lg, num_blocks, block_size, 2 * config.n_kv_heads, config.head_dim), config.jdtype
        )
        self.free = list(range(num_blocks - 1, 0, -1))  # page 0 is never handed out
        self.seqs: dict[int, _Seq] = {}
        self._released: list[int] = []
        self.pages_in_use_max = 0
        self._step = jax.jit(
            functools.partial(
                forward_paged, config=config, backend=backend, kv_layout=self.layout
            ),  # fmt: skip
        )

    def add(self, sid: int, tokens: list[int]) -> None:
        self.seqs[sid] = _Seq(list(tokens), 0, [[] for _ in self.layout.groups])

    def window_of(self, group: int) -> int:
        kind = self.layout.groups[group]
        return 0 if kind == "full" else int(kind.split(":")[1])

    def _alloc(self) -> int:
        return self.free.pop()

    def _release(self, page: int) -> None:
        self._released.append(page)
        self.free.append(page)

    def step(self, chunks: list[tuple[int, int]]) -> np.ndarray:
        g_count = self.layout.num_groups
        rows = sum(n for _, n in chunks)
        t = 16  # token buckets: powers of two up to tokens_per_step, as the core's
        while t < rows:
            t *= 2
        assert t <= self.t, f"{rows} tokens in one step, tokens_per_step is {self.t}"
        positions = np.zeros(t, np.int32)
        tokens = np.zeros(t, np.int32)
        pad = self.cache.shape[1] * self.bs
        slots = np.full((g_count, t), pad, np.int32)
        cu = np.zeros(self.max_seqs + 1, np.int32)
        kv_lens = np.zeros(self.max_seqs, np.int32)
        tables = np.zeros((g_count, self.max_seqs, self.pps), np.int32)
        logits_rows = np.zeros(self.max_seqs, np.int32)
        row = 0
        for i, (sid, n_new) in enumerate(chunks):
            s = self.seqs[sid]
            start, end = s.cached, s.cached + n_new
            assert end <= len(s.tokens) and row + n_new <= t
            for g in range(g_count):
                table, w = s.tables[g], self.window_of(g)
                while len(table) * self.bs < end:
                    table.append(self._alloc())
                if w:  # blocks wholly before the first query's window go back
                    first_needed = max(0, start - w + 1) // self.bs
                    for b in range(first_needed):
                        if table[b] != 0:
                            self._release(table[b])
                            table[b] = 0
                tables[g, i, : len(table)] = table
                for j, p in enumerate(range(start, end)):
                    slots[g, row + j] = table[p // self.bs] * self.bs + p % self.bs
            positions[row : row + n_new] = np.arange(start, end)
            tokens[row : row + n_new] = s.tokens[start:end]
            row += n_new
            cu[i + 1] = row
            kv_lens[i] = end
            logits_rows[i] = row - 1
            s.cached = end
        cu[len(chunks) + 1 :] = row
        in_use = self.cache.shape[1] - 1 - len(self.free)
        self.pages_in_use_max = max(self.pages_in_use_max, in_use)
        if self.poison and self._released:  # one write for the step's freed pages
            self.cache = self.cache.at[:, jnp.asarray(self._released)].set(jnp.nan)
        self._released = []
        inputs = AttentionInputs(
            positions=jnp.asarray(positions), cu_q_lens=jnp.asarray(cu),
            kv_lens=jnp.asarray(kv_lens), page_indices=jnp.asarray(tables),
            num_seqs=jnp.asarray([len(chunks)], jnp.int32),
        )  # fmt: skip
        logits, self.cache = self._step(
            self.params, self.cache, token_ids=jnp.asarray(tokens),
            positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots),
            inputs=inputs, logits_indices=jnp.asarray(logits_rows),
        )  # fmt: skip
        return np.asarray(logits[: len(chunks)])

    def generate(
        self, prompts: dict[int, list[int]], n: int, *, chunk: int
    ) -> dict[int, list[int]]:
        """Greedy, as the core schedules: each step decodes every sequence past
        its prompt (one token each, first) and prefills the others in chunks of
        at most `chunk` tokens within tokens_per_step; `n` new tokens each."""
        for sid, p in prompts.items():
            self.add(sid, p)
        out: dict[int, list[int]] = {sid: [] for sid in prompts}
        while True:
            live = [sid for sid in prompts if self.seqs[sid].cached < len(self.seqs[sid].tokens)]
            if not live:
                break
            decodes = [(sid, 1) for sid in live if len(out[sid]) > 0]
            budget = self.t - len(decodes)
            todo = list(decodes)
            for sid in live:
                s = self.seqs[sid]
                if out[sid] or budget <= 0 or len(todo) == self.max_seqs:
                    continue
                take = min(chunk, len(s.tokens) - s.cached, budget)
                todo.append((sid, take))
                budget -= take
            logits = self.step(todo)
            for (sid, _), row in zip(todo, logits, strict=True):
                s = self.seqs[sid]
                if s.cached == len(s.tokens) and len(out[sid]) < n:
                    tok = int(np.argmax(row))
                    out[sid].append(tok)
                    if len(out[sid]) < n:
                        s.tokens.append(tok)
        return out


# -- a tiny Gemma 3 GGUF --------------------------------------------------------------

_WORDS = ("the", "in", "and", "of", "to", "is", "it", "on", "at", "an", "he", "er", "re", "th",
          "ing", "ed", "es", "or", "hello", "world", "tion", "at", "en", "al")  # fmt: skip


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece BPE vocabulary laid out as Gemma's is: control
    tokens, user-defined ones (newline and space runs, a tag), the 256 byte
    tokens, then normal pieces (scores falling with their position) that merge
    into words with and without the leading U+2581."""
    sp = "\u2581"
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  ", "   ", "<b>"]
    normal: list[str] = [sp, *"abcdefghijklmnopqrstuvwxyz", *"0123456789", *".,!?'-:()"]
    for w in _WORDS:  # every prefix of "▁word" and of "word", in order
        for piece in [w[:i] for i in range(2, len(w) + 1)] + [
            sp + w[:i] for i in range(1, len(w) + 1)
        ]:  # noqa: E501
            if piece not in normal:
                normal.append(piece)
    tokens = control + user + [f"<0x{b:02X}>" for b in range(256)] + normal
    types = [3] * len(control) + [4] * len(user) + [6] * 256 + [1] * len(normal)
    scores = (
        [-1000.0] * (len(control) + len(user))
        + [0.0] * 256
        + [-float(i) for i in range(len(normal))]
    )  # noqa: E501
    return tokens, scores, types


def tiny_gguf_config(**kw) -> Gemma3Config:
    """A tiny Gemma 3 with spm_vocab()'s vocabulary and head_dim 256 (what
    transformers' GGUF loader assumes for query_pre_attn_scalar)."""
    base = dict(vocab_size=len(spm_vocab()[0]), dim=64, n_layers=6, n_heads=2, n_kv_heads=1,
                head_dim=256, ffn_dim=96, sliding_window=8, global_every=6,
                rope_theta=1_000_000.0, rope_local_theta=10_000.0,
                query_pre_attn_scalar=256.0, name="tiny-gemma3-gguf",
                norm_eps=float(np.float32(1e-6)))  # the file stores it as a float32  # fmt: skip
    return Gemma3Config(**{**base, **kw})


GGUF_LAYER_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
                    "wo": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
                    "post_attn_norm": "post_attention_norm", "mlp_norm": "ffn_norm",
                    "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
                    "post_mlp_norm": "post_ffw_norm"}  # fmt: skip


def write_gemma3_gguf(path, config: Gemma3Config, params, *, extra=None, drop=None, add=None,
                      tokenizer_model="llama", quantize=None) -> None:  # fmt: skip
    """`params` as llama.cpp's converter writes a Gemma 3 (norms as 1 + w, [out,
    in] projections, no output tensor), with spm_vocab(). extra: more metadata
    (key -> float or str); drop: a tensor left out; add: name -> array, more
    tensors; quantize: a gguf quantization type for the projections."""
    import gguf

    tokens, scores, types = spm_vocab()
    assert len(tokens) == config.vocab_size
    c = config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name(c.name)
    w.add_block_count(c.n_layers)
    w.add_context_length(1024)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, value)

    def put(name: str, a, *, added: bool = False) -> None:
        if name == drop and not added:
            return
        a = np.ascontiguousarray(np.asarray(a, np.float32))
        if quantize is not None and a.ndim == 2:
            q = gguf.quants.quantize(a, quantize)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=quantize)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", params["embed"])
    put("output_norm.weight", np.asarray(params["final_norm"]) + 1.0)
    for i in range(c.n_layers):
        for key, short in GGUF_LAYER_NAMES.items():
            a = np.asarray(params["layers"][key][i], np.float32)
            a = a + 1.0 if a.ndim == 1 else a.T  # norms as 1 + w; [in, out] -> [out, in]
            put(f"blk.{i}.{short}.weight", a)
    for name, a in (add or {}).items():
        put(name, a, added=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
