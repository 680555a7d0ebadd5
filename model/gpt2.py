"""GPT-2 (Pre-LN decoder), module names as in the Hugging Face checkpoint.

One forward serves prefill, single-token decode and analysis: it takes token ids with their
positions and, optionally, a KV cache with the slots the batch rows own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.activations import ACTIVATIONS, TANH_GELU
from model.attention import GPT2_ATTENTION, QUERY_BLOCK, AttentionMath, attend_in_blocks, float32_scores
from model.config import GPT2Config
from model.kv_cache import KVCache, RowReads, SlotBatch
from model.linear import Conv1D, linear, pack, released
from model.lora import LoraGroups, LoraRows
from model.quantized import (
    QUANTIZE_MODES, QUANTIZED_WEIGHTS, Int8Rows, QuantizedWeight, block_weights, quantize_problem, rescore_candidates,
)
from model.transfer import to_device


# The attention kernels scaled_dot_product_attention may choose, best first: flash (no mask),
# memory-efficient (masks), math (anything, and the CPU). Never cuDNN: on Hopper it builds an
# execution plan for every new key length, 50-60 ms each time, and decode sees a new length
# every step. Named here so the choice cannot change with a torch release's default order.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def project(layer: nn.Module, x: torch.Tensor, lora: LoraGroups | None, gelu: bool = False) -> torch.Tensor:
    """layer(x, gelu), with the forward's adapters when it has some: in a model serving adapters a
    LoraConv1D (model/lora.py) stands in place of each Conv1D of the blocks and takes them."""
    return layer(x, gelu) if lora is None else layer(x, gelu, lora)


class MLP(nn.Module):
    """activation: an `activation_function` name (model/activations.py); GPT-2's by default."""

    def __init__(self, config: GPT2Config, activation: str = "gelu_new") -> None:
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, config.inner_dim)
        self.c_proj = Conv1D(config.inner_dim, config.n_embd)
        # GPT-2's tanh GELU runs inside the first product's kernel; any other after it.
        self.fused_gelu = activation in TANH_GELU
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, lora: LoraGroups | None = None) -> torch.Tensor:
        if self.fused_gelu:
            hidden = project(self.c_fc, x, lora, gelu=True)
        else:
            hidden = self.activation(project(self.c_fc, x, lora))
        return project(self.c_proj, hidden, lora)


@dataclass
class Packing:
    """B rows of different lengths packed as one run of N tokens: every layer but attention works
    on the N real tokens only; attention lays the queries out as [B, T] (T the longest row)."""

    index: torch.Tensor  # [N] each token's place in the padded [B * T] layout
    batch: int  # B
    width: int  # T
    slots: torch.Tensor  # [N] each token's KV-cache slot
    positions: torch.Tensor  # [N] each token's position


@dataclass
class AttentionInputs:
    """What every layer's attention needs, built once per forward pass."""

    positions: torch.Tensor  # [B, T] position of each query token
    mask: torch.Tensor | None  # [B, 1, T, L] True where a query may see a key; None: all visible
    kv_length: int  # L, number of key positions read
    cache: KVCache | None
    rows: SlotBatch | None
    want_probs: bool
    packing: Packing | None = None
    # On CPU, per row (queries, keys): attention then runs row by row (`attend_by_row`).
    row_spans: list[tuple[int, int]] | None = None
    # CPU decode: where each row's own keys lie, so each layer reads only those (`KVCache.read_rows`).
    row_reads: RowReads | None = None
    # CUDA decode with "paged" attention: the keys each row reads, [B] (`KVCache.attend_decode`).
    decode_lengths: torch.Tensor | None = None
    # A prefill's queries in blocks at fixed positions (`attend_in_blocks`); otherwise each query its
    # own call, as a decode step runs it (decode, speculative verification).
    query_blocks: bool = False
    lora: LoraGroups | None = None  # the rows' adapters (model/lora.py); None: the base for every row
    # Where each new token's key and value go in the cache (`KVCache.write_index`), for every layer.
    write_index: torch.Tensor | None = None


def attend_by_row(
    queries: list[torch.Tensor], keys: torch.Tensor | list[torch.Tensor], values: torch.Tensor | list[torch.Tensor],
    ctx: AttentionInputs, attend: AttentionMath = GPT2_ATTENTION,
) -> list[torch.Tensor]:
    """Row b's queries [1, H, n_b, d_h] over its own first L_b keys only: [1, H, n_b, d_h] each.
    keys, values: [B, H, L, d_h], or row b's own [1, H, L_b, d_h] each (`KVCache.read_rows`).

    PyTorch's CPU attention (flash and math kernels alike) sums in an order set by the call's
    shape: on an AVX2 CPU a query's output changes in its last bits with the call's query count
    and key count (docs/batch-invariance.md). So no call's shape depends on the batch, nor on
    where a prompt's chunk starts or ends:
    - ctx.query_blocks (a prefill): the row's queries in blocks at fixed positions
      (`attend_in_blocks`), the same calls however the prompt is cut into chunks or however much
      of it a cached prefix holds;
    - otherwise (decode, a draft's verification) each query its own call over exactly the keys it
      sees (a single query needs no mask), so a verified draft gets decoding's bits whatever its
      length (k + 1 small calls).
    int8 weights rely on it: their per-row rounding turns a last-bit change into another token.
    attend: the layer's arithmetic (its scale, float32 scores or not).
    """
    outputs = []
    own_rows = isinstance(keys, list)  # each row's keys exactly its first L_b: no slicing them again
    for b, (q, (n, length)) in enumerate(zip(queries, ctx.row_spans)):
        own_keys, own_values = (keys[b], values[b]) if own_rows else (keys[b : b + 1], values[b : b + 1])
        if ctx.query_blocks:
            outputs.append(attend_in_blocks(q, own_keys, own_values, length - n, attend))
        elif n == 1:
            outputs.append(attend(q, own_keys, own_values, None) if own_rows else
                           attend(q, own_keys[:, :, :length], own_values[:, :, :length], None))
        else:
            first = length - n + 1  # how many keys the row's first query sees
            outputs.append(torch.cat([attend(query, own_keys[:, :, : first + j], own_values[:, :, : first + j], None)
                                      for j, query in enumerate(q.split(1, dim=2))], dim=2))  # [1, H, n, d_h]
    return outputs


def packed_row_spans(packing: Packing) -> list[tuple[int, int]]:
    """Per packed row (its tokens, the keys its last token sees), read on the host once."""
    lengths = torch.bincount(packing.index // packing.width, minlength=packing.batch)  # [B]
    last_positions = packing.positions[lengths.cumsum(0) - 1]  # [B]
    return list(zip(lengths.tolist(), (last_positions + 1).tolist()))


class CausalSelfAttention(nn.Module):
    """attend: the layer's arithmetic (model/attention.py); GPT-2's by default."""

    def __init__(self, config: GPT2Config, layer_index: int, attend: AttentionMath = GPT2_ATTENTION) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.layer_index = layer_index
        self.attend = attend
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)

    def forward(
        self, x: torch.Tensor, ctx: AttentionInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if ctx.packing is not None:
            return self._forward_packed(x, ctx), None
        B, T, C = x.shape
        qkv = project(self.c_attn, x, ctx.lora).view(B, T, 3, self.n_head, self.head_dim)  # [B, T, 3, H, d_h]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 × [B, H, T, d_h], views
        if ctx.cache is not None:
            ctx.cache.write(self.layer_index, ctx.write_index, qkv[:, :, 1:])
            if ctx.decode_lengths is not None:  # read in place from the blocks: [B, H, d_h]
                y = ctx.cache.attend_decode(self.layer_index, q[:, :, 0], ctx.rows, ctx.decode_lengths,
                                            self.attend.scale_for(self.head_dim))
                return project(self.c_proj, y.view(B, T, C), ctx.lora), None
            if ctx.row_reads is not None:  # each row's own keys and values: B × [1, H, L_b, d_h]
                k, v = ctx.cache.read_rows(self.layer_index, ctx.row_reads)
            else:
                k, v = ctx.cache.read(self.layer_index, ctx.rows, ctx.kv_length)  # [B, H, L, d_h]

        probs = None
        if ctx.row_spans is not None:
            y = torch.cat(attend_by_row(list(q.split(1)), k, v, ctx, self.attend))  # [B, H, T, d_h]
        elif ctx.want_probs:
            # Analysis needs the probabilities themselves, in float32 whatever the weights are
            # (so reorder_and_upcast_attn holds here too).
            scores = float32_scores(q, k, ctx.mask, self.attend.scale_for(self.head_dim))  # [B, H, T, L]
            probs = scores.softmax(dim=-1)  # [B, H, T, L]
            y = probs.to(v.dtype) @ v  # [B, H, T, d_h]
        else:
            y = self.attend(q, k, v, ctx.mask)  # [B, H, T, d_h]
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
        return project(self.c_proj, y, ctx.lora), probs

    def _forward_packed(self, x: torch.Tensor, ctx: AttentionInputs) -> torch.Tensor:
        """x [1, N, C] packed rows (always with a cache): projections over the N real tokens,
        attention over their [B, T] layout."""
        packing, (_, N, C) = ctx.packing, x.shape
        H, d = self.n_head, self.head_dim
        qkv = project(self.c_attn, x, ctx.lora)[0].view(N, 3, H, d)  # [N, 3, H, d_h]
        ctx.cache.write(self.layer_index, ctx.write_index, qkv[:, 1:])
        q = qkv[:, 0].reshape(N, C)  # [N, C]
        keys, values = ctx.cache.read(self.layer_index, ctx.rows, ctx.kv_length)  # [B, H, L, d_h]
        if ctx.row_spans is not None:
            rows = q.split([n for n, _ in ctx.row_spans])  # B × [n_b, C]
            queries = [row.view(1, len(row), H, d).transpose(1, 2) for row in rows]  # B × [1, H, n_b, d_h]
            outputs = attend_by_row(queries, keys, values, ctx, self.attend)
            y = torch.cat([out.transpose(1, 2).reshape(-1, C) for out in outputs])
            return project(self.c_proj, y[None], ctx.lora)  # [1, N, C]
        B, T = packing.batch, packing.width
        laid_out = q.new_zeros(B * T, C)
        laid_out[packing.index] = q
        queries = laid_out.view(B, T, H, d).transpose(1, 2)  # [B, H, T, d_h]
        y = self.attend(queries, keys, values, ctx.mask)  # [B, H, T, d_h]
        y = y.transpose(1, 2).reshape(B * T, C)[packing.index]  # [N, C]
        return project(self.c_proj, y[None], ctx.lora)  # [1, N, C]


class Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_index, AttentionMath.for_layer(config, layer_index))
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config, config.activation_function)

    def forward(
        self, x: torch.Tensor, ctx: AttentionInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, probs = self.attn(self.ln_1(x), ctx)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x), ctx.lora)
        return x, probs


def rows_by_adapter(
    input_ids: torch.Tensor, positions: torch.Tensor, rows: SlotBatch | None, logits_index: torch.Tensor | None, lora: LoraRows
) -> tuple[torch.Tensor, torch.Tensor, SlotBatch | None, torch.Tensor | None, LoraRows, torch.Tensor | None]:
    """The forward's per-row inputs reordered so each adapter's rows are consecutive
    (`LoraRows.by_adapter`), and the order that puts its outputs back (None: unchanged). Every
    row's computation is its own, so the order changes no bits; it spares each adapted layer
    gathering its input and output (model/lora.py's LoraGroups)."""
    grouped = lora.by_adapter()
    if grouped is None:
        return input_ids, positions, rows, logits_index, lora, None
    order, restore, lora = grouped
    order_t, restore_t = to_device([order, restore], input_ids.device)  # one copy
    if rows is not None:
        rows = SlotBatch(rows.ids.index_select(0, order_t), None)
    if logits_index is not None:
        logits_index = logits_index.index_select(0, order_t)
    return input_ids.index_select(0, order_t), positions.index_select(0, order_t), rows, logits_index, lora, restore_t


def run_blocks(
    blocks: nn.ModuleList, x: torch.Tensor, ctx: AttentionInputs, output_hidden_states: bool
) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """x through every block; the hidden states (embeddings first) and attention probabilities
    when asked for (ctx.want_probs)."""
    hidden = [x] if output_hidden_states else None
    attentions = [] if ctx.want_probs else None
    with sdpa_kernel(ATTENTION_BACKENDS):
        for block in blocks:
            x, probs = block(x, ctx)
            if hidden is not None:
                hidden.append(x)
            if attentions is not None:
                attentions.append(probs)
    return x, hidden, attentions


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T, V], or [B, V] when logits_index picks one token per row
    attentions: list[torch.Tensor] | None = None  # per layer [B, H, T, L], float32
    hidden_states: list[torch.Tensor] | None = None  # embeddings, then after each block [B, T, C]
    # What the tied LM head reads, when the caller asked for it instead of the logits (training
    # computes its loss from it in chunks, never holding [B, T, V]).
    head_input: torch.Tensor | None = None  # [B, T, C] or [B, C]


def head_output(
    x: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    apply_head: bool,
    attentions: list[torch.Tensor] | None,
    hidden: list[torch.Tensor] | None,
) -> ForwardOutput:
    if not apply_head:
        return ForwardOutput(logits=None, attentions=attentions, hidden_states=hidden, head_input=x)
    return ForwardOutput(logits=lm_head(x), attentions=attentions, hidden_states=hidden)  # [B, T, V] or [B, V]


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self._lm_head_packed: torch.Tensor | QuantizedWeight | None = None
        self._wte_rows: Int8Rows | None = None  # int4: what the token lookup reads instead of wte
        self.quantization = "none"  # a QUANTIZE_MODES name: what `quantize` made of the weights

    # wpe, not wte: an int4 model releases wte.
    @property
    def device(self) -> torch.device:
        return self.wpe.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wpe.weight.dtype

    def prepare(self, use_packed: bool = True) -> None:
        """Lay the weights out for the current device and dtype (model/linear.py explains).

        Call after loading, moving or converting the model (load_model does). Without it, or
        with use_packed=False, the model computes the same function with PyTorch's default
        kernels (the reference the fast path is tested against).
        """
        self._lm_head_packed = pack(self.wte.weight) if use_packed else None
        for module in self.modules():
            if isinstance(module, Conv1D):
                module.prepare(use_packed)

    def quantize(self, mode: str) -> None:
        """Serve every Conv1D and the tied LM head from "int8" or "int4" weights ("none": leave
        the model as it is). For inference only, after `prepare`, and final: the blocks' float
        weights are released. The head reads a quantized copy of wte. The token lookup keeps
        reading wte in float for int8; for int4 it reads an int8 copy (`Int8Rows`), and wte is
        released too: GPT-2 124M's served int4 bytes go from 22.9% to 11.3% of float32's."""
        if mode not in QUANTIZE_MODES:
            raise ValueError(f"unknown quantization {mode!r}; one of {', '.join(QUANTIZE_MODES)}")
        problem = quantize_problem(mode, self.device, self.dtype, self.config)
        if problem is not None:
            raise ValueError(problem)
        if mode == "none":
            return
        self._lm_head_packed = QUANTIZED_WEIGHTS[mode](self.wte.weight)
        for index, block in enumerate(self.h):
            for module in block.modules():
                if isinstance(module, Conv1D):
                    module.quantize(block_weights(mode, index))
        if mode == "int4":
            self._wte_rows = Int8Rows(self.wte.weight)
            self.wte.weight = released(self.wte.weight)
        self.quantization = mode

    def served_weight_bytes(self) -> int:
        """Bytes of the weights as served: the float parameters still held (released ones are
        meta tensors), plus the copies the products and the lookup read (oneDNN's packed float
        ones, or quantized ones)."""
        held = sum(p.nbytes for p in self.parameters() if p.device.type != "meta")
        copies = [self._lm_head_packed, self._wte_rows, *(m.packed for m in self.modules() if isinstance(m, Conv1D))]
        return held + sum(c.nbytes for c in copies if c is not None)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> their token embeddings [..., C]."""
        return self.wte(input_ids) if self._wte_rows is None else self._wte_rows(input_ids)

    @property
    def tied_embedding(self) -> torch.Tensor:
        """The [V, C] token embedding that is also the LM head."""
        return self.wte.weight

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        # Tied to wte, whose [V, C] layout is already the [out, in] every kernel here wants.
        logits = linear(x, self.wte.weight, None, self._lm_head_packed)
        if isinstance(self._lm_head_packed, QuantizedWeight):
            # The best candidates' logits from the embedding rows the lookup reads (float32 for
            # int8, the int8 copy for int4), not from the quantized head's rounded product.
            return rescore_candidates(logits, x, self.embed_tokens)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rows: SlotBatch | None = None,
        kv_length: int | None = None,
        logits_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        exact_kv_length: bool = True,
        apply_head: bool = True,
        lora: LoraRows | None = None,
    ) -> ForwardOutput:
        """Run the decoder.

        input_ids, positions: [B, T]; positions default to 0..T-1 for every row.
        cache, rows: the cache and the slot of each row; new keys/values are written at
            `positions`, and attention reads the first `kv_length` cached positions
            (default max(positions) + 1; pass it to avoid a device sync).
        logits_index: [B] index into T per row; only those tokens go through the LM head.
        exact_kv_length: False when kv_length may exceed a row's own length (a fixed length, as
            CUDA graphs need): every row is then masked, even a lone one.
        apply_head: False returns what the LM head would read (`head_input`) instead of logits.
        lora: each row's LoRA adapter (`LoraSet.rows`); None runs the base for every row.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
        if cache is not None and rows is None:
            raise ValueError("a cache needs the rows' slots")
        restore = None  # the batch's order, where its rows run grouped by adapter
        if lora is not None and not (output_attentions or output_hidden_states):
            input_ids, positions, rows, logits_index, lora, restore = rows_by_adapter(input_ids, positions, rows, logits_index, lora)
        if kv_length is None:
            kv_length = int(positions.max()) + 1 if cache is not None else T
        # CPU decode attends row by row over each row's own keys 0..p: no mask to build; nor does
        # CUDA decode with paged attention, which reads each row's keys through its block table.
        paged = cache is not None and T == 1 and not output_attentions and cache.decode_attention == "paged"
        by_row = cache is not None and T == 1 and exact_kv_length and not output_attentions and input_ids.device.type == "cpu" \
            and not paged
        ctx = AttentionInputs(
            positions=positions,
            mask=None if by_row or paged else self._attention_mask(positions, kv_length, cached=cache is not None, exact=exact_kv_length),
            kv_length=kv_length,
            cache=cache,
            rows=rows,
            want_probs=output_attentions,
            write_index=cache.write_index(rows.ids[:, None].expand_as(positions), positions) if cache is not None else None,
        )
        if paged:
            # Keys 0..p, at most kv_length: a static step's padding rows (graphs.py) read its bucket.
            ctx.decode_lengths = (positions[:, 0] + 1).clamp(max=kv_length)  # [B]
        if by_row:
            ctx.row_spans = [(1, position + 1) for position in positions[:, 0].tolist()]  # decode: keys 0..p
            ctx.row_reads = cache.row_reads(rows, [length for _, length in ctx.row_spans])
        if lora is not None:
            ctx.lora = lora.over_width(T, input_ids.device)

        x = self.embed_tokens(input_ids) + self.wpe(positions)  # [B, T, C]
        x, hidden, attentions = run_blocks(self.h, x, ctx, output_hidden_states)
        if logits_index is not None:
            x = x[torch.arange(B, device=x.device), logits_index]  # [B, C]
        if restore is not None:
            x = x.index_select(0, restore)
        return head_output(self.ln_f(x), self.lm_head, apply_head, attentions, hidden)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        packing: Packing,
        cache: KVCache,
        rows: SlotBatch,
        kv_length: int,
        output_hidden_states: bool = False,
        one_query_per_call: bool = False,
        lora: LoraRows | None = None,
    ) -> ForwardOutput:
        """Rows of new tokens of different lengths, packed (input_ids [N]; see Packing), each
        continuing its slot in the cache: no compute on padding outside attention.

        Returns what the LM head reads, head_input [N, C] (and hidden_states [1, N, C] each).
        one_query_per_call: each query its own attention call, as decoding computes it (speculative
            verification). Otherwise (a prefill) a token's bits do not depend on the chunk or cached
            prefix it continues. Either way not on the batch (`attend_by_row`, CPU).
        lora: each packed row's LoRA adapter (`LoraSet.rows`); None runs the base for every row.
        """
        B, T = packing.batch, packing.width
        # Padded queries sit at position 0: they see one key, so no row is fully masked.
        padded = torch.zeros(B * T, dtype=torch.long, device=input_ids.device)
        padded[packing.index] = packing.positions
        padded = padded.view(B, T)  # [B, T]
        by_row = input_ids.device.type == "cpu"  # each row's calls build their own masks
        if by_row and not one_query_per_call:
            # Every query block reads the keys up to its end, or the cache's length (`attend_in_blocks`).
            kv_length = min(-(-kv_length // QUERY_BLOCK) * QUERY_BLOCK, cache.max_len)
        ctx = AttentionInputs(
            positions=padded,
            mask=None if by_row else self._attention_mask(padded, kv_length, cached=True),
            kv_length=kv_length,
            cache=cache,
            rows=rows,
            want_probs=False,
            packing=packing,
            write_index=cache.write_index(packing.slots, packing.positions),
        )
        if by_row:
            ctx.row_spans = packed_row_spans(packing)
            ctx.query_blocks = not one_query_per_call
        if lora is not None:
            tokens_per_row = [n for n, _ in ctx.row_spans] if ctx.row_spans is not None else (
                torch.bincount(packing.index // T, minlength=B).tolist())
            ctx.lora = lora.over_tokens(tokens_per_row, input_ids.device)
        x = (self.embed_tokens(input_ids) + self.wpe(packing.positions))[None]  # [1, N, C]
        x, hidden, _ = run_blocks(self.h, x, ctx, output_hidden_states)
        return head_output(self.ln_f(x[0]), self.lm_head, False, None, hidden)

    @staticmethod
    def _attention_mask(
        positions: torch.Tensor, kv_length: int, cached: bool, exact: bool = True
    ) -> torch.Tensor | None:
        B, T = positions.shape
        if cached and exact and B == 1 and T == 1:
            return None  # one decode row reads exactly positions 0..p, all visible
        if cached:
            key_positions = torch.arange(kv_length, device=positions.device)[None, :]  # [1, L]
        else:
            key_positions = positions  # [B, L=T]: the keys are this call's own tokens
        # Causal by position, not by index: each row has its own length and offset.
        return (key_positions[:, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B,1,T,L]
