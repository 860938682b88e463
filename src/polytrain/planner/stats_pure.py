"""Analytic model statistics for the built-in models and for published transformer setups.

The fallback of `measure.stats` (planner2's torch-facing module, which measures the real model
on the meta device): closed formulas from the model's dimensions, so it also prices models far
too large to build here. Pure Python, no torch.

FLOPs count a multiply-add as 2. Per transformer layer and sample (sequence of T tokens, width
C): ``24 T C^2 + 4 T^2 C`` forward FLOPs (Narayanan et al. SC21, eq. 3 before its 3x/4x factor
for backward and recomputation), ``12 C^2 + 13 C`` parameters, and saved activations of
``T C (34 + 5 a T / C)`` bytes with 16-bit activations (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", eq. 1; doubled for fp32), of
which ``10 T C`` stay whole under tensor parallelism (eq. 2).
"""

from __future__ import annotations

from polytrain.planner.types import BlockStats, ModelStats

__all__ = ["gpt_stats", "mlp_stats", "transformer_stats"]

MLP_EMBED_DIM = 16  # models.mlp.EMBED_DIM (kept equal by tests/unit/test_planner_stats.py)


def transformer_stats(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    seq_len: int,
    vocab_size: int,
    act_bytes: int = 4,
    param_bytes: int = 4,
    optimizer_state_per_param: int = 2,
    name: str = "gpt",
    n_kv_head: int | None = None,
    ffn_hidden: int | None = None,
    gated: bool = False,
    bias: bool = True,
    dropout: bool = True,
    position_table: bool = True,
    flash: bool = False,
) -> ModelStats:
    """Block view [embedding, layer x n_layer, head] of a GPT (ours or Megatron's).

    The defaults are a GPT-2 / Megatron GPT layer. A Llama is ``n_kv_head`` (grouped-query
    attention: k and v have ``n_kv_head`` heads of width ``n_embd / n_head``), ``ffn_hidden`` and
    ``gated=True`` (SwiGLU: gate, up and down projections), ``bias=False``, ``dropout=False``,
    ``position_table=False`` (RoPE) and ``flash=True``: a flash / memory-efficient attention
    kernel saves O(T) per head, not Korthikanti's ``5 a T^2`` bytes of scores, softmax and
    dropout mask. Saved activations follow Korthikanti et al.'s count term by term (16-bit):
    attention ``2TC`` (q/k/v input) ``+ 2TC + 4TCkv`` (q, k, v) ``+ 2TC`` (projection input)
    ``+ TC`` (dropout mask); MLP ``2TC + 4TF`` (GELU input and output) ``+ TC`` (mask), or
    ``2TC + 8TF`` gated (gate, up, silu(gate), their product); two norms' inputs ``4TC``. With
    the defaults that is eq. 1's ``34 TC + 5 a T^2``.
    """
    T, C, V = seq_len, n_embd, vocab_size
    kv = n_head if n_kv_head is None else n_kv_head
    Ckv = C * kv // n_head  # width of k and v
    F = 4 * C if ffn_hidden is None else ffn_hidden
    act = T * C * act_bytes
    emb_params = V * C + (T * C if position_table else 0)
    blocks = [
        BlockStats(
            name="blocks.0",
            params=emb_params,
            param_bytes=emb_params * param_bytes,
            fwd_flops=0.0,  # a gather, not a matmul
            saved_bytes=float(act),
            output_bytes=float(act),
            tensors=2 if position_table else 1,  # token (and position) tables
            saved_whole_bytes=float(act),  # the embedding's output: all-reduced, whole
            # the token table is vocabulary-parallel, the position table whole (gpt_plan)
            tp_shards=((V * C * param_bytes, V), ((emb_params - V * C) * param_bytes, 1))
            if position_table
            else ((V * C * param_bytes, V),),
        )
    ]
    attn_w = 2 * C * C + 2 * C * Ckv  # q, o: C x C; k, v: C x Ckv
    attn_b = 2 * C + 2 * Ckv if bias else 0
    mlp_w = (3 if gated else 2) * C * F
    mlp_b = ((2 if gated else 1) * F + C) if bias else 0
    norms = 4 * C if bias else 2 * C  # two LayerNorms (weight, bias) or RMSNorms (weight)
    layer_params = attn_w + attn_b + mlp_w + mlp_b + norms
    # Korthikanti et al. eq. 1 term by term (see the docstring), for 2-byte activations;
    # scaled to ours
    mask = T * C if dropout else 0
    attn_saved = 2 * T * C + 2 * T * C + 4 * T * Ckv + 2 * T * C + mask
    attn_saved += 0 if flash else 5 * n_head * T * T
    mlp_saved = 2 * T * C + (8 * T * F if gated else 4 * T * F) + mask
    saved = (attn_saved + mlp_saved + 4 * T * C) * act_bytes / 2
    # eq. 2: norms' inputs, the q/k/v and MLP inputs and the dropout masks stay whole
    whole = (8 * T * C + 2 * mask) * act_bytes / 2
    col = (C * C + 2 * C * Ckv) + (C + 2 * Ckv if bias else 0)  # q, k, v
    row = C * C + mlp_w // (3 if gated else 2)  # o and down: weights split, biases whole
    mlp_col = mlp_w - C * F + ((2 if gated else 1) * F if bias else 0)  # fc / gate and up
    for i in range(n_layer):
        blocks.append(
            BlockStats(
                name=f"blocks.{i + 1}",
                params=layer_params,
                param_bytes=layer_params * param_bytes,
                fwd_flops=2.0 * T * (attn_w + mlp_w) + 4.0 * T * T * C,
                # [Note: attention kernels]: one causal self-attention call, counted in full
                attention=((T, T, C // n_head, 4.0 * T * T * C),),
                attention_counted=4.0 * T * T * C,
                saved_bytes=saved,
                # eq. 2 (tensor parallel, no sequence parallelism): the 10 T C bytes of layer
                # norm and dropout inputs stay whole ([Note: tensor-parallel activations])
                saved_whole_bytes=whole,
                output_bytes=float(act),
                linears=((C, C), (C, Ckv), (C, Ckv), (C, C))
                + ((C, F),) * (2 if gated else 1)
                + ((F, C),),
                rows_per_sample=T,
                # Linear weights (and biases), norms' weights (and biases)
                tensors=(7 if gated else 6) * (2 if bias else 1) + (4 if bias else 2),
                # gpt_plan: q, k, v column-parallel (weight and bias split by heads), attn.proj
                # row-parallel (weight split, bias whole), fc (gate, up) column-parallel (by
                # F), mlp.proj row-parallel (weight by F, bias whole); norms whole
                tp_shards=(
                    ((col + C * C) * param_bytes, kv),
                    ((mlp_col + mlp_w // (3 if gated else 2)) * param_bytes, F),
                    ((layer_params - col - row - mlp_col) * param_bytes, 1),
                ),
            )
        )
    head_norm = 2 * C if bias else C  # final LayerNorm (weight, bias) or RMSNorm (weight)
    head_params = C * V + head_norm
    blocks.append(
        BlockStats(
            name=f"blocks.{n_layer + 1}",
            params=head_params,
            param_bytes=head_params * param_bytes,
            fwd_flops=2.0 * T * C * V,
            # layer norm input + logits, and the loss's fp32 softmax of the logits
            saved_bytes=float(act + T * V * act_bytes + T * V * 4),
            saved_whole_bytes=float(act + T * V * act_bytes + T * V * 4),  # logits gathered
            output_bytes=float(T * V * act_bytes),
            linears=((C, V),),
            rows_per_sample=T,
            tensors=3 if bias else 2,  # final norm (weight, bias) and the output layer
            tp_shards=((C * V * param_bytes, V), (head_norm * param_bytes, 1)),
        )
    )
    return ModelStats(
        name=name,
        blocks=tuple(blocks),
        dtype_bytes=param_bytes,
        tokens_per_sample=T,
        optimizer_state_per_param=optimizer_state_per_param,
        tp_divisor=kv,  # (key-value) heads split evenly over the tensor-parallel ranks
    )


def gpt_stats(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    block_size: int,
    vocab_size: int,
    act_bytes: int = 4,
    optimizer_state_per_param: int = 2,
) -> ModelStats:
    """Our `models.gpt` (nanoGPT layout: separate q/k/v with biases, GELU MLP, untied head)."""
    return transformer_stats(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        seq_len=block_size,
        vocab_size=vocab_size,
        act_bytes=act_bytes,
        optimizer_state_per_param=optimizer_state_per_param,
        name="gpt",
    )


def mlp_stats(
    *,
    n_layer: int,
    n_embd: int,
    block_size: int,
    vocab_size: int,
    act_bytes: int = 4,
    optimizer_state_per_param: int = 2,
) -> ModelStats:
    """Our `models.mlp` on tokens: [embed+flatten, (Linear, GELU) x n_layer, Linear]."""
    blocks: list[BlockStats] = []
    emb_params = vocab_size * MLP_EMBED_DIM
    fan_in = block_size * MLP_EMBED_DIM
    blocks.append(
        BlockStats(
            name="blocks.0",
            params=emb_params,
            param_bytes=emb_params * 4,
            fwd_flops=0.0,
            saved_bytes=float(fan_in * act_bytes),
            output_bytes=float(fan_in * act_bytes),
        )
    )
    dims = [*[(fan_in if i == 0 else n_embd, n_embd) for i in range(n_layer)], (n_embd, vocab_size)]
    for i, (fi, fo) in enumerate(dims):
        params = fi * fo + fo
        last = i == len(dims) - 1
        blocks.append(
            BlockStats(
                name=f"blocks.{i + 1}",
                params=params,
                param_bytes=params * 4,
                fwd_flops=2.0 * fi * fo,
                # the Linear's input, and GELU's input (none after the output layer)
                saved_bytes=float((fi + (0 if last else fo)) * act_bytes),
                output_bytes=float(fo * act_bytes),
                linears=((fi, fo),),
                rows_per_sample=1,
            )
        )
    return ModelStats(
        name="mlp",
        blocks=tuple(blocks),
        dtype_bytes=4,
        tokens_per_sample=1,
        optimizer_state_per_param=optimizer_state_per_param,
        tp_divisor=n_embd,  # colwise/rowwise pairs split the hidden width
    )
